"""Which models the plugin serves, checked from the model's config before SGLang starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prhs_sglang.config import SparseConfigError

__all__ = ["SUPPORTED_ARCHITECTURES", "check_model", "read_model_config"]

SUPPORTED_ARCHITECTURES: frozenset[str] = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    }
)
"""Decoder-only models whose every layer is full grouped-query attention with logits scaled by
``1/sqrt(D)`` (tested: Llama, through SmolLM2)."""


def read_model_config(
    model_path: str, revision: str | None = None, trust_remote_code: bool = False
) -> dict[str, Any]:
    """The model's ``config.json`` as a dict: read from a local directory, else the way SGLang
    reads it (which may download it from the hub)."""
    local = Path(model_path).expanduser()
    if local.is_dir():
        cfg = local / "config.json"
        if not cfg.is_file():
            raise SparseConfigError(f"model directory {str(local)!r} holds no config.json")
        return json.loads(cfg.read_text(encoding="utf-8"))
    from sglang.srt.utils.hf_transformers.config import get_config

    config = get_config(model_path, trust_remote_code=trust_remote_code, revision=revision)
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)


def check_model(config: dict[str, Any]) -> None:
    """Raise :class:`SparseConfigError` unless the plugin serves a model with this config."""
    archs = config.get("architectures") or []
    supported = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
    if not supported:
        raise SparseConfigError(
            f"prhs-sglang does not support model architecture(s) {archs or '(none given)'}; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    window = config.get("sliding_window")
    uses_window = config.get("use_sliding_window", window is not None)
    if window is not None and uses_window and window < config.get("max_position_embeddings", 0):
        raise SparseConfigError(
            f"prhs-sglang does not support sliding-window attention (this model's "
            f"sliding_window is {window})"
        )
