"""The real agent CLIs, unchanged, against the app with `make run`'s defaults.

Codex CLI and Claude Code, at the versions pinned in tests/agents/package-lock.json
(`make agents`: `npm ci`), each run two turns of one conversation the way a user would
(`codex exec` then `codex exec resume --last`; `claude -p` then `claude -p --continue`),
against an app deployed with nothing but the default config (the embedded model, a
65,536-token context, bidir with its placement). Each turn must end without an error
event, and the second must read at least 90% of its prompt from cache: by the engines'
own prompt-token counters (computed against local prefix-cache hits and transferred KV),
and by what the CLI itself reports. A second Codex session (same system prompt and tool
schemas, a new session key) reuses that prefix through the engines' prefix caches.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO
from tests.e2e.helpers import delta, engine_stats, kv_stats

APP = "agents"
AGENTS = REPO / "tests" / "agents"
CODEX = AGENTS / "node_modules" / ".bin" / "codex"
CLAUDE = AGENTS / "node_modules" / "@anthropic-ai" / "claude-code" / "cli-wrapper.cjs"
TURN_TIMEOUT_S = 420
CLAUDE_MAX_OUTPUT = 1024
"""Claude Code asks for 32,000 answer tokens; its own setting caps what it asks for (the
embedded model's answers end within a few hundred)."""


@pytest.fixture(scope="module")
def agents(apps, tmp_path_factory):
    """The pinned CLIs (installed by `npm ci` when `make agents` has not) and an app with
    the default config, beside the shared ones."""
    from ray import serve

    from app.builder import build
    from app.config import AppConfig

    if not (CODEX.exists() and CLAUDE.exists()):
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=AGENTS, check=True, timeout=600
        )
    cfg = AppConfig.model_validate({"app_name": APP})  # make run's defaults
    started = time.monotonic()
    serve.run(build(cfg), name=APP, route_prefix="/" + APP)
    print(f"\n{APP} app running after {time.monotonic() - started:.0f} s")
    home = tmp_path_factory.mktemp("agent-home")
    work = home / "work"
    work.mkdir()
    yield {"url": apps["url"] + "/" + APP, "cfg": cfg, "home": home, "work": work}
    serve.delete(APP)


def _prompt_counts() -> dict:
    """Prompt tokens of the app's engines, by role: `computed`, and `total` (what the
    requests brought: a P/D turn's prompt reaches both roles, which read what they do
    not compute from a prefix cache or another engine)."""
    out = {}
    for role in ("PrefillServer", "DecodeServer"):
        stats = engine_stats(role, app=APP)
        out[role] = {"computed": stats["prompt_tokens_computed"], "total": stats["prompt_tokens_total"]}
    return out


def _computed(after: dict, before: dict) -> tuple[int, int]:
    """Prompt tokens the engines computed between two `_prompt_counts`, and the most
    prompt tokens one role was sent (the turn's prompts, once)."""
    computed = sum(after[r]["computed"] - before[r]["computed"] for r in after)
    sent = max(after[r]["total"] - before[r]["total"] for r in after)
    return computed, sent


