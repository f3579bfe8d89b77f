"""Prefill replicas that host sessions (`transfer.prefill_hosts`): the real turn
orchestration (`app.turn.turns.Turns`) with the fake engines of `tests.test_turns`, whose
prefill replica "prefill-0" answers decode calls that prefer it and keeps its own prefix
cache."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from app.turn.pacing import DecodeStreams
from app.turn.placement import DecodeLoad, Limits, Placement, Reason, place_hosted
from app.turn.replicas import HOST_RETRY_S, hosting_replica
from connector.handle import first_leg_params, local_decode_params
from connector.store import TurnOutcome
from tests.test_turns import MAX_TOKENS, P1, USER2, USER3, FakeEngines, Rig, enc, expected_answer

HOST = "prefill-0"
HOSTING = {"transfer.prefill_hosts": True, "transfer.decode_local_tokens": 512}


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    return str(path)


def hosting_rig(model_dir, *, decode_busy: bool = True, **overrides) -> Rig:
    """A rig whose prefill replica may host; `decode_busy`: each decode replica streams an
    answer (so the idle prefill replica is the least loaded, not a coin toss among equals)."""
    engines = FakeEngines()
    engines.prefill_hosts.add(HOST)
    rig = Rig(model_dir, engines, **{**HOSTING, **overrides})
    for replica in engines.replica_ids if decode_busy else ():
        rig.turns.streams.of(replica).streams = 1
    return rig


def make_late(rig: Rig, replica: str, idle_s: float = 0.0) -> None:
    """The replica's streams came late, past their share: no budget left; its last stream
    ended `idle_s` ago."""
    streams = rig.turns.streams.of(replica)
    for _ in range(50):
        streams.late.observe(1.0)
    streams.last_end = time.monotonic() - idle_s
    assert streams.late.budget < 0


async def test_an_idle_prefill_replica_hosts_a_new_session_and_its_next_turns(model_dir):
    rig = hosting_rig(model_dir)
    text1, ids1, r1 = await rig.turn(text=P1)
    # No prefill leg: the prefill replica computed and streamed the whole turn, as one engine would.
    assert rig.engines.prefill_requests == []
    request, replica = rig.engines.decode_requests[0]
    assert replica == HOST == r1.decode_replica and request.kv_params == local_decode_params()
    assert (text1, ids1) == expected_answer(rig.engines, len(enc(P1)))
    assert r1.placement == "hosted" and rig.turns.counts["placed_hosted"] == 1
    assert rig.store.ended[0][2].handle.engine_id == f"d-{HOST}"  # its blocks are kept there

    # The next turn stays there, over what that replica's prefix cache holds.
    text2 = P1 + text1 + USER2
    _, ids2, r2 = await rig.turn(text=text2)
    assert rig.engines.prefill_requests == [] and rig.engines.pulls == []
    assert rig.engines.decode_requests[1][1] == HOST == r2.decode_replica
    history = len(enc(P1)) + MAX_TOKENS
    assert r2.cached_tokens == history // 4 * 4 and r2.reused_from_decode == 0
    assert ids2 == expected_answer(rig.engines, len(r2.prompt_token_ids))[1]
    assert rig.turns.counts["decode_local_cached_tokens"] == r2.cached_tokens
    assert [o for _, o, _ in rig.store.ended] == [TurnOutcome.UNUSED, TurnOutcome.UNUSED]


async def test_a_hosted_session_whose_streams_would_come_late_is_handed_to_decode(model_dir):
    rig = hosting_rig(model_dir)
    text1, ids1, r1 = await rig.turn(text=P1)
    assert r1.decode_replica == HOST
    make_late(rig, HOST)
    text2 = P1 + text1 + USER2
    _, ids2, r2 = await rig.turn(text=text2)
    # Through prefill: the leg runs on the hosting replica over its own cache (no pull of
    # its own blocks), and a decode replica reads the whole prompt from it.
    assert r2.placement == "itl" and rig.turns.counts["host_handoff"] == 1
    leg = rig.engines.prefill_requests[0]
    assert leg.preferred_replica == HOST and leg.kv_params == first_leg_params()
    assert rig.engines.pulls == []
    history = len(enc(P1)) + MAX_TOKENS
    assert r2.cached_tokens == history // 4 * 4 and r2.reused_from_decode == 0
    request, replica = rig.engines.decode_requests[-1]
    assert request.kv_params["do_remote_prefill"] is True and request.preferred_replica is None
    assert replica == r2.decode_replica == "decode-0"
    assert ids2 == expected_answer(rig.engines, len(r2.prompt_token_ids))[1]
    # The hosted handle was left unread (released), decode's new one is stored.
    assert rig.store.ended[-1][1] is TurnOutcome.UNUSED
    assert rig.store.ended[-1][2].handle.engine_id == "d-decode-0"

    # From then on the session is decode's: its short next turn is computed there.
    text3 = text2 + "".join(chr(i - 1000) for i in ids2) + USER3
    _, _, r3 = await rig.turn(text=text3)
    assert r3.decode_replica == "decode-0" and r3.placement == "short"
    assert len(rig.engines.prefill_requests) == 1 and rig.turns.counts["host_handoff"] == 1
    assert r3.cached_tokens == (len(r2.prompt_token_ids) + MAX_TOKENS) // 4 * 4


async def test_new_sessions_go_to_decode_while_the_prefill_replica_is_late_or_busier(model_dir):
    rig = hosting_rig(model_dir)
    make_late(rig, HOST)
    _, _, r1 = await rig.turn(text=P1)
    assert r1.decode_replica in ("decode-0", "decode-1") and rig.turns.counts["placed_hosted"] == 0

    busier = hosting_rig(model_dir, decode_busy=False)
    busier.turns.streams.of(HOST).streams = 1  # one answer streaming there, none on decode
    _, _, r2 = await busier.turn(text=P1)
    assert r2.decode_replica in ("decode-0", "decode-1") and busier.turns.counts["placed_hosted"] == 0
    busier.turns.streams.of(HOST).streams = 0


async def test_a_late_prefill_replica_idle_long_enough_hosts_again(model_dir):
    rig = hosting_rig(model_dir)
    make_late(rig, HOST, idle_s=HOST_RETRY_S + 1)
    _, _, r1 = await rig.turn(text=P1)
    assert r1.decode_replica == HOST and r1.placement == "hosted"
    assert rig.turns.streams.of(HOST).late.budget >= 0  # a fresh record


async def test_idle_replicas_of_both_pools_share_new_sessions_out(model_dir):
    rig = hosting_rig(model_dir, decode_busy=False)
    where = Counter()
    for i in range(30):
        _, _, r = await rig.turn(text=P1 + f" session {i}", session=f"s{i}")
        where[r.decode_replica] += 1
    assert set(where) == {HOST, "decode-0", "decode-1"}, where
    assert rig.turns.counts["placed_hosted"] == where[HOST]


async def test_without_prefill_hosts_prefill_hosts_nothing(model_dir):
    engines = FakeEngines()
    engines.prefill_hosts.add(HOST)
    rig = Rig(model_dir, engines, **{"transfer.decode_local_tokens": 512})
    _, _, r1 = await rig.turn(text=P1)
    assert r1.decode_replica in ("decode-0", "decode-1") and rig.turns.counts["placed_hosted"] == 0
    # Nor without prefix caching on prefill (a hosted turn would recompute its history).
    no_cache = hosting_rig(model_dir, **{"prefill.enable_prefix_caching": False})
    assert not no_cache.cfg.prefill_hosts
    _, _, r2 = await no_cache.turn(text=P1)
    assert r2.decode_replica in ("decode-0", "decode-1")


LIMITS = Limits(short_tokens=512, max_tokens=2048, itl_target_s=0.05)


def test_a_hosted_turn_stays_until_its_streams_come_late_beyond_their_share():
    idle = DecodeLoad(seconds_per_token=1e-3)
    assert place_hosted(1500, idle, LIMITS).reason is Reason.HOSTED
    # Two streams there, a 300-token turn makes each late once (a 0.33 s step): priced,
    # and it stays even past the budget left (a leg there would stall them as long).
    busy = DecodeLoad(seconds_per_token=1e-3, streams=2, seconds_per_step=0.03, late_budget=1)
    placed = place_hosted(300, busy, LIMITS)
    assert placed.local and placed.late_outputs == 2
    # Its streams came late beyond their share: the session goes through prefill to decode.
    late = DecodeLoad(seconds_per_token=1e-3, streams=2, seconds_per_step=0.03, late_budget=-1)
    assert place_hosted(30, late, LIMITS) == Placement(False, Reason.ITL, stream_step_s=0.06, late_outputs=0)
    # Past what decode is ever given: through prefill.
    assert place_hosted(3000, idle, LIMITS).reason is Reason.TOO_LONG
    # Unmeasured there: the prefill pool's pace stands in (same engine).
    unmeasured = DecodeLoad(seconds_per_token=None, streams=2, seconds_per_step=0.03, late_budget=1)
    assert place_hosted(300, unmeasured, LIMITS, pace=1e-3).late_outputs == 2
    assert place_hosted(300, unmeasured, LIMITS, pace=1e-5).late_outputs == 0


def test_prefill_legs_in_flight_end_hosting():
    # The regime rule: while prefill runs legs it is needed for them, which would stall
    # the streams it hosts: a hosted session goes to decode, and no new one is hosted.
    idle = DecodeLoad(seconds_per_token=1e-3)
    assert place_hosted(30, idle, LIMITS, legs_in_flight=0).reason is Reason.HOSTED
    assert place_hosted(30, idle, LIMITS, legs_in_flight=1).reason is Reason.ITL
    streams = DecodeStreams()
    last = lambda replicas: sorted(replicas)[-1]  # noqa: E731  # prefill-0 among equals
    assert hosting_replica([HOST], ["decode-0"], streams, {}, 0, 0.0, last) == HOST
    assert hosting_replica([HOST], ["decode-0"], streams, {}, 500, 0.0, last) is None
    # A decode replica less loaded takes the session.
    streams.of(HOST).streams = 1
    assert hosting_replica([HOST], ["decode-0"], streams, {}, 0, 0.0, last) is None
    streams.of(HOST).streams = 0
    # Late beyond their share: no new session until it has streamed nothing HOST_RETRY_S.
    for _ in range(50):
        streams.of(HOST).late.observe(1.0)
    streams.of(HOST).last_end = 100.0
    assert hosting_replica([HOST], ["decode-0"], streams, {}, 0, 105.0, last) is None
    assert hosting_replica([HOST], ["decode-0"], streams, {}, 0, 100.0 + HOST_RETRY_S, last) == HOST
