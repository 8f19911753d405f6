"""Checks the CLI runs before it loads a model: cheap, and none of them reads weights.

Each check raises :class:`PreflightError` (a :class:`ValueError`) with a one-line message that
says what is wrong and how to fix it. Nothing here imports torch at module import; the device
check imports it when it runs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "PreflightError",
    "check_context",
    "check_device",
    "check_hub_cached",
    "check_task_contexts",
    "check_text_file",
    "check_text_long_enough",
    "default_dtype",
    "hf_hub_cache_dir",
    "hub_config_path",
    "model_max_positions",
    "offline_mode",
    "task_min_context",
]

_TRUE = ("1", "true", "yes", "on")


class PreflightError(ValueError):
    """An argument that cannot work; found before the model is loaded."""


# --------------------------------------------------------------------------------------------
# Text files (--text, --haystack PATH)
# --------------------------------------------------------------------------------------------


def check_text_file(path: str | os.PathLike[str], option: str) -> str:
    """Read a user's UTF-8 text file, or fail with a one-line message naming ``option``.

    Returns
    -------
    str
        The text (not empty, not only whitespace).
    """
    p = Path(path)
    if not p.exists():
        raise PreflightError(f"{option} {str(p)!r} does not exist")
    if not p.is_file():
        raise PreflightError(f"{option} {str(p)!r} is not a file")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PreflightError(
            f"{option} {str(p)!r} is not UTF-8 text (byte {exc.start}): convert it, e.g. "
            f"`iconv -t UTF-8`"
        ) from None
    except OSError as exc:
        raise PreflightError(f"{option} {str(p)!r} cannot be read: {exc.strerror}") from None
    if not text.strip():
        raise PreflightError(f"{option} {str(p)!r} is empty")
    return text


def check_text_long_enough(
    text: str, path: str | os.PathLike[str], *, context_len: int, num_samples: int
) -> None:
    """Fail when ``text`` surely holds too few tokens for ``num_samples`` perplexity windows.

    No tokenizer exists before the model loads, so this uses a bound that holds for byte-level
    and byte-fallback tokenizers: a text has at most as many tokens as UTF-8 bytes. The task
    needs about 1.25 windows of text per sample.
    """
    nbytes = len(text.encode("utf-8"))
    needed = int(1.25 * num_samples * context_len)
    if nbytes < needed:
        raise PreflightError(
            f"--text {str(path)!r} is too short: {nbytes} bytes (at most {nbytes} tokens) for "
            f"{num_samples} window(s) of {context_len} tokens, which need at least {needed}; "
            f"use a longer text, fewer --samples or a smaller --context-len"
        )


# --------------------------------------------------------------------------------------------
# Models: context limit and the offline hub cache
# --------------------------------------------------------------------------------------------


def offline_mode() -> bool:
    """Whether ``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE`` asks for no network access."""
    return any(
        os.environ.get(var, "").strip().lower() in _TRUE
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def hf_hub_cache_dir() -> Path:
    """The Hugging Face hub cache: ``$HF_HUB_CACHE``, ``$HF_HOME/hub``,
    ``$XDG_CACHE_HOME/huggingface/hub`` or ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def hub_config_path(repo_id: str) -> Path | None:
    """The cached ``config.json`` of hub model ``repo_id`` (its ``main`` snapshot when the
    cache records one, else any snapshot), or None when it is not cached."""
    repo = hf_hub_cache_dir() / f"models--{repo_id.replace('/', '--')}"
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file():
        candidate = snapshots / ref.read_text().strip() / "config.json"
        if candidate.is_file():
            return candidate
    if snapshots.is_dir():
        for candidate in sorted(snapshots.glob("*/config.json")):
            return candidate
    return None