def _run(argv: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    full = {
        "PATH": os.environ["PATH"],
        "LANG": "C.UTF-8",
        "NO_COLOR": "1",
        **env,
    }
    return subprocess.run(
        argv,
        env=full,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TURN_TIMEOUT_S,
    )


# -- Codex CLI over /v1/responses (store: false, the whole conversation each turn) ----------


def _codex_env(agents, name: str) -> dict:
    home = agents["home"] / name
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    (home / ".codex" / "config.toml").write_text(
        f'model = "{agents["cfg"].model_name}"\n'
        'model_provider = "kvturn"\n'
        "[model_providers.kvturn]\n"
        'name = "kvturn"\n'
        f'base_url = "{agents["url"]}/v1"\n'
        'wire_api = "responses"\n'
        'env_key = "KVTURN_API_KEY"\n'
    )
    return {"HOME": str(home), "CODEX_HOME": str(home / ".codex"), "KVTURN_API_KEY": "unused"}


def _codex(agents, env: dict, *args: str) -> dict:
    out = _run(
        [str(CODEX), "exec", "--skip-git-repo-check", "-s", "read-only", "--json", *args], env, agents["work"]
    )
    events = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    kinds = [e["type"] for e in events]
    assert out.returncode == 0, (out.returncode, kinds, out.stderr[-3000:])
    assert "error" not in kinds and "turn.failed" not in kinds, events
    # Codex's own notice that it has no metadata for an unknown model name is the only
    # error item it may show; anything else is a failure.
    notices = [e["item"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == "error"]
    assert all("Model metadata" in n["message"] for n in notices), notices
    answers = [
        e["item"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"
    ]
    assert answers and all(a["text"] for a in answers), events
    (done,) = [e for e in events if e["type"] == "turn.completed"]
    return done["usage"]


def test_codex_two_turns_reuse_the_history(agents):
    env = _codex_env(agents, "codex")
    first = _codex(agents, env, "List the files in this directory.")
    before, stats_before = _prompt_counts(), kv_stats(agents["url"])["turns"]
    total = _codex(agents, env, "resume", "--last", "Now tell me what the largest one holds.")
    computed, sent = _computed(_prompt_counts(), before)
    stats = delta(kv_stats(agents["url"])["turns"], stats_before)
    # Codex reports the thread's usage so far: turn 2's is the difference.
    second = {k: total[k] - first[k] for k in ("input_tokens", "cached_input_tokens")}
    print(f"\ncodex turn 1 {first}\ncodex turn 2 {second}\nengines computed {computed} of {sent}")
    # One model request a turn (the embedded model answers in plain text), re-sending the
    # whole conversation: turn 2's prompt holds turn 1's, and the engines computed at
    # most a tenth of it.
    assert second["input_tokens"] > first["input_tokens"] > 10_000
    assert sent == second["input_tokens"]
    assert computed <= 0.1 * sent, (computed, sent)
    assert second["cached_input_tokens"] >= 0.9 * second["input_tokens"], second
    assert stats["session_from_agent"] == 1  # prompt_cache_key named the session
    assert stats.get("sessionless_matched", 0) == 0 and stats.get("session_key_diverged", 0) == 0
    assert stats["hosted_tools_left_out"] == 1  # its web_search tool

    # A second session: the same system prompt and tool schemas under a new session key.
    other = _codex(agents, _codex_env(agents, "codex-2"), "What does the README say?")
    print(f"codex second session {other}")
    assert other["cached_input_tokens"] >= 0.8 * other["input_tokens"], other


# -- Claude Code over /v1/messages ----------------------------------------------------------


def _claude(agents, *args: str) -> dict:
    home = agents["home"] / "claude"
    home.mkdir(exist_ok=True)
    env = {
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": agents["url"],
        "ANTHROPIC_AUTH_TOKEN": "unused",
        "ANTHROPIC_MODEL": agents["cfg"].model_name,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": agents["cfg"].model_name,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(CLAUDE_MAX_OUTPUT),
    }
    node = shutil.which("node") or "node"
    out = _run([node, str(CLAUDE), "-p", "--output-format", "json", *args], env, agents["work"])
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if out.returncode != 0 or result.get("is_error"):
        # Only the client's own cap on the answer's length may end a turn early.
        assert "output token maximum" in str(result.get("result")), (
            out.returncode,
            result,
            out.stderr[-2000:],
        )
    return result


def test_claude_code_two_turns_reuse_the_history(agents):
    first = _claude(agents, "List the files in this directory.")
    before = _prompt_counts()
    second = _claude(agents, "--continue", "Now tell me what the largest one holds.")
    computed, sent = _computed(_prompt_counts(), before)
    usage = second["usage"]
    print(
        f"\nclaude turn 1 usage {first['usage']}\nclaude turn 2 usage {usage}\ncomputed {computed} of {sent}"
    )
    prompt = (
        usage["input_tokens"] + usage["cache_read_input_tokens"] + usage.get("cache_creation_input_tokens", 0)
    )
    assert prompt == sent > 20_000
    assert computed <= 0.1 * sent, (computed, sent)
    assert usage["cache_read_input_tokens"] >= 0.9 * prompt, usage


def test_message_start_reports_cache_reads(agents):
    """Anthropic's `message_start` carries `cache_read_input_tokens` (known at the first
    token), as the final `message_delta` does: a client sees the reuse before the answer."""
    url = agents["url"] + "/v1/messages"
    system = "You are a careful assistant. " * 200
    body = {
        "model": agents["cfg"].model_name,
        "max_tokens": 16,
        "system": system,
        "metadata": {"user_id": json.dumps({"device_id": "d", "account_uuid": "", "session_id": "cc-start"})},
        "messages": [{"role": "user", "content": "hello"}],
    }
    first = httpx.post(url, json=body, timeout=120).json()
    body["messages"] += [
        {"role": "assistant", "content": first["content"]},
        {"role": "user", "content": "and then?"},
    ]
    events = []
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    start = events[0]
    assert start["type"] == "message_start"
    usage = start["message"]["usage"]
    final = next(e for e in events if e["type"] == "message_delta")["usage"]
    assert usage["cache_read_input_tokens"] > 0.9 * (usage["input_tokens"] + usage["cache_read_input_tokens"])
    assert final["cache_read_input_tokens"] >= usage["cache_read_input_tokens"] * 0.9
