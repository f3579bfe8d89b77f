"""Session keys that agents send on their own: OpenAI's `prompt_cache_key` (Codex CLI sends
its session id there, chat and Responses alike) and Claude Code's session id, inside
`metadata.user_id` (a JSON string). Such a key names the conversation the way an
`x-session-id` header does (within the caller's tenant), so the turn claims its KV handle
without a prompt search; unlike a header it is only trusted while the prompt extends the
keyed conversation (`app.turn.model.TurnInput.session_keyed`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def bounded(key: str, max_chars: int) -> str:
    """The key as a session id: itself when short enough, else a digest of it."""
    if 0 < len(key) <= max_chars:
        return key
    return "k-" + hashlib.sha256(key.encode()).hexdigest()[: max(8, min(64, max_chars - 2))]


def claude_code_session(metadata: dict[str, Any] | None) -> str | None:
    """Claude Code's session id from an Anthropic request's `metadata.user_id`, which it
    fills with a JSON object (`device_id`, `account_uuid`, `session_id`). A plain user id
    names a user, not a conversation: it is not used."""
    user_id = (metadata or {}).get("user_id")
    if not isinstance(user_id, str) or not user_id.startswith("{"):
        return None
    try:
        fields = json.loads(user_id)
    except ValueError:
        return None
    session = fields.get("session_id") if isinstance(fields, dict) else None
    return session if isinstance(session, str) and session else None
