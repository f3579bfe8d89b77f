"""The ingress's tokenizer: the model's Hugging Face tokenizer, its chat template, and the
cached proxy vLLM's output parsers read (one instance per ingress replica; `encode` and
`render` are called off the event loop, they can take milliseconds on long prompts)."""

from __future__ import annotations

from app.errors import APIError


class HFTokenizer:
    def __init__(self, name: str):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(name)
        self._cached = None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def piece(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def render(self, messages: list[dict], tools: list[dict] | None, kwargs: dict | None = None) -> str:
        try:
            return self._tok.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False, **(kwargs or {})
            )
        except Exception as exc:  # template errors are the client's messages' fault
            raise APIError(
                400,
                f"messages could not be rendered by the chat template: {str(exc)[:300]}",
                param="messages",
            ) from exc

    @property
    def hf(self):
        """The tokenizer for vLLM's output parsers: vLLM's cached proxy (they read the
        vocabulary per request)."""
        if self._cached is None:
            from vllm.tokenizers.hf import get_cached_tokenizer

            self._cached = get_cached_tokenizer(self._tok)
        return self._cached

    @property
    def vocab_size(self) -> int:
        return len(self._tok)