def check_hub_cached(name_or_path: str) -> None:
    """In offline mode, fail for a hub id that is not in the local Hugging Face cache."""
    from prhs_eval.models import EMBEDDED_MODELS

    if name_or_path in EMBEDDED_MODELS or Path(name_or_path).expanduser().is_dir():
        return
    if offline_mode() and hub_config_path(name_or_path) is None:
        raise PreflightError(
            f"model {name_or_path!r} is not in the local Hugging Face cache "
            f"({hf_hub_cache_dir()}) and offline mode is on (HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE):"
            f" download it once with network access (`hf download {name_or_path}`), unset "
            f"offline mode, or pass a local directory or an embedded model "
            f"(`prhs-eval models`)"
        )


def _config_max_positions(config: Any) -> int | None:
    if not isinstance(config, dict):
        return None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return _config_max_positions(config.get("text_config"))


def _read_config(path: Path) -> int | None:
    try:
        return _config_max_positions(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None


def model_max_positions(name_or_path: str) -> int | None:
    """The context limit of a model in tokens, read without loading weights; None if unknown.

    Embedded models: their known limit. A local directory: its ``config.json``. A hub id: the
    cached ``config.json`` when present.
    """
    from prhs_eval.models import EMBEDDED_MODELS

    source = EMBEDDED_MODELS.get(name_or_path)
    if source is not None:
        return source.max_positions
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        return _read_config(local / "config.json")
    cached = hub_config_path(name_or_path)
    return _read_config(cached) if cached is not None else None


def check_context(
    name_or_path: str, context_len: int, new_tokens: int, *, known: int | None = None
) -> None:
    """Fail when the prompt, a BOS token and the generated tokens exceed the model's limit."""
    limit = model_max_positions(name_or_path) if known is None else known
    if limit is None:
        return
    needed = context_len + new_tokens + 1
    if needed > limit:
        extra = f" + {new_tokens} generated" if new_tokens else ""
        raise PreflightError(
            f"--context-len {context_len}{extra} + 1 BOS token = {needed} positions, more than "
            f"model {name_or_path!r} supports ({limit}); use --context-len "
            f"{limit - new_tokens - 1} or less"
        )


# --------------------------------------------------------------------------------------------
# Tasks: minimum context
# --------------------------------------------------------------------------------------------


def task_min_context(task: str, *, num_samples: int = 1, seed: int = 0) -> int | None:
    """A lower bound on the context a generation task needs (its instructions, needles and
    question, counted in words: :func:`prhs_eval.tasks.min_context` without a tokenizer);
    None for tasks without such a minimum (perplexity)."""
    from prhs_eval.tasks import TASKS, min_context

    spec = TASKS.get(task)
    if spec is None or spec.kind != "generation":
        return None
    return min_context(task, num_samples=num_samples, seed=seed)


def check_task_contexts(
    tasks: Sequence[str], context_len: int, num_samples: int, seed: int
) -> None:
    """Fail for the first task whose instructions, needles and question cannot fit."""
    for task in tasks:
        minimum = task_min_context(task, num_samples=num_samples, seed=seed)
        if minimum is not None and context_len < minimum:
            raise PreflightError(
                f"--context-len {context_len} is too small for {task}: its instructions, "
                f"needle(s) and question alone take at least {minimum} tokens"
            )


# --------------------------------------------------------------------------------------------
# Device and dtype
# --------------------------------------------------------------------------------------------


def check_device(device: str | None) -> str:
    """Resolve ``--device`` (None: ``"cuda"`` when available, else ``"cpu"``) and check it
    exists here. Imports torch."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise PreflightError(
            f"--device {device!r} is not a device; use cpu, cuda or cuda:N"
        ) from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise PreflightError(f"--device {device!r}: CUDA is not available here; use cpu")
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            raise PreflightError(
                f"--device {device!r}: there are {count} CUDA device(s) (cuda:0..cuda:{count - 1})"
            )
    elif parsed.type == "mps":
        if not torch.backends.mps.is_available():
            raise PreflightError(f"--device {device!r}: MPS is not available here; use cpu")
    elif parsed.type != "cpu":
        raise PreflightError(f"--device {device!r} is not supported; use cpu, cuda or cuda:N")
    return device


def default_dtype(device: str) -> str:
    """``bfloat16`` on CUDA, ``float32`` elsewhere."""
    return "bfloat16" if device.startswith("cuda") else "float32"
