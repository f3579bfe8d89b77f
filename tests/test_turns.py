"""`app.turn.turns.Turns`: the real turn orchestration, with fake engines and the real handle
store logic behind an in-process adapter. No Ray, no vLLM.

The fake engines follow the NixlConnector's contract:

* prefill, asked with decode-side params (history held by a decode engine), reports the
  offered positions as cached and returns prefill-side params (`do_remote_prefill`);
* decode streams deterministic tokens and, on the last chunk, returns decode-side params
  for its own blocks (prompt + answer, without the last generated token).

Generated ids are >= 1000 while the tokenizer maps each character to `ord(c)`: re-tokenizing
an answer's text gives other ids than the engine generated, as BPE tokenizers can.
"""

from __future__ import annotations

import asyncio
import dataclasses
import string
from collections import Counter
from collections.abc import AsyncIterator, Sequence

import pytest

from app.api.protocol import APIError
from app.config import AppConfig
from app.engines.wire import EngineChunk, EngineRequest, Sampling
from app.fleet.clients import store_settings
from app.turn.events import Continuation
from app.turn.legs import DECODE_ATTEMPTS, ENGINE_PARTS, continuation_of
from app.turn.model import Delta, TurnInput, TurnResult
from app.turn.pacing import LegPace
from app.turn.turns import Turns
from connector.handle import first_leg_params, local_decode_params
from connector.store import Claim, Conversation, HandleStore, TurnOutcome
from tests.conftest import config_with

BLOCK = 4
THRESHOLD = 8
EOS = 1999
EOS_PIECE = "<eos>"
PARTIAL = 3000
SYSTEM = "SYSTEM: be brief.\n"
P1 = SYSTEM + "USER: hello there\nASSISTANT:"
USER2 = "\nUSER: tell me more\nASSISTANT:"
USER3 = "\nUSER: thanks\nASSISTANT:"
MAX_TOKENS = 6


class FakeTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def piece(self, token_id: int) -> str:
        if token_id >= PARTIAL:  # a character's first bytes (`FakeEngines.held`)
            return "\ufffd"
        return EOS_PIECE if token_id == EOS else chr(token_id - 1000)


def letter_at(position: int) -> str:
    return string.ascii_lowercase[position % 26]


ENGINE_TIMINGS = {
    "queue_s": 0.0,
    "first_token_s": 0.004,
    "input_s": 0.001,
    "compute_s": 0.002,
    "output_s": 0.001,
}
"""An engine leg's timings as `app.engines.engine` reports them."""


