"""Benchmark models: real Qwen3 architectures with random weights.

Each is a directory with a Qwen3 `config.json` and the tokenizer files of the embedded
tiny model (`models/tiny-qwen3`, built first if absent). No weight files: engines load
them with `load_format="dummy"`, which initialises random weights from the config. The
vocabulary is the tiny tokenizer's, so the embedding and LM head are small; every other
dimension is the named architecture's.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from app.config import OPEN_MODEL, REPO_ROOT

MODELS_DIR = REPO_ROOT / "models"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


@dataclass(frozen=True)
class Shape:
    """Transformer dimensions of a Qwen3 model."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    max_positions: int
    rope_theta: float = 1_000_000.0


SHAPES: dict[str, Shape] = {
    # Big enough that prefilling 8k tokens costs seconds on a few CPU cores.
    "bench-qwen3": Shape(
        layers=12, hidden=768, heads=12, kv_heads=4, head_dim=64, intermediate=2048, max_positions=16384
    ),
    # The embedded tiny model's dimensions at 32k positions: agent-sized histories on CPU.
    "fleet-qwen3": Shape(
        layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=768, max_positions=32768
    ),
    # Qwen3-8B's published configuration (36 layers, GQA 32/8, head_dim 128).
    "bench-qwen3-8b": Shape(
        layers=36, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=12288, max_positions=40960
    ),
}


def ensure_tokenizer_source() -> Path:
    """The tiny model's directory, built if absent (its tokenizer is the one we reuse)."""
    from app.engines import default_model

    return default_model.build(OPEN_MODEL, answers="open")


def ensure_model(name: str, out: Path | None = None) -> Path:
    """Write `models/<name>` (config + tokenizer) if it is not there yet; return its path."""
    shape = SHAPES[name]
    out = out or MODELS_DIR / name
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    source = ensure_tokenizer_source()
    out.mkdir(parents=True, exist_ok=True)
    for fname in TOKENIZER_FILES:
        if (source / fname).exists():
            shutil.copy2(source / fname, out / fname)
    tiny = json.loads((source / "config.json").read_text())
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": shape.max_positions,
        "max_window_layers": shape.layers,
        "layer_types": ["full_attention"] * shape.layers,
        "rms_norm_eps": 1e-6,
        "rope_theta": shape.rope_theta,
        "rope_parameters": {"rope_theta": shape.rope_theta, "rope_type": "default"},
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "vocab_size": tiny["vocab_size"],
        "bos_token_id": tiny.get("bos_token_id"),
        "eos_token_id": tiny["eos_token_id"],
        "pad_token_id": tiny.get("pad_token_id"),
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