class FakeEngines:
    """One prefill replica and some decode replicas, following the engines' contract."""

    def __init__(
        self, decode_replicas=("decode-0", "decode-1"), *, keeps_kv=True, eos=False, stop_string=False
    ):
        self.replica_ids = list(decode_replicas)
        self.dead: set[str] = set()
        self.stopping: set[str] = set()
        """Replicas out of the running set that still live (Serve drains them)."""
        self.broken: set[str] = set()  # raise before any output
        self.prefill_failures = 0  # the next this many prefill calls raise
        self.prefill_unreachable = False  # prefill calls wait forever (no live replica)
        self.fail_mid_stream = False
        self.die_after: dict[str, int] = {}
        """Replica -> tokens of an answer after which it dies (then it is dead to the router)."""
        self.chunk_tokens: dict[str, int] = {}  # replica -> tokens per chunk (default 2)
        self.held: set[int] = set()
        """Positions of tokens that end mid-character (ids from `PARTIAL`): their text comes
        with the next token's. A prompt that ends with one gives its text first (vLLM's
        detokenizer)."""
        self.keeps_kv = keeps_kv
        self.eos = eos
        self.stop_string = stop_string
        self.prefill_requests: list[EngineRequest] = []
        self.decode_requests: list[tuple[EngineRequest, str]] = []
        self.seen: dict[str, list[tuple[int, ...]]] = {}  # replica -> sequences it computed
        self.pulls: list[tuple[str, int]] = []
        self.prefill_hosts: set[str] = set()
        """Running prefill replicas that may host sessions (`transfer.prefill_hosts`)."""

    # -- prefill ---------------------------------------------------------------------------

    async def prefill(self, request: EngineRequest) -> tuple[EngineChunk, str]:
        self.prefill_requests.append(request)
        if self.prefill_unreachable:
            await asyncio.Event().wait()
        if self.prefill_failures:
            self.prefill_failures -= 1
            await asyncio.sleep(0)
            raise RuntimeError("prefill replica died")
        prompt = request.prompt_token_ids
        kv = request.kv_params or {}
        replica = (
            request.preferred_replica if request.preferred_replica in self.prefill_hosts else "prefill-0"
        )
        cached = self._local_cache_hit(replica, prompt)  # its own prefix cache
        if kv.get("do_remote_decode") and kv.get("remote_engine_id") is not None:
            assert kv["do_remote_prefill"] is False
            cached = min(int(kv["remote_num_tokens"]), len(prompt) - 1)
            self.pulls.append((kv["remote_engine_id"], cached))
        out_params = None
        if kv.get("do_remote_decode"):
            out_params = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [list(range(-(-len(prompt) // BLOCK)))],
                "remote_engine_id": "p-0",
                "remote_request_id": request.request_id,
                "remote_host": "10.0.0.1",
                "remote_port": 5600,
                "tp_size": 1,
                "remote_num_tokens": len(prompt),
            }
        await asyncio.sleep(0)
        return (
            EngineChunk(
                token_ids=(7,),
                text="x",
                finished=True,
                finish_reason="length",
                num_prompt_tokens=len(prompt),
                num_cached_tokens=cached,
                kv_params=out_params,
                engine_timings=ENGINE_TIMINGS,
            ),
            replica,
        )

    # -- decode ----------------------------------------------------------------------------

    def answer(self, prompt_len: int, n: int) -> list[tuple[int, str]]:
        """(id, text) of each generated token: a function of the prompt length."""
        out = [(1000 + ord(letter_at(prompt_len + k)), letter_at(prompt_len + k)) for k in range(n)]
        pending = "<PROMPT TEXT>" if prompt_len - 1 in self.held else ""
        for k, (token, text) in enumerate(out):
            pending += text
            if prompt_len + k in self.held:
                token += PARTIAL - 1000
            out[k] = (token, "" if prompt_len + k in self.held else pending)
            pending = pending if prompt_len + k in self.held else ""
        if self.eos and out:
            out[-1] = (EOS, "")
        return out

    def _pick(self, request: EngineRequest) -> str:
        if request.preferred_replica in self.prefill_hosts:
            return request.preferred_replica
        alive = [r for r in self.replica_ids if r not in self.dead]
        if request.preferred_replica in alive:
            return request.preferred_replica
        alive = [r for r in alive if r not in request.avoid_replicas] or alive
        # Without a preference the router picks a healthy replica when there is one.
        healthy = [r for r in alive if r not in self.broken]
        return (healthy or alive)[0]

    def _local_cache_hit(self, replica: str, prompt: tuple[int, ...]) -> int:
        best = 0
        for seq in self.seen.get(replica, []):
            n = 0
            while n < min(len(seq), len(prompt) - 1) and seq[n] == prompt[n]:
                n += 1
            best = max(best, n // BLOCK * BLOCK)
        return best

    async def decode(self, request: EngineRequest) -> AsyncIterator[tuple[EngineChunk, str]]:
        replica = self._pick(request)
        self.decode_requests.append((request, replica))
        await asyncio.sleep(0)
        if replica in self.broken:
            raise RuntimeError(f"{replica} is gone")
        prompt = request.prompt_token_ids
        kv = request.kv_params
        if kv is not None and kv["do_remote_prefill"]:
            assert kv["do_remote_decode"] is False
            cached = len(prompt)  # read from prefill
        else:  # no params, or computing locally (`local_decode_params`)
            assert kv is None or kv == {"do_remote_prefill": False, "do_remote_decode": False}
            cached = self._local_cache_hit(replica, prompt)
        tokens = self.answer(len(prompt), request.sampling.max_tokens)
        size = self.chunk_tokens.get(replica, 2)
        chunks = [tokens[i : i + size] for i in range(0, len(tokens), size)]
        generated: list[int] = []
        for i, part in enumerate(chunks):
            ids = tuple(t for t, _ in part)
            text = "".join(s for _, s in part)
            generated.extend(ids)
            last = i == len(chunks) - 1
            if self.fail_mid_stream and i == 1:
                raise RuntimeError("decode engine died mid-stream")
            if len(generated) > self.die_after.get(replica, len(tokens)):
                self.dead.add(replica)
                raise RuntimeError(f"{replica} died mid-stream")
            final_params = None
            # Only a request with transfer params keeps its blocks (the NixlConnector).
            if last and self.keeps_kv and kv is not None:
                final_params = {
                    "do_remote_prefill": False,
                    "do_remote_decode": True,
                    "remote_block_ids": [list(range(100, 100 + -(-(len(prompt) + len(generated)) // BLOCK)))],
                    "remote_engine_id": f"d-{replica}",
                    "remote_request_id": request.request_id,
                    "remote_host": "10.0.0.2",
                    "remote_port": 5601,
                    "tp_size": 1,
                    "dcp_size": 1,
                    "pp_size": 1,
                    "remote_num_tokens": len(prompt) + len(generated) - 1,
                    "remote_blocks_expiry_time": 999.1,
                    "transfer_mode": "pull",
                }
            finish = None
            if last:
                finish = "stop" if (self.eos or self.stop_string) else "length"
            yield (
                EngineChunk(
                    token_ids=ids,
                    text=text,
                    finished=last,
                    finish_reason=finish,
                    stop_reason="###" if (last and self.stop_string) else None,
                    num_prompt_tokens=len(prompt),
                    num_cached_tokens=cached if last else 0,
                    kv_params=final_params,
                    engine_timings=ENGINE_TIMINGS if i == 0 else None,
                ),
                replica,
            )
            await asyncio.sleep(0)
        self.seen.setdefault(replica, []).append(prompt + tuple(generated))

    def decode_alive(self, replica_id: str) -> bool | None:
        if replica_id in self.dead:
            return False
        return True if replica_id in self.replica_ids else None

    async def decode_stopping(self, replica_id: str) -> bool:
        return replica_id in self.stopping

    def decode_replicas(self) -> frozenset[str] | None:
        return frozenset(r for r in self.replica_ids if r not in self.dead)

    def hosts_on_prefill(self, replica_id: str | None) -> bool:
        return replica_id in self.prefill_hosts

    def prefill_replicas(self) -> frozenset[str] | None:
        return frozenset(self.prefill_hosts)


class LocalStore:
    """The `Store` seam over an in-process `HandleStore` (the actor's logic, no Ray)."""

    def __init__(self, inner: HandleStore):
        self.inner = inner
        self.ended: list[tuple[str, TurnOutcome, Conversation | None]] = []
        self.dropped: list[str] = []

    async def match(
        self, prompt_ids: Sequence[int], prompt_text: str | None = None
    ) -> tuple[str | None, int]:
        return self.inner.match(list(prompt_ids), prompt_text)

    async def begin_turn(self, session_id: str) -> Claim:
        return self.inner.begin_turn(session_id)

    async def end_turn(
        self,
        claim: Claim,
        outcome: TurnOutcome,
        conversation: Conversation | None,
        engine_blocks=None,
        retain: bool = False,
    ) -> None:
        self.ended.append((claim.session_id, outcome, conversation))
        self.inner.end_turn(claim.lease_id, outcome, conversation, engine_blocks, retain)

    async def drop_engine(self, engine_id: str) -> int:
        self.dropped.append(engine_id)
        return self.inner.drop_engine(engine_id)

    def stats(self) -> dict:
        return self.inner.stats()


class NoStore:
    """A store that must not be used."""

    def __getattr__(self, name):
        raise AssertionError(f"store.{name} used")


# -- fixtures and helpers --------------------------------------------------------------------


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    return str(path)


def make_cfg(model_dir, **overrides) -> AppConfig:
    tree = {
        "model": model_dir,
        "mode": "bidir",
        "max_model_len": 256,
        "default_max_tokens": 16,
        "block_size": BLOCK,
        # Every turn through prefill unless a test turns decode-local turns on.
        "transfer": {"recompute_threshold_tokens": THRESHOLD, "decode_local_tokens": 0},
        "sessions": {"handle_ttl_s": 60},
    }
    return config_with(tree, overrides)


def make_store(cfg: AppConfig) -> LocalStore:
    """One shard's store as the app builds it from `cfg` (`store_settings`)."""
    return LocalStore(store_settings(cfg).handle_store())


class Rig:
    def __init__(self, model_dir, engines: FakeEngines | None = None, **cfg_overrides):
        self.cfg = make_cfg(model_dir, **cfg_overrides)
        self.engines = engines or FakeEngines(keeps_kv=self.cfg.reuses_kv)
        self.store = make_store(self.cfg)
        self.turns = Turns(self.cfg, self.engines, self.store, FakeTokenizer())
        self._n = 0

    def input(
        self, *, text=None, ids=None, session="s1", max_tokens=MAX_TOKENS, given=True, **kw
    ) -> TurnInput:
        self._n += 1
        return TurnInput(
            request_id=f"req-{self._n}",
            sampling=Sampling(max_tokens=max_tokens, temperature=0.0),
            session_id=session,
            prompt_text=text,
            prompt_ids=None if ids is None else tuple(ids),
            max_tokens_given=given,
            **kw,
        )

    async def turn(self, **kw) -> tuple[str, list[int], TurnResult]:
        return await collect(self.turns.run(self.input(**kw)))


async def collect(events) -> tuple[str, list[int], TurnResult]:
    text, ids, result = [], [], None
    async for event in events:
        if isinstance(event, Delta):
            assert result is None, "delta after the result"
            text.append(event.text)
            ids.extend(event.token_ids)
        else:
            assert isinstance(event, TurnResult)
            result = event
    assert result is not None
    return "".join(text), ids, result


def enc(text: str) -> tuple[int, ...]:
    return tuple(FakeTokenizer().encode(text))


def expected_answer(engines: FakeEngines, prompt_len: int, n: int = MAX_TOKENS) -> tuple[str, list[int]]:
    tokens = engines.answer(prompt_len, n)
    return "".join(s for _, s in tokens), [t for t, _ in tokens]


# -- bidir: the product -----------------------------------------------------------------------


async def test_first_turn_misses_then_second_turn_reuses_decode_history(model_dir):
    rig = Rig(model_dir)
    text1, ids1, r1 = await rig.turn(text=P1)
    p1 = enc(P1)
    assert (text1, ids1) == expected_answer(rig.engines, len(p1))
    assert r1.miss_reason == "no_conversation"
    assert r1.cached_tokens == 0 and r1.reused_from_decode == 0
    assert r1.prompt_token_ids == p1 and r1.prompt_tokens == len(p1)
    assert r1.completion_tokens == MAX_TOKENS
    assert r1.finish_reason == "length"
    assert r1.decode_replica == "decode-0"
    assert not r1.spliced
    # Prefill's first leg: compute everything, keep it for decode.
    assert rig.engines.prefill_requests[0].kv_params == first_leg_params()
    assert rig.engines.prefill_requests[0].request_id == "req-1-prefill"
    decode_req, _ = rig.engines.decode_requests[0]
    assert decode_req.kv_params["do_remote_prefill"] is True
    assert decode_req.kv_params["remote_engine_id"] == "p-0"
    assert decode_req.kv_params["remote_request_id"] == "req-1-prefill"
    assert decode_req.preferred_replica is None

    text2 = P1 + text1 + USER2
    _, ids2, r2 = await rig.turn(text=text2)
    history = p1 + tuple(ids1)
    assert r2.spliced
    # Token-in/token-out: the generated ids, not the re-tokenized answer text.
    assert r2.prompt_token_ids == history + enc(USER2)
    assert r2.prompt_token_ids != enc(text2)
    offered = len(history) - 1  # the last generated token has no KV on decode
    pre = rig.engines.prefill_requests[1]
    assert pre.kv_params["do_remote_decode"] is True and pre.kv_params["do_remote_prefill"] is False
    assert pre.kv_params["remote_engine_id"] == "d-decode-0"
    assert pre.kv_params["remote_request_id"] == "req-1"
    assert pre.kv_params["remote_num_tokens"] == offered
    assert rig.engines.pulls == [("d-decode-0", offered)]
    assert r2.cached_tokens == offered
    assert r2.reused_from_decode == offered
    assert r2.miss_reason is None
    decode_req, replica = rig.engines.decode_requests[1]
    assert decode_req.preferred_replica == "decode-0" and replica == "decode-0"
    assert ids2 == expected_answer(rig.engines, len(r2.prompt_token_ids))[1]

    counts = rig.store.inner.counts
    assert counts["claimed"] == 1 and counts["pulled"] == 1 and counts["stored"] == 2
    assert [o for _, o, _ in rig.store.ended] == [TurnOutcome.UNUSED, TurnOutcome.PULLED]
    assert rig.store.stats()["claimed_handles"] == 0
    assert rig.store.stats()["handles"] == {"stored": 1}
    assert rig.turns.counts["handle_used"] == 1
    assert rig.turns.counts["cached_tokens"] == offered
    assert rig.turns.counts["turns"] == 2

    # Turn 3 continues from turn 2's handle.
    text3, ids3, r3 = await rig.turn(text=text2 + "".join(chr(i - 1000) for i in ids2) + USER3)
    assert r3.spliced and r3.miss_reason is None
    assert r3.cached_tokens == len(r2.prompt_token_ids) + MAX_TOKENS - 1
    assert rig.engines.prefill_requests[2].kv_params["remote_request_id"] == "req-2"


async def test_stored_conversation_is_exact(model_dir):
    rig = Rig(model_dir)
    text1, ids1, _ = await rig.turn(text=P1)
    conv = rig.store.ended[0][2]
    assert conv.session_id == "s1"
    assert conv.token_ids == enc(P1) + tuple(ids1)
    assert conv.prompt_len == len(enc(P1))
    assert conv.text == P1 + text1
    assert conv.decode_replica == "decode-0"
    assert conv.handle.engine_id == "d-decode-0"
    assert conv.handle.num_tokens == len(conv.token_ids) - 1


async def test_without_token_in_token_out_reuse_stops_at_the_answer(model_dir):
    rig = Rig(model_dir, **{"sessions.token_in_token_out": False})
    text1, _, _ = await rig.turn(text=P1)
    _, _, r2 = await rig.turn(text=P1 + text1 + USER2)
    assert not r2.spliced
    assert r2.prompt_token_ids == enc(P1 + text1 + USER2)
    # The re-tokenized answer has other ids: only the first prompt agrees.
    assert r2.cached_tokens == len(enc(P1))
    assert rig.engines.prefill_requests[1].kv_params["remote_num_tokens"] == len(enc(P1))
    assert rig.turns.counts["drift_tokens"] == MAX_TOKENS - 1
    assert rig.store.inner.counts["pulled"] == 1


async def test_eos_piece_keeps_the_splice(model_dir):
    engines = FakeEngines(eos=True)
    rig = Rig(model_dir, engines)
    text1, ids1, r1 = await rig.turn(text=P1)
    assert r1.finish_reason == "stop" and ids1[-1] == EOS
    assert rig.store.ended[0][2].text == P1 + text1 + EOS_PIECE
    # The chat template renders the end-of-turn token after the answer.
    _, _, r2 = await rig.turn(text=P1 + text1 + EOS_PIECE + USER2)
    assert r2.spliced
    assert r2.prompt_token_ids == enc(P1) + tuple(ids1) + enc(USER2)
    assert r2.cached_tokens == len(enc(P1)) + MAX_TOKENS - 1


async def test_stop_string_disables_the_splice(model_dir):
    engines = FakeEngines(stop_string=True)
    rig = Rig(model_dir, engines)
    text1, _, _ = await rig.turn(text=P1)
    assert rig.store.ended[0][2].text is None
    _, _, r2 = await rig.turn(text=P1 + text1 + USER2)
    assert not r2.spliced
    assert r2.cached_tokens == len(enc(P1))


async def test_token_prompts_reuse_history(model_dir):
    rig = Rig(model_dir)
    p1 = enc(P1)
    _, ids1, r1 = await rig.turn(ids=p1)
    assert r1.prompt_token_ids == p1
    assert rig.store.ended[0][2].text is None
    p2 = p1 + tuple(ids1) + enc(USER2)
    _, _, r2 = await rig.turn(ids=p2)
    assert not r2.spliced
    assert r2.cached_tokens == len(p1) + MAX_TOKENS - 1


async def test_edited_history_is_not_pulled(model_dir):
    rig = Rig(model_dir)
    text1, _, _ = await rig.turn(text=P1)
    edited = "X" + P1[1:] + text1 + USER2
    _, ids2, r2 = await rig.turn(text=edited)
    assert not r2.spliced
    assert r2.miss_reason == "prefix_mismatch"
    assert r2.prompt_token_ids == enc(edited)
    assert r2.cached_tokens == 0 and r2.reused_from_decode == 0
    assert rig.engines.prefill_requests[1].kv_params == first_leg_params()
    assert rig.engines.pulls == []
    assert ids2 == expected_answer(rig.engines, len(enc(edited)))[1]
    # The claimed handle was not read; the edited conversation is stored for next time.
    assert rig.store.ended[1][1] is TurnOutcome.UNUSED
    assert rig.store.inner.counts["unused"] == 1
    assert rig.store.stats()["claimed_handles"] == 0
    assert rig.turns.counts["miss_prefix_mismatch"] == 1
    assert rig.store.ended[1][2].token_ids == enc(edited) + tuple(ids2)


async def test_history_shorter_than_threshold_is_recomputed(model_dir):
    rig = Rig(model_dir, **{"transfer.recompute_threshold_tokens": 1000})
    text1, _, _ = await rig.turn(text=P1)
    _, _, r2 = await rig.turn(text=P1 + text1 + USER2)
    assert r2.spliced
    assert r2.miss_reason == "too_short"
    assert r2.cached_tokens == 0
    assert rig.engines.prefill_requests[1].kv_params == first_leg_params()
    assert rig.store.ended[1][1] is TurnOutcome.UNUSED


async def test_dead_decode_replica_drops_its_handles(model_dir):
    rig = Rig(model_dir)
    text1, _, r1 = await rig.turn(text=P1)
    assert r1.decode_replica == "decode-0"
    rig.engines.dead.add("decode-0")
    text2 = P1 + text1 + USER2
    _, ids2, r2 = await rig.turn(text=text2)
    assert r2.miss_reason == "replica_gone"
    assert rig.store.dropped == ["d-decode-0"]
    assert r2.cached_tokens == 0
    assert rig.engines.prefill_requests[1].kv_params == first_leg_params()
    assert rig.engines.pulls == []
    assert r2.decode_replica == "decode-1"
    assert rig.store.ended[1][1] is TurnOutcome.UNUSED
    assert rig.turns.counts["miss_replica_gone"] == 1
    # The next turn reuses the new replica's history.
    _, _, r3 = await rig.turn(text=text2 + "".join(chr(i - 1000) for i in ids2) + USER3)
    assert r3.miss_reason is None
    assert rig.engines.pulls[-1][0] == "d-decode-1"
    assert r3.cached_tokens == len(r2.prompt_token_ids) + MAX_TOKENS - 1


async def test_a_draining_decode_replicas_history_is_still_pulled(model_dir):
    rig = Rig(model_dir)
    text1, _, r1 = await rig.turn(text=P1)
    assert r1.decode_replica == "decode-0"
    # Serve took it out of the routing set but drains it: its engine still holds the KV.
    rig.engines.dead.add("decode-0")
    rig.engines.stopping.add("decode-0")
    _, _, r2 = await rig.turn(text=P1 + text1 + USER2)
    assert r2.miss_reason is None and rig.store.dropped == []
    assert rig.engines.pulls[-1][0] == "d-decode-0"
    assert r2.cached_tokens == len(r1.prompt_token_ids) + MAX_TOKENS - 1
    assert r2.decode_replica == "decode-1"
    assert rig.turns.counts["pull_from_draining"] == 1


async def test_a_turn_waits_for_its_conversations_move_and_reads_the_new_copy(model_dir):
    rig = Rig(model_dir)
    text1, ids1, r1 = await rig.turn(text=P1)
    inner = rig.store.inner
    claim = inner.begin_move("s1", "d-decode-0")
    assert claim is not None and claim.handle is not None
    moved = dataclasses.replace(claim.handle, engine_id="d-decode-1", request_id="moved-1")

    async def finish_move():
        await asyncio.sleep(0.12)  # a few of the turn's polls
        assert inner.end_move(claim.lease_id, moved, "decode-1") == "moved"

    mover = asyncio.create_task(finish_move())
    _, _, r2 = await rig.turn(text=P1 + text1 + USER2)
    await mover
    assert r2.miss_reason is None
    assert rig.turns.counts["move_waited"] >= 2
    assert rig.engines.pulls[-1][0] == "d-decode-1"  # the new copy, on the peer
    assert r2.cached_tokens == len(r1.prompt_token_ids) + MAX_TOKENS - 1


async def test_a_turn_waits_for_a_move_no_longer_than_drain_wait_s(model_dir):
    rig = Rig(model_dir, drain={"wait_s": 0.1})
    text1, _, _ = await rig.turn(text=P1)
    assert rig.store.inner.begin_move("s1", "d-decode-0") is not None  # never ends
    _, _, r2 = await rig.turn(text=P1 + text1 + USER2)
    assert r2.miss_reason == "moving" and r2.cached_tokens == 0
    assert rig.turns.counts["miss_moving"] == 1


async def test_decode_failure_settles_the_claim_as_failed(model_dir):
    rig = Rig(model_dir, **{"ingress.max_continuations": 0})  # a stream cut is not continued
    text1, _, _ = await rig.turn(text=P1)
    rig.engines.fail_mid_stream = True
    events = rig.turns.run(rig.input(text=P1 + text1 + USER2))
    got = []
    with pytest.raises(APIError) as err:  # a clear error for the client, not a bare 500
        async for event in events:
            got.append(event)
    assert (err.value.status, err.value.code, err.value.type) == (502, "decode_failed", "server_error")
    assert rig.turns.counts["decode_failed"] == 1
    assert len(got) == 1 and isinstance(got[0], Delta)  # the first chunk went out
    assert rig.engines.pulls  # prefill had pulled before decode failed
    session, outcome, conv = rig.store.ended[-1]
    assert (session, outcome, conv) == ("s1", TurnOutcome.FAILED, None)
    stats = rig.store.stats()
    assert stats["claimed_handles"] == 0 and stats["open_leases"] == 0
    assert rig.store.inner.counts["failed"] == 1
    assert rig.turns.counts["turns"] == 1
    # The next turn recomputes and answers.
    rig.engines.fail_mid_stream = False
    _, _, r3 = await rig.turn(text=P1 + text1 + USER2)
    assert r3.miss_reason == "failed"
    assert r3.cached_tokens == 0
    assert rig.store.stats()["handles"] == {"stored": 1}


async def test_client_disconnect_settles_the_claim(model_dir):
    rig = Rig(model_dir)
    text1, _, _ = await rig.turn(text=P1)
    events = rig.turns.run(rig.input(text=P1 + text1 + USER2))
    first = await events.__anext__()
    assert isinstance(first, Delta)
    await events.aclose()
    assert rig.store.ended[-1][1] is TurnOutcome.FAILED
    assert rig.store.stats()["claimed_handles"] == 0
    assert rig.store.stats()["open_leases"] == 0


async def test_decode_retried_when_preferred_replica_fails_before_output(model_dir):
    rig = Rig(model_dir)
    text1, _, _ = await rig.turn(text=P1)
    rig.engines.broken.add("decode-0")  # alive as far as the router knows, but fails
    text2 = P1 + text1 + USER2
    out2, ids2, r2 = await rig.turn(text=text2)
    (first, r_first), (retry, r_retry) = rig.engines.decode_requests[1:]
    assert (first.preferred_replica, r_first) == ("decode-0", "decode-0")
    assert retry.preferred_replica is None and retry.avoid_replicas == ("decode-0",) and r_retry == "decode-1"
    assert retry.request_id == first.request_id + "-retry1"
    # Not the prefill engine's blocks again (the failed reader may have freed them):
    # the survivor computes the prompt itself and keeps the turn's blocks.
    assert first.kv_params["do_remote_prefill"] and retry.kv_params == local_decode_params()
    assert retry.prompt_token_ids == first.prompt_token_ids
    assert r2.decode_replica == "decode-1"
    assert ids2 == expected_answer(rig.engines, len(r2.prompt_token_ids))[1]
    assert r2.cached_tokens == 0 and r2.reused_from_decode == 0  # decode-1 held nothing of it
    assert rig.turns.counts["decode_retried"] == 1 and rig.turns.counts["decode_restarted"] == 0
    assert rig.store.ended[-1][1] is TurnOutcome.PULLED
    assert rig.store.ended[-1][2].decode_replica == "decode-1"
    assert rig.store.ended[-1][2].handle.engine_id == "d-decode-1"


async def test_decode_failing_on_every_attempt_is_a_502(model_dir):
    rig = Rig(model_dir)
    rig.engines.broken.update(["decode-0", "decode-1"])
    with pytest.raises(APIError) as err:
        await rig.turn(text=P1)
    assert (err.value.status, err.value.code) == (502, "decode_failed")
    assert len(rig.engines.decode_requests) == DECODE_ATTEMPTS
    # A first turn names no replica, and one that fails before output does not say
    # which it was: the router's own view of dead replicas steers those retries.
    assert [r.request_id for r, _ in rig.engines.decode_requests] == ["req-1", "req-1-retry1", "req-1-retry2"]
    assert (
        rig.turns.counts["decode_retried"] == DECODE_ATTEMPTS - 1 and rig.turns.counts["decode_failed"] == 1
    )
    assert rig.store.ended == [("s1", TurnOutcome.UNUSED, None)]
    assert rig.store.stats()["open_leases"] == 0
    # The next turn of the session, on a healthy replica, answers.
    rig.engines.broken.clear()
    _, ids, r = await rig.turn(text=P1)
    assert ids == expected_answer(rig.engines, len(r.prompt_token_ids))[1]


async def test_decode_retried_without_preferred_replica(model_dir):
    rig = Rig(model_dir)
    rig.engines.broken.add("decode-0")
    rig.engines._pick = lambda request: "decode-0" if "-retry" not in request.request_id else "decode-1"
    _, ids, r = await rig.turn(text=P1)
    assert r.decode_replica == "decode-1" and rig.turns.counts["decode_retried"] == 1
    assert ids == expected_answer(rig.engines, len(r.prompt_token_ids))[1]


async def test_streamed_decode_not_retried_after_output(model_dir):
    rig = Rig(model_dir, **{"ingress.max_continuations": 0})
    text1, _, _ = await rig.turn(text=P1)
    rig.engines.fail_mid_stream = True
    with pytest.raises(APIError) as err:
        await rig.turn(text=P1 + text1 + USER2)
    assert len(rig.engines.decode_requests) == 2
    assert rig.turns.counts["decode_retried"] == 0
    assert err.value.body()["kvturn"] == {"decode_replica": "decode-0"}


async def test_unstreamed_turn_whose_decode_fails_midway_is_computed_again(model_dir):
    """Nothing reached the client of a turn that does not stream: a replica that dies
    midway costs a recompute on another replica, never an error, and the answer holds
    only the second attempt's tokens."""
    rig = Rig(model_dir)
    text1, _, _ = await rig.turn(text=P1)
    failing = rig.engines.decode

    async def decode(request):  # the session's replica dies after its first chunk
        rig.engines.fail_mid_stream = request.preferred_replica == "decode-0"
        async for item in failing(request):
            yield item

    rig.engines.decode = decode
    events = [e async for e in rig.turns.run(rig.input(text=P1 + text1 + USER2, stream=False))]
    deltas, result = events[:-1], events[-1]
    assert isinstance(result, TurnResult) and all(isinstance(d, Delta) for d in deltas)
    ids = [t for d in deltas for t in d.token_ids]
    assert ids == expected_answer(rig.engines, result.prompt_tokens)[1]
    assert result.decode_replica == "decode-1" and result.completion_tokens == len(ids)
    assert rig.turns.counts["decode_retried"] == 1 and rig.turns.counts["decode_restarted"] == 1
    assert rig.turns.counts["decode_failed"] == 0
    (first, r_first), (retry, r_retry) = rig.engines.decode_requests[1:]
    assert (r_first, r_retry) == ("decode-0", "decode-1") and retry.kv_params == local_decode_params()
    assert rig.store.ended[-1][2].decode_replica == "decode-1"


async def test_context_too_long(model_dir):
    rig = Rig(model_dir, max_model_len=64)
    text1, _, _ = await rig.turn(text=P1)  # 46 + 6 tokens fit
    long_prompt = P1 + text1 + USER2
    with pytest.raises(APIError) as err:
        await rig.turn(text=long_prompt, max_tokens=6)
    assert err.value.status == 400
    assert err.value.code == "context_length_exceeded"
    assert "64" in err.value.message
    assert len(rig.engines.prefill_requests) == 1 and len(rig.engines.decode_requests) == 1
    # The lease is released and the claimed handle settled.
    stats = rig.store.stats()
    assert stats["open_leases"] == 0 and stats["claimed_handles"] == 0
    assert rig.store.ended[-1] == ("s1", TurnOutcome.FAILED, None)


async def test_context_too_long_without_history(model_dir):
    rig = Rig(model_dir, max_model_len=32)
    with pytest.raises(APIError) as err:
        await rig.turn(text=P1)
    assert err.value.status == 400
    assert rig.store.ended == [("s1", TurnOutcome.UNUSED, None)]
    assert rig.store.stats()["open_leases"] == 0
    assert not rig.engines.prefill_requests and not rig.engines.decode_requests


class Params:
    """Stands for vLLM's `SamplingParams` in `Sampling.params` (only what the pipeline reads)."""

    def __init__(self, **kw):
        self.temperature, self.seed, self.min_tokens = 0.0, None, 0
        self.__dict__.update(kw)

    def clone(self):
        return Params(**self.__dict__)


async def _second_turn_cut(rig: Rig, max_tokens: int, **kw) -> tuple[str, list[int], TurnResult]:
    """Turn 1 on decode-0, then turn 2 of the session (streamed, on decode-0 again)."""
    text1, _, r1 = await rig.turn(text=P1)
    assert r1.decode_replica == "decode-0"
    return await rig.turn(text=P1 + text1 + USER2, max_tokens=max_tokens, **kw)


async def test_a_stream_cut_mid_answer_goes_on_on_another_replica(model_dir):
    """The session's decode replica dies after 4 tokens of a streamed answer: a survivor
    computes the prompt plus those tokens and generates the rest; the client gets every
    token once, the uninterrupted answer's, and no error."""
    rig = Rig(model_dir)
    text1, _, _ = await rig.turn(text=P1)
    rig.engines.die_after["decode-0"] = 4
    text, ids, r = await rig.turn(text=P1 + text1 + USER2, max_tokens=12)
    assert (text, ids) == expected_answer(rig.engines, r.prompt_tokens, 12)
    assert r.completion_tokens == 12 and r.decode_replica == "decode-1" and r.finish_reason == "length"
    (cut, r_cut), (cont, r_cont) = rig.engines.decode_requests[1:]
    assert (r_cut, r_cont) == ("decode-0", "decode-1")
    assert cont.request_id == cut.request_id + "-cont1" and cont.avoid_replicas == ("decode-0",)
    assert cont.prompt_token_ids == cut.prompt_token_ids + tuple(ids[:4])
    assert cont.sampling.max_tokens == 8 and cont.kv_params == local_decode_params()
    counts = rig.turns.counts
    assert counts["decode_continued"] == 1 and counts["decode_continued_resumed"] == 1
    assert counts["decode_continued_tokens"] == 4 and counts["decode_failed"] == 0
    assert counts["decode_continued_from/resumed/decode-0"] == 1
    assert counts["decode_retried"] == 0 and counts["decode_restarted"] == 0
    # The prompt was computed again on the survivor: nothing of the pulled history counts.
    assert r.reused_from_decode == 0 and r.cached_tokens <= r.prompt_tokens
    # The conversation goes on from the survivor, which holds the whole answer's KV.
    session, outcome, conv = rig.store.ended[-1]
    assert outcome is TurnOutcome.PULLED and conv.decode_replica == "decode-1"
    assert conv.token_ids == r.prompt_token_ids + tuple(ids) and conv.handle.engine_id == "d-decode-1"
    assert conv.handle.num_tokens == len(conv.token_ids) - 1
    _, ids3, r3 = await rig.turn(text=P1 + text1 + USER2 + text + USER3)
    assert r3.miss_reason is None and r3.reused_from_decode > 0
    assert ids3 == expected_answer(rig.engines, r3.prompt_tokens)[1]


@pytest.mark.parametrize(
    "chunk, held, cut_after", [(1, (2, 3), 4), (3, (2,), 3)], ids=["token-chunks", "merged-chunk"]
)
async def test_a_stream_cut_mid_character_resumes_after_the_last_whole_one(model_dir, chunk, held, cut_after):
    """Tokens that end mid-character (the engine holds their text back) are not put at the
    end of the survivor's prompt: it generates them again (dropped) and gives their text
    with the next token's. Even when a chunk's text came from its earlier tokens only."""
    rig = Rig(model_dir)
    p = len(enc(P1))
    rig.engines.chunk_tokens["decode-0"] = chunk
    rig.engines.held = {p + k for k in held}
    rig.engines.die_after = {"decode-0": cut_after}
    text, ids, r = await rig.turn(text=P1, max_tokens=8)
    assert (text, ids) == expected_answer(rig.engines, p, 8) and "PROMPT" not in text
    (_, r_cut), (cont, r_cont) = rig.engines.decode_requests
    assert (r_cut, r_cont) == ("decode-0", "decode-1")
    assert cont.prompt_token_ids == enc(P1) + tuple(ids[:2]) and cont.sampling.max_tokens == 6
    counts = rig.turns.counts
    assert counts["decode_continued_resumed"] == 1
    assert counts["decode_continued_tokens"] == 2 and counts["decode_replayed_tokens"] == cut_after - 2


async def test_a_stream_goes_on_through_as_many_cuts_as_allowed_then_fails(model_dir):
    engines = FakeEngines(("decode-0", "decode-1", "decode-2"))
    rig = Rig(model_dir, engines)
    engines.die_after = {"decode-0": 2, "decode-1": 2}
    text, ids, r = await rig.turn(text=P1, max_tokens=10)
    assert (text, ids) == expected_answer(engines, r.prompt_tokens, 10) and r.decode_replica == "decode-2"
    assert [len(req.prompt_token_ids) - r.prompt_tokens for req, _ in engines.decode_requests] == [0, 2, 4]
    assert rig.turns.counts["decode_continued"] == 2 and rig.turns.counts["decode_continued_tokens"] == 6

    engines = FakeEngines(("decode-0", "decode-1", "decode-2"))
    rig = Rig(model_dir, engines, **{"ingress.max_continuations": 1})
    engines.die_after = {"decode-0": 2, "decode-1": 2}
    got: list[int] = []
    with pytest.raises(APIError) as err:
        async for event in rig.turns.run(rig.input(text=P1, max_tokens=10)):
            got.extend(event.token_ids)
    assert (err.value.status, err.value.code) == (502, "decode_failed")
    assert err.value.body()["kvturn"] == {"decode_replica": "decode-1"}
    assert got == expected_answer(engines, len(enc(P1)), 4)[1]  # each token once, then the error
    counts = rig.turns.counts
    assert counts["decode_continued"] == 1 and counts["decode_continuations_exhausted"] == 1
    assert counts["decode_failed"] == 1
    assert rig.store.ended == [("s1", TurnOutcome.UNUSED, None)] and rig.store.stats()["open_leases"] == 0


async def test_a_continuation_that_dies_before_output_is_continued_again(model_dir):
    engines = FakeEngines(("decode-0", "decode-1", "decode-2"))
    rig = Rig(model_dir, engines)
    engines.die_after = {"decode-0": 4}
    engines.broken.add("decode-1")  # the replica the router picks next fails at once
    picks = {"req-1": "decode-0", "req-1-cont1": "decode-1", "req-1-cont2": "decode-2"}
    engines._pick = lambda request: picks[request.request_id]
    _, ids, r = await rig.turn(text=P1, max_tokens=8)
    assert ids == expected_answer(engines, r.prompt_tokens, 8)[1] and r.decode_replica == "decode-2"
    assert [rep for _, rep in engines.decode_requests] == ["decode-0", "decode-1", "decode-2"]
    last = engines.decode_requests[-1][0]
    assert last.request_id == "req-1-cont2" and last.avoid_replicas == ("decode-0",)
    assert rig.turns.counts["decode_continued"] == 2
    assert rig.turns.counts["decode_continued_from/resumed/unknown"] == 1  # it said no replica


async def test_unstreamed_turns_still_start_over(model_dir):
    rig = Rig(model_dir)
    rig.engines.die_after = {"decode-0": 2}
    events = [e async for e in rig.turns.run(rig.input(text=P1, stream=False))]
    ids = [t for e in events[:-1] for t in e.token_ids]
    assert ids == expected_answer(rig.engines, events[-1].prompt_tokens)[1]
    assert rig.turns.counts["decode_restarted"] == 1 and rig.turns.counts["decode_continued"] == 0


async def test_a_structured_output_stream_is_replayed_and_the_sent_tokens_dropped(model_dir):
    """vLLM never feeds a prompt to a request's grammar: a continuation of a prompt that ends
    mid-JSON would start a new document. The survivor generates the answer again from the
    start; the client gets only what it lacks, even where chunks split differently."""
    rig = Rig(model_dir)
    rig.engines.chunk_tokens["decode-1"] = 3
    params = Params(structured_outputs={"json": {"type": "object"}})
    text1, _, _ = await rig.turn(text=P1)
    rig.engines.die_after["decode-0"] = 4
    turn = rig.input(text=P1 + text1 + USER2, max_tokens=11)
    turn = dataclasses.replace(turn, sampling=dataclasses.replace(turn.sampling, params=params))
    deltas = [e async for e in rig.turns.run(turn)]
    r = deltas.pop()
    assert isinstance(r, TurnResult)
    text = "".join(d.text for d in deltas)
    ids = [t for d in deltas for t in d.token_ids]
    assert (text, ids) == expected_answer(rig.engines, r.prompt_tokens, 11)
    assert [len(d.token_ids) for d in deltas] == [2, 2, 2, 3, 2]  # 4 sent, then 5 of a 3-token chunk on
    (cut, _), (replay, r_replay) = rig.engines.decode_requests[1:]
    assert replay.prompt_token_ids == cut.prompt_token_ids and replay.sampling == cut.sampling
    assert r_replay == "decode-1" and replay.kv_params == local_decode_params()
    counts = rig.turns.counts
    assert counts["decode_continued_replayed_grammar"] == 1 and counts["decode_replayed_tokens"] == 4
    assert counts["decode_continued_from/replayed_grammar/decode-0"] == 1


async def test_a_replay_that_gives_other_tokens_ends_the_stream(model_dir):
    rig = Rig(model_dir)
    rig.engines.die_after = {"decode-0": 2}
    original = rig.engines.answer

    def answer(prompt_len, n):  # sampling without a seed: the replay draws otherwise
        return original(prompt_len + (1 if rig.engines.decode_requests[-1][1] == "decode-1" else 0), n)

    rig.engines.answer = answer
    turn = rig.input(text=P1, max_tokens=6)
    params = Params(temperature=0.7, stop=["###"])
    turn = dataclasses.replace(turn, sampling=dataclasses.replace(turn.sampling, params=params))
    with pytest.raises(APIError) as err:
        async for _ in rig.turns.run(turn):
            pass
    assert err.value.code == "decode_failed"
    counts = rig.turns.counts
    assert counts["decode_continued_replayed_output"] == 1 and counts["decode_continuation_diverged"] == 1


def test_how_an_answer_continues_follows_its_settings():
    greedy = Sampling(max_tokens=10, temperature=0.0)
    assert continuation_of(greedy, 4) is Continuation.RESUMED
    assert continuation_of(greedy, 10) is None  # nothing left to generate
    assert continuation_of(dataclasses.replace(greedy, stop=("x",)), 4) is Continuation.REPLAYED_OUTPUT
    seeded = Sampling(max_tokens=10, temperature=0.8, seed=3)
    assert continuation_of(seeded, 4) is Continuation.REPLAYED_OUTPUT
    assert continuation_of(dataclasses.replace(seeded, seed=None), 4) is Continuation.RESUMED

    def of(**kw):
        return continuation_of(dataclasses.replace(greedy, params=Params(**kw)), 4)

    assert of() is Continuation.RESUMED
    assert of(min_tokens=6, repetition_penalty=1.2, logit_bias={1: 2.0}) is Continuation.RESUMED
    assert of(structured_outputs={"regex": "a+"}, stop=["x"]) is Continuation.REPLAYED_GRAMMAR
    for kw in ({"stop": ["\n"]}, {"frequency_penalty": 0.5}, {"presence_penalty": -1.0}):
        assert of(**kw) is Continuation.REPLAYED_OUTPUT, kw
    for kw in ({"bad_words": ["no"]}, {"thinking_token_budget": 64}, {"temperature": 1.0, "seed": 1}):
        assert of(**kw) is Continuation.REPLAYED_OUTPUT, kw


async def test_a_resumed_answer_keeps_its_minimum_length_from_where_it_was_cut(model_dir):
    rig = Rig(model_dir)
    rig.engines.die_after = {"decode-0": 4}
    params = Params(min_tokens=6)
    turn = rig.input(text=P1, max_tokens=8)
    turn = dataclasses.replace(turn, sampling=dataclasses.replace(turn.sampling, params=params))
    _ = [e async for e in rig.turns.run(turn)]
    cont = rig.engines.decode_requests[-1][0]
    assert cont.sampling.max_tokens == 4 and cont.sampling.params.min_tokens == 2
    assert params.min_tokens == 6  # the client's own params are left as they were


async def test_default_max_tokens_clipped_to_room(model_dir):
    rig = Rig(model_dir, max_model_len=50)
    _, ids, r = await rig.turn(text=P1, max_tokens=16, given=False)  # 46-token prompt
    assert r.completion_tokens == 4 and len(ids) == 4
    assert rig.engines.decode_requests[0][0].sampling.max_tokens == 4
    assert rig.turns.counts["max_tokens_clamped"] == 0  # the server's default, not the client's
    # A limit the client set is clamped the same way (vLLM's rule), and counted.
    _, ids, r = await rig.turn(text=P1, max_tokens=16, given=True, session="s2")
    assert r.completion_tokens == 4 and r.finish_reason == "length"
    assert rig.turns.counts["max_tokens_clamped"] == 1


async def test_empty_prompt_refused(model_dir):
    rig = Rig(model_dir)
    with pytest.raises(APIError, match="empty"):
        await rig.turn(text="")
    assert rig.store.stats()["open_leases"] == 0


async def test_sessionless_prompt_finds_its_session(model_dir):
    rig = Rig(model_dir)
    text1, ids1, r1 = await rig.turn(text=P1, session=None)
    assert r1.session_id.startswith("s-")
    assert rig.turns.counts["sessionless_new"] == 1
    _, _, r2 = await rig.turn(text=P1 + text1 + USER2, session=None)
    assert r2.session_id == r1.session_id
    assert rig.turns.counts["sessionless_matched"] == 1
    assert r2.spliced
    assert r2.cached_tokens == len(enc(P1)) + MAX_TOKENS - 1
    # An unrelated prompt starts a new session.
    _, _, r3 = await rig.turn(text="USER: something else entirely\nASSISTANT:", session=None)
    assert r3.session_id not in (r1.session_id,)
    assert r3.miss_reason == "no_conversation"
    assert rig.turns.counts["sessionless_new"] == 2


async def test_sessionless_matching_off(model_dir):
    rig = Rig(model_dir, **{"sessions.match_sessionless": False})
    text1, _, r1 = await rig.turn(text=P1, session=None)
    _, _, r2 = await rig.turn(text=P1 + text1 + USER2, session=None)
    assert r2.session_id != r1.session_id
    assert r2.miss_reason == "no_conversation" and r2.cached_tokens == 0


async def test_concurrent_turns_of_one_session_claim_once(model_dir):
    rig = Rig(model_dir)
    text1, _, _ = await rig.turn(text=P1)
    text2 = P1 + text1 + USER2
    results = await asyncio.gather(rig.turn(text=text2), rig.turn(text=text2))
    reasons = sorted(str(r.miss_reason) for _, _, r in results)
    assert reasons == ["None", "claimed"]
    assert sorted(r.cached_tokens for _, _, r in results) == [0, len(enc(P1)) + MAX_TOKENS - 1]
    assert len(rig.engines.pulls) == 1
    stats = rig.store.stats()
    assert stats["open_leases"] == 0 and stats["claimed_handles"] == 0


# -- other modes --------------------------------------------------------------------------------


async def test_oneway_uses_no_store_and_recomputes(model_dir):
    cfg = make_cfg(model_dir, mode="oneway")
    engines = FakeEngines(keeps_kv=False)
    turns = Turns(cfg, engines, NoStore(), FakeTokenizer())
    sampling = Sampling(max_tokens=MAX_TOKENS, temperature=0.0)
    text1, ids1, r1 = await collect(turns.run(TurnInput("r1", sampling, session_id="s1", prompt_text=P1)))
    text2 = P1 + text1 + USER2
    _, _, r2 = await collect(turns.run(TurnInput("r2", sampling, session_id="s1", prompt_text=text2)))
    assert [p.kv_params for p in engines.prefill_requests] == [first_leg_params(), first_leg_params()]
    assert r1.session_id == r2.session_id == "s1"
    assert r1.cached_tokens == r2.cached_tokens == 0
    assert r1.miss_reason is None and r2.miss_reason is None
    assert not r2.spliced and r2.prompt_token_ids == enc(text2)
    for req, _ in engines.decode_requests:
        assert req.kv_params["do_remote_prefill"] is True
        assert req.preferred_replica is None
    _, _, r3 = await collect(turns.run(TurnInput("r3", sampling, prompt_text=P1)))
    assert r3.session_id.startswith("s-")


async def test_single_mode_has_no_prefill(model_dir):
    rig = Rig(model_dir, mode="single")
    text1, ids1, r1 = await rig.turn(text=P1)
    assert rig.engines.prefill_requests == []
    assert rig.engines.decode_requests[0][0].kv_params is None
    assert r1.cached_tokens == 0
    assert r1.miss_reason == "no_conversation"
    text2 = P1 + text1 + USER2
    _, _, r2 = await rig.turn(text=text2)
    assert rig.engines.prefill_requests == []
    assert r2.spliced  # the store keeps the exact ids for the engine's prefix cache
    req2, replica2 = rig.engines.decode_requests[1]
    assert req2.kv_params is None
    assert req2.preferred_replica == "decode-0" and replica2 == "decode-0"
    # Cached tokens are the engine's own prefix-cache hits (whole blocks, known KV only).
    assert r2.cached_tokens == (len(enc(P1)) + MAX_TOKENS) // BLOCK * BLOCK
    assert r2.miss_reason == "no_handle"
    assert rig.store.inner.counts["stored"] == 0
    assert rig.store.stats()["open_leases"] == 0


async def test_turn_counters(model_dir):
    rig = Rig(model_dir)
    text1, _, _ = await rig.turn(text=P1)
    await rig.turn(text=P1 + text1 + USER2)
    counts: Counter = rig.turns.counts
    assert counts["turns"] == 2
    assert counts["spliced"] == 1
    assert counts["miss_no_conversation"] == 1
    assert counts["handle_used"] == 1
    assert counts["prompt_tokens"] == len(enc(P1)) + len(enc(P1)) + MAX_TOKENS + len(enc(USER2))


# -- pulls that stall, prefill that is slow -----------------------------------------------------


class PacedEngines(FakeEngines):
    """Prefill takes `seconds_per_token` per computed token; a pull can be made to hang
    (as a NIXL handshake with a dead decode engine does)."""

    def __init__(self, seconds_per_token: float = 0.0, *, stall_pulls: bool = False):
        super().__init__()
        self.seconds_per_token = seconds_per_token
        self.stall_pulls = stall_pulls
        self.cancelled = 0

    async def prefill(self, request: EngineRequest) -> tuple[EngineChunk, str]:
        kv = request.kv_params or {}
        pulls = kv.get("remote_engine_id") is not None
        if pulls and self.stall_pulls:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        chunk, replica = await super().prefill(request)
        await asyncio.sleep(
            self.seconds_per_token * (len(request.prompt_token_ids) - chunk.num_cached_tokens)
        )
        return chunk, replica


LONG_SYSTEM = "SYSTEM: " + "you answer questions about the weather and nothing else. " * 4 + "\n"


async def test_stalled_pull_is_cut_and_recomputed(model_dir):
    rig = Rig(model_dir, PacedEngines(stall_pulls=True), **{"transfer.pull_timeout_s": 0.05})
    text1, _, _ = await rig.turn(text=P1)
    text2 = P1 + text1 + USER2
    out2, ids2, r2 = await rig.turn(text=text2)
    assert (out2, ids2) == expected_answer(rig.engines, len(r2.prompt_token_ids))
    assert rig.engines.cancelled == 1
    assert rig.turns.counts["pull_timeout"] == 1
    assert r2.cached_tokens == 0 and r2.reused_from_decode == 0
    # The retry asked for no pull; the decode engine's pinned blocks are settled as failed.
    assert rig.engines.prefill_requests[-1].kv_params == first_leg_params()
    assert rig.engines.prefill_requests[-1].request_id.endswith("-recompute")
    assert rig.store.ended[-1][1] is TurnOutcome.FAILED
    assert rig.turns.pace.tokens_in_flight == 0


async def test_slow_prefill_that_pulls_is_not_cut(model_dir):
    # Far below the compute of the new tokens: only the measured pace lets the pull finish.
    rig = Rig(model_dir, PacedEngines(0.003), max_model_len=1024, **{"transfer.pull_timeout_s": 0.01})
    p1 = LONG_SYSTEM + "USER: hello there\nASSISTANT:"
    text1, _, r1 = await rig.turn(text=p1)
    assert r1.prompt_tokens >= LegPace.MIN_TOKENS
    assert rig.turns.pace.seconds_per_token >= 0.003
    text2 = p1 + text1 + USER2 + "and please tell me about tomorrow too"
    _, _, r2 = await rig.turn(text=text2)
    new_tokens = r2.prompt_tokens - r2.cached_tokens
    assert new_tokens * 0.003 > 0.01  # the leg outlasts pull_timeout_s on its own
    assert rig.turns.counts["pull_timeout"] == 0
    assert r2.reused_from_decode > 0 and r2.cached_tokens == r2.reused_from_decode
    assert rig.turns.pace.tokens_in_flight == 0


def test_prefill_pace_deadline():
    pace = LegPace(weight=0.5)
    assert pace.deadline(1000, 30.0) == 30.0  # nothing measured yet
    pace.observe(10, 5.0)  # too few tokens to tell
    assert pace.seconds_per_token is None
    pace.observe(1000, 2.0)
    assert pace.seconds_per_token == pytest.approx(0.002)
    pace.observe(1000, 4.0)
    assert pace.seconds_per_token == pytest.approx(0.003)
    assert pace.deadline(1000, 30.0) == pytest.approx(30.0 + 2 * 0.003 * 1000)
    pace.tokens_in_flight = 500  # legs ahead of this one
    assert pace.deadline(1000, 30.0) == pytest.approx(30.0 + 2 * 0.003 * 1500)


def test_prefill_pace_counts_queueing_once():
    """Under load a leg's time includes the legs ahead of it: the pace is per token the
    pool computed, so the expected time of a leg with many legs ahead stays linear in
    the tokens ahead instead of growing with their square."""
    pace = LegPace(weight=1.0)
    # 63 legs of 1,000 tokens ahead, each leg computing 1,000 at 1 ms a token: 64 s.
    pace.observe(1000, 64.0, ahead_tokens=63_000)
    assert pace.seconds_per_token == pytest.approx(0.001)
    pace.tokens_in_flight = 63_000
    assert pace.expected(1000) == pytest.approx(64.0)


async def test_turn_reports_where_the_time_went(model_dir):
    rig = Rig(model_dir, PacedEngines(0.001), max_model_len=1024)
    _, _, r = await rig.turn(text=LONG_SYSTEM + "USER: hi\nASSISTANT:")
    t = r.timings
    engine_parts = {f"{leg}_{part}" for leg in ("prefill", "decode") for part in ENGINE_PARTS}
    assert (
        set(t)
        == {
            "store_s",
            "session_s",
            "prefill_s",
            "first_token_s",
            "prefill_engine_s",
            "prefill_queue_s",
            "decode_engine_s",
            "decode_queue_s",
        }
        | engine_parts
    )
    assert t["prefill_compute_s"] == ENGINE_TIMINGS["compute_s"] == t["decode_compute_s"]
    assert 0 <= t["store_s"] <= t["session_s"] <= t["prefill_s"] <= t["first_token_s"]
    assert t["prefill_s"] - t["session_s"] >= 0.001 * r.prompt_tokens  # the paced prefill leg


async def test_single_mode_reports_no_prefill_leg(model_dir):
    rig = Rig(model_dir, mode="single")
    _, _, r = await rig.turn(text=P1)
    decode_parts = {f"decode_{part}" for part in ENGINE_PARTS}
    assert (
        set(r.timings)
        == {
            "store_s",
            "session_s",
            "first_token_s",
            "decode_engine_s",
            "decode_queue_s",
        }
        | decode_parts
    )


# -- decode pin deadline (the claim's remaining pin time bounds the pull) --------------------


def _with_pin(claim: Claim, seconds: float) -> Claim:
    """`claim` as a store that knows the decode engine's pin time returns it."""
    import dataclasses

    values = {f.name: getattr(claim, f.name) for f in dataclasses.fields(claim)}
    values["pin_remaining_s"] = seconds
    if "pin_remaining_s" in {f.name for f in dataclasses.fields(Claim)}:
        return Claim(**values)

    @dataclasses.dataclass(frozen=True)
    class PinnedClaim(Claim):
        pin_remaining_s: float | None = None

    return PinnedClaim(**values)


class PinStore(LocalStore):
    """Claims carry `pin_remaining_s` (seconds of decode pin left at claim time)."""

    def __init__(self, inner: HandleStore, pin_remaining_s: float):
        super().__init__(inner)
        self.pin_remaining_s = pin_remaining_s

    async def begin_turn(self, session_id: str) -> Claim:
        return _with_pin(self.inner.begin_turn(session_id), self.pin_remaining_s)


def pin_rig(model_dir, engines, pin_remaining_s: float, **overrides) -> Rig:
    rig = Rig(model_dir, engines, **overrides)
    rig.store = PinStore(rig.store.inner, pin_remaining_s)
    rig.turns = Turns(rig.cfg, rig.engines, rig.store, FakeTokenizer())
    return rig


async def test_pull_not_started_when_the_pin_ends_too_soon(model_dir):
    rig = pin_rig(model_dir, None, pin_remaining_s=5.0, **{"transfer.pin_margin_s": 6.0})
    text1, _, _ = await rig.turn(text=P1)
    out2, ids2, r2 = await rig.turn(text=P1 + text1 + USER2)
    assert (out2, ids2) == expected_answer(rig.engines, len(r2.prompt_token_ids))
    assert r2.miss_reason == "pin_deadline" and r2.reused_from_decode == 0
    assert rig.turns.counts["miss_pin_deadline"] == 1
    assert rig.engines.pulls == [] and rig.engines.prefill_requests[-1].kv_params == first_leg_params()
    # Not read: the store lets the handle go (and the decode engine frees it now).
    assert rig.store.ended[-1][1] is TurnOutcome.UNUSED


async def test_pull_made_when_the_pin_leaves_time(model_dir):
    rig = pin_rig(model_dir, None, pin_remaining_s=100.0, **{"transfer.pin_margin_s": 6.0})
    text1, _, _ = await rig.turn(text=P1)
    _, _, r2 = await rig.turn(text=P1 + text1 + USER2)
    assert r2.miss_reason is None and r2.reused_from_decode > 0
    assert rig.turns.counts["miss_pin_deadline"] == 0


async def test_pull_refused_when_the_queue_ahead_outlasts_the_pin(model_dir):
    rig = pin_rig(
        model_dir,
        PacedEngines(0.001),
        pin_remaining_s=7.0,
        max_model_len=1024,
        **{"transfer.pin_margin_s": 6.0},
    )
    p1 = LONG_SYSTEM + "USER: hello there\nASSISTANT:"
    text1, _, _ = await rig.turn(text=p1)
    assert rig.turns.pace.seconds_per_token is not None
    rig.turns.pace.tokens_in_flight = 10_000  # ~10 s of legs ahead of this one, 1 s of pin left
    _, _, r2 = await rig.turn(text=p1 + text1 + USER2)
    assert r2.miss_reason == "pin_deadline" and r2.reused_from_decode == 0


async def test_leg_still_waiting_at_the_pin_deadline_is_cut_and_recomputed(model_dir):
    # pull_timeout_s alone would wait 30 s; the pin leaves 0.2 s past the margin.
    rig = pin_rig(
        model_dir, PacedEngines(stall_pulls=True), pin_remaining_s=1.2, **{"transfer.pin_margin_s": 1.0}
    )
    text1, _, _ = await rig.turn(text=P1)
    started = asyncio.get_running_loop().time()
    out2, ids2, r2 = await rig.turn(text=P1 + text1 + USER2)
    assert asyncio.get_running_loop().time() - started < 5.0
    assert (out2, ids2) == expected_answer(rig.engines, len(r2.prompt_token_ids))
    assert rig.engines.cancelled == 1
    assert rig.turns.counts["pull_deadline"] == 1 and rig.turns.counts["pull_timeout"] == 0
    assert rig.engines.prefill_requests[-1].kv_params == first_leg_params()
    assert rig.store.ended[-1][1] is TurnOutcome.FAILED


# -- faults: every one is a recompute or a clear error -----------------------------------------


class FailingStore(LocalStore):
    """The store seam with calls that raise (a shard restarting, a store redeploying)."""

    def __init__(self, inner: HandleStore, failing: set[str]):
        super().__init__(inner)
        self.failing = failing

    def _check(self, name: str) -> None:
        if name in self.failing:
            raise ConnectionError(f"store {name} unavailable")

    async def match(self, prompt_ids, prompt_text=None):
        self._check("match")
        return await super().match(prompt_ids, prompt_text)

    async def begin_turn(self, session_id):
        self._check("begin_turn")
        return await super().begin_turn(session_id)

    async def end_turn(self, claim, outcome, conversation, engine_blocks=None, retain=False):
        self._check("end_turn")
        return await super().end_turn(claim, outcome, conversation, engine_blocks, retain)


def failing_store_rig(model_dir, failing: set[str]) -> Rig:
    rig = Rig(model_dir)
    rig.store = FailingStore(rig.store.inner, failing)
    rig.turns = Turns(rig.cfg, rig.engines, rig.store, FakeTokenizer())
    return rig


async def test_prefill_failure_is_retried_without_history(model_dir):
    rig = Rig(model_dir)
    text1, _, _ = await rig.turn(text=P1)
    rig.engines.prefill_failures = 1
    text2 = P1 + text1 + USER2
    _, ids2, r2 = await rig.turn(text=text2)
    failed, retry = rig.engines.prefill_requests[1:]
    assert failed.kv_params["remote_engine_id"] is not None  # the failed leg offered history
    assert retry.request_id == failed.request_id + "-recompute"
    assert retry.kv_params["remote_engine_id"] is None  # the retry computes it all
    assert rig.turns.counts["prefill_failed"] == 1 and rig.turns.counts["prefill_skipped"] == 0
    assert ids2 == expected_answer(rig.engines, len(r2.prompt_token_ids))[1]
    assert r2.reused_from_decode == 0 and r2.cached_tokens == 0
    # Decode read the retried leg's KV; the offered history is settled as failed.
    assert rig.engines.decode_requests[-1][0].kv_params["remote_engine_id"] == "p-0"
    assert rig.store.ended[-1][1] is TurnOutcome.FAILED
    assert rig.store.stats()["claimed_handles"] == 0


async def test_prefill_failing_twice_leaves_decode_to_compute(model_dir):
    rig = Rig(model_dir)
    text1, _, _ = await rig.turn(text=P1)
    rig.engines.prefill_failures = 2
    _, ids2, r2 = await rig.turn(text=P1 + text1 + USER2)
    assert len(rig.engines.prefill_requests) == 3
    assert rig.turns.counts["prefill_failed"] == 1 and rig.turns.counts["prefill_skipped"] == 1
    last_decode = rig.engines.decode_requests[-1][0]
    # Nothing to read: decode computes the whole prompt, and keeps its blocks for the next pull.
    assert last_decode.kv_params == local_decode_params()
    assert ids2 == expected_answer(rig.engines, len(r2.prompt_token_ids))[1]
    assert r2.cached_tokens == 0
    # The turn's own KV is stored: the next turn reuses again.
    _, _, r3 = await rig.turn(
        text=P1
        + text1
        + USER2
        + "".join(s for _, s in rig.engines.answer(len(r2.prompt_token_ids), MAX_TOKENS))
        + USER3
    )
    assert r3.reused_from_decode > 0


async def test_unreachable_prefill_pool_leaves_decode_to_compute_within_the_deadline(model_dir):
    rig = Rig(model_dir, **{"transfer.prefill_timeout_s": 0.05, "transfer.pull_timeout_s": 0.05})
    text1, _, _ = await rig.turn(text=P1)
    rig.engines.prefill_unreachable = True  # every prefill replica restarting
    # A leg with history: cut at its pull deadline, its recompute at the prefill deadline.
    _, ids2, r2 = await asyncio.wait_for(rig.turn(text=P1 + text1 + USER2), 5)
    assert rig.turns.counts["pull_timeout"] == 1 and rig.turns.counts["prefill_skipped"] == 1
    assert ids2 == expected_answer(rig.engines, len(r2.prompt_token_ids))[1]
    assert rig.engines.decode_requests[-1][0].kv_params == local_decode_params()
    # A new conversation (no history): cut at the prefill deadline, decode computes it.
    _, ids3, r3 = await asyncio.wait_for(rig.turn(text=P1 + "a new conversation", session="s2"), 5)
    assert rig.turns.counts["prefill_timeout"] == 1 and rig.turns.counts["prefill_skipped"] == 2
    assert ids3 == expected_answer(rig.engines, len(r3.prompt_token_ids))[1]
    assert rig.turns.pace.tokens_in_flight == 0


async def test_store_unavailable_at_the_start_serves_the_turn_without_reuse(model_dir):
    rig = failing_store_rig(model_dir, {"begin_turn"})
    _, ids, r = await rig.turn(text=P1)
    assert ids == expected_answer(rig.engines, len(r.prompt_token_ids))[1]
    assert rig.turns.counts["store_unavailable"] == 1 and rig.turns.counts["turns"] == 1
    assert rig.store.ended == []  # nothing claimed, nothing to settle


async def test_sessionless_match_failure_starts_a_new_session(model_dir):
    rig = failing_store_rig(model_dir, {"match"})
    _, ids, r = await rig.turn(text=P1, session=None)
    assert ids == expected_answer(rig.engines, len(r.prompt_token_ids))[1]
    assert r.session_id.startswith("s-")
    assert rig.turns.counts["store_unavailable"] == 1 and rig.turns.counts["sessionless_new"] == 1


async def test_failed_closing_store_update_never_fails_a_finished_answer(model_dir):
    rig = failing_store_rig(model_dir, {"end_turn"})
    text, ids, r = await rig.turn(text=P1)
    assert ids == expected_answer(rig.engines, len(r.prompt_token_ids))[1] and r.finish_reason
    assert rig.turns.counts["store_unavailable"] == 1 and rig.turns.counts["turns"] == 1
    # The store recovers: the next turn has no handle (lost), recomputes, and is stored.
    rig.store.failing.clear()
    rig.store.inner.end_turn(1, TurnOutcome.UNUSED, None)  # the lease a real store would time out
    _, _, r2 = await rig.turn(text=P1 + text + USER2)
    assert r2.cached_tokens == 0 and rig.store.ended[-1][2] is not None


# -- decode-local turns (transfer.decode_local_tokens) ------------------------------------------


async def test_a_short_turn_is_computed_by_its_decode_replica_alone(model_dir):
    rig = Rig(model_dir, **{"transfer.decode_local_tokens": 40})
    long_first = P1 + " and a first message long enough to need prefill"
    assert len(enc(long_first)) > 40
    text1, ids1, r1 = await rig.turn(text=long_first)
    assert len(rig.engines.prefill_requests) == 1 and rig.turns.counts["decode_local"] == 0
    # Turn 2 adds fewer than 40 tokens: no prefill leg, decode computes them over its cache.
    _, ids2, r2 = await rig.turn(text=long_first + text1 + USER2)
    assert len(enc(USER2)) <= 40
    assert len(rig.engines.prefill_requests) == 1 and rig.engines.pulls == []
    decode_req, replica = rig.engines.decode_requests[-1]
    assert decode_req.kv_params == local_decode_params() and replica == r1.decode_replica == "decode-0"
    assert decode_req.preferred_replica == "decode-0"
    assert ids2 == expected_answer(rig.engines, len(r2.prompt_token_ids))[1]
    # What decode's prefix cache held (whole blocks of turn 1) was not computed again.
    history = len(enc(long_first)) + MAX_TOKENS
    assert r2.cached_tokens == history // BLOCK * BLOCK and r2.reused_from_decode == 0
    assert (
        rig.turns.counts["decode_local"] == 1
        and rig.turns.counts["decode_local_cached_tokens"] == r2.cached_tokens
    )
    # The claimed handle was left unread (released early); the new turn's handle is stored.
    assert [o for _, o, _ in rig.store.ended] == [TurnOutcome.UNUSED, TurnOutcome.UNUSED]
    assert rig.store.stats()["handles"] == {"stored": 1}
    assert rig.store.ended[-1][2].handle.request_id == "req-2"
    # A turn adding more than 40 tokens goes through prefill, which pulls turn 2's blocks.
    big = "\nTOOL: " + "x" * 60 + "\nASSISTANT:"
    _, _, r3 = await rig.turn(text=long_first + text1 + USER2 + "".join(chr(i - 1000) for i in ids2) + big)
    assert len(rig.engines.prefill_requests) == 2 and rig.engines.pulls == [
        ("d-decode-0", len(r2.prompt_token_ids) + MAX_TOKENS - 1)
    ]
    assert r3.reused_from_decode > 0 and rig.turns.counts["decode_local"] == 1


async def test_a_short_first_turn_skips_prefill_and_its_blocks_are_kept(model_dir):
    rig = Rig(model_dir, **{"transfer.decode_local_tokens": 64})
    text1, _, r1 = await rig.turn(text=P1)
    assert len(enc(P1)) <= 64
    assert rig.engines.prefill_requests == [] and rig.turns.counts["decode_local"] == 1
    assert rig.engines.decode_requests[0][0].kv_params == local_decode_params()
    assert rig.store.ended[0][2].handle is not None  # the next turn can pull it


async def test_decode_local_turns_need_the_decode_prefix_cache_and_bidir(model_dir):
    no_cache = Rig(model_dir, **{"transfer.decode_local_tokens": 64, "decode.enable_prefix_caching": False})
    text1, _, _ = await no_cache.turn(text=P1)  # a first turn has nothing cached anyway: local
    await no_cache.turn(text=P1 + text1 + USER2)  # history without a cache to hit: prefill pulls it
    assert len(no_cache.engines.prefill_requests) == 1 and len(no_cache.engines.pulls) == 1
    oneway = Rig(model_dir, mode="oneway", **{"transfer.decode_local_tokens": 64})
    await oneway.turn(text=P1)
    assert len(oneway.engines.prefill_requests) == 1 and oneway.turns.counts["decode_local"] == 0


# -- turns that would queue behind a busy prefill (transfer.decode_local_busy_tokens) ----------

TOOL_RESULT = "\nTOOL: " + "y" * 120 + "\nASSISTANT:"


async def two_sessions_then_a_burst(rig: Rig) -> tuple[TurnResult, TurnResult, list[int]]:
    """Two sessions' first turns one after the other (the prefill pace is measured), then
    both sessions' second turns at once: s1's leg is on prefill when s2's turn arrives.
    Returns both second turns' results and s2's answer ids."""
    histories = {}
    for session in ("s1", "s2"):
        prompt = LONG_SYSTEM + f"USER: hello from {session}\nASSISTANT:"
        text, _, _ = await rig.turn(text=prompt, session=session)
        histories[session] = prompt + text
    assert rig.turns.pace.seconds_per_token is not None
    first = asyncio.create_task(rig.turn(text=histories["s1"] + TOOL_RESULT, session="s1"))
    while rig.turns.pace.tokens_in_flight == 0:
        await asyncio.sleep(0)
    _, ids2, r2 = await rig.turn(text=histories["s2"] + TOOL_RESULT, session="s2")
    _, _, r1 = await first
    return r1, r2, ids2


async def test_a_turn_that_would_queue_behind_prefill_is_computed_by_its_decode_replica(model_dir):
    rig = Rig(model_dir, PacedEngines(0.002), max_model_len=1024)
    assert rig.cfg.transfer.decode_local_tokens == 0 and rig.cfg.transfer.decode_local_busy_tokens >= len(
        enc(TOOL_RESULT)
    )
    r1, r2, ids2 = await two_sessions_then_a_burst(rig)
    # s1 went through prefill, which pulled its history; s2 went to its decode replica.
    assert len(rig.engines.prefill_requests) == 3 and r1.reused_from_decode > 0
    assert rig.turns.counts["decode_local_busy"] == 1 and rig.turns.counts["decode_local"] == 1
    [(decode_req, replica)] = [
        (q, r) for q, r in rig.engines.decode_requests if q.prompt_token_ids == r2.prompt_token_ids
    ]
    assert decode_req.kv_params == local_decode_params() and replica == r2.decode_replica
    assert ids2 == expected_answer(rig.engines, r2.prompt_tokens)[1]
    # Decode's prefix cache held s2's first turn: only the tool result's blocks were computed.
    assert (
        r2.reused_from_decode == 0
        and 0 < r2.cached_tokens
        and r2.prompt_tokens - r2.cached_tokens <= len(enc(TOOL_RESULT)) + BLOCK
    )
    # The claimed handle was left unread; the turn's own handle is stored for a later pull.
    s2_ends = [(o, c) for s, o, c in rig.store.ended if s == "s2"]
    assert s2_ends[-1][0] is TurnOutcome.UNUSED and s2_ends[-1][1].handle is not None
    # The replica's own pace was measured and nothing is left counted in flight.
    local = rig.turns.local_pace[replica]
    assert (
        local.seconds_per_token is not None
        and local.tokens_in_flight == 0
        and rig.turns.pace.tokens_in_flight == 0
    )


async def test_a_burst_stays_on_prefill_past_the_busy_limit(model_dir):
    rig = Rig(model_dir, PacedEngines(0.002), max_model_len=1024, **{"transfer.decode_local_busy_tokens": 50})
    r1, r2, ids2 = await two_sessions_then_a_burst(rig)
    assert len(rig.engines.prefill_requests) == 4 and rig.turns.counts["decode_local"] == 0
    assert r1.reused_from_decode > 0 and r2.reused_from_decode > 0
    assert ids2 == expected_answer(rig.engines, r2.prompt_tokens)[1]


async def test_a_burst_stays_on_prefill_when_decode_would_answer_later(model_dir):
    rig = Rig(model_dir, PacedEngines(0.002), max_model_len=1024)
    # The decode replicas have been measured computing alone far slower than prefill.
    for replica in rig.engines.replica_ids:
        rig.turns.local_pace[replica] = LegPace()
        rig.turns.local_pace[replica].seconds_per_token = 1.0
    r1, r2, _ = await two_sessions_then_a_burst(rig)
    assert len(rig.engines.prefill_requests) == 4 and rig.turns.counts["decode_local_busy"] == 0
    assert r2.reused_from_decode > 0


def test_leg_pace_expected_uses_a_stand_in_until_measured():
    pace = LegPace()
    assert pace.expected(100) == 0.0 and pace.expected(100, 0.01) == pytest.approx(1.0)
    pace.tokens_in_flight = 300
    assert pace.expected(100, 0.01) == pytest.approx(4.0)
    pace.observe(1000, 2.0)
    assert pace.expected(100, 0.01) == pytest.approx(0.002 * 400)


async def test_a_failed_decode_local_turn_leaves_nothing_in_flight(model_dir):
    rig = Rig(model_dir, **{"transfer.decode_local_tokens": 64, "ingress.max_continuations": 0})
    text1, _, r1 = await rig.turn(text=P1)
    rig.engines.fail_mid_stream = True
    with pytest.raises(APIError):
        await rig.turn(text=P1 + text1 + USER2)
    assert rig.turns.counts["decode_local"] == 2
    assert rig.turns.local_pace[r1.decode_replica].tokens_in_flight == 0


async def test_every_engine_request_of_a_turn_carries_its_tenants_cache_salt(model_dir):
    rig = Rig(model_dir)
    text1, _, _ = await rig.turn(text=P1, cache_salt="salt-a")
    rig.engines.broken.add("decode-0")  # the next turn's decode is retried elsewhere
    await rig.turn(text=P1 + text1 + USER2, cache_salt="salt-a")
    requests = rig.engines.prefill_requests + [r for r, _ in rig.engines.decode_requests]
    assert len(requests) == 5 and {r.cache_salt for r in requests} == {"salt-a"}


async def test_a_new_session_past_the_tenants_live_limit_is_a_429_with_nothing_claimed(model_dir):
    rig = Rig(model_dir)
    rig.store.inner._shares._max_sessions[""] = 1  # the one tenant of a deployment without keys
    await rig.turn(text=P1, session="s1")
    with pytest.raises(APIError) as refused:
        await rig.turn(text=P1, session="s2")
    assert refused.value.status == 429 and refused.value.code == "rate_limit_exceeded"
    assert 1 <= int(refused.value.headers["Retry-After"]) <= 60
    assert [session for session, _, _ in rig.store.ended] == ["s1"]  # no lease to end for s2
    assert len(rig.engines.decode_requests) == 1  # nothing was computed for it
    _, _, again = await rig.turn(text=P1, session="s1")  # the live session goes on
    assert again.session_id == "s1"


# -- agents' own session keys and the context's room -------------------------------------------


async def test_an_agent_key_names_its_session_and_a_sub_agent_under_it_takes_its_own(model_dir):
    rig = Rig(model_dir)
    text1, _, r1 = await rig.turn(text=P1, session="codex-thread", session_keyed=True)
    assert r1.session_id == "codex-thread" and r1.miss_reason == "no_conversation"
    main2 = P1 + text1 + USER2
    # The main line's next turn claims the keyed conversation: no prompt search.
    text2, _, r2 = await rig.turn(text=main2, session="codex-thread", session_keyed=True)
    assert r2.session_id == "codex-thread" and r2.miss_reason is None and r2.reused_from_decode > 0
    assert rig.turns.counts["sessionless_matched"] == 0
    # A sub-agent sends the same key with a prompt that does not extend that conversation:
    # it runs in a session of its own, and the keyed conversation keeps its KV handle.
    _, _, sub = await rig.turn(text=P1 + " Explore the tests.", session="codex-thread", session_keyed=True)
    assert sub.session_id != "codex-thread"
    assert rig.turns.counts["session_key_diverged"] == 1
    _, _, r3 = await rig.turn(text=main2 + text2 + USER2, session="codex-thread", session_keyed=True)
    assert r3.session_id == "codex-thread" and r3.miss_reason is None and r3.reused_from_decode > 0
    assert rig.turns.counts["session_from_agent"] == 4


async def test_a_header_session_is_trusted_whatever_the_prompt(model_dir):
    rig = Rig(model_dir)
    await rig.turn(text=P1, session="explicit")
    _, _, other = await rig.turn(text=USER2, session="explicit")
    assert other.session_id == "explicit" and rig.turns.counts["session_key_diverged"] == 0


async def test_max_tokens_past_the_context_are_clamped_as_vllm_does(model_dir):
    rig = Rig(model_dir, max_model_len=64)
    prompt = enc(P1)
    room = 64 - len(prompt)
    assert 0 < room < 100
    _, ids, result = await rig.turn(text=P1, max_tokens=100)
    assert len(ids) == room and result.completion_tokens == room and result.finish_reason == "length"
    assert rig.turns.counts["max_tokens_clamped"] == 1


def test_engine_timings_split_a_legs_time_to_its_first_output():
    """vLLM's request stats (the engine core's monotonic stamps) and this process's own
    give the leg's time to the engine core, in its scheduler, computing, and back."""
    from types import SimpleNamespace

    from app.engines.engine import _engine_timings

    stats = SimpleNamespace(
        queued_ts=10.002, scheduled_ts=10.012, first_token_ts=10.050, first_token_latency=0.06
    )
    t = _engine_timings(stats, called=10.0, now=10.058)
    assert t == pytest.approx(
        {"queue_s": 0.01, "first_token_s": 0.06, "input_s": 0.002, "compute_s": 0.038, "output_s": 0.008}
    )
    assert set(_engine_timings(stats)) == {"queue_s", "first_token_s"}  # no stamps of its own
    assert _engine_timings(SimpleNamespace(first_token_ts=0.0)) is None


def test_an_engines_busy_steps_count_only_while_it_has_requests_running():
    """`PromptTokenCounts.busy_step`: the time between two steps' outputs is a step when
    the engine had requests running at the first; an idle engine's wait is none."""
    from app.engines.wire import PromptTokenCounts

    counts = PromptTokenCounts()
    counts.busy_step(10.000, running=2)  # the first output: no step before it to time
    counts.busy_step(10.008, running=2)
    counts.busy_step(10.020, running=0)  # the last request finished in this step
    counts.busy_step(13.000, running=1)  # idle for 3 s, then a new request: not a step
    counts.busy_step(13.010, running=1)
    assert counts.busy_steps == 3
    assert counts.busy_step_s == pytest.approx(0.008 + 0.012 + 0.010)
    assert counts.busy_step_seqs == 2 + 0 + 1
    assert counts.prompt_steps == 0


def test_a_step_that_computed_a_prompt_counts_apart_from_those_that_decoded():
    """`PromptTokenCounts.busy_step`: a step in which a prompt of more than a few computed
    tokens got its first token is a prompt step; a hand-off whose KV was read (its last
    token computed) and a decode-only step are not."""
    from app.engines.wire import PROMPT_STEP_TOKENS, PromptTokenCounts

    counts = PromptTokenCounts()
    counts.busy_step(1.000, running=1)
    counts.busy_step(1.050, running=2, prompt_tokens=300)  # a prompt computed here
    counts.busy_step(1.058, running=2)  # decode only
    counts.busy_step(1.067, running=3, prompt_tokens=1)  # a hand-off: KV read, 1 token computed
    counts.busy_step(1.075, running=3, prompt_tokens=PROMPT_STEP_TOKENS)
    assert counts.busy_steps == 4
    assert counts.prompt_steps == 1
    assert counts.prompt_step_s == pytest.approx(0.050)
    assert counts.busy_step_s - counts.prompt_step_s == pytest.approx(0.008 + 0.009 + 0.008)
