"""Double Sparsity's label channels calibrated on offline text (``prhs-eval calibrate``).

:func:`calibrate_channels` runs a model's prefill over text windows with prhs installed and, at
every full-attention layer, scores each channel ``j`` of each KV head by the mean ``|q_j·k_j|``
of the window's last ``prompt_queries`` queries against all its keys
(:func:`prhs_selectors.double_sparsity.channel_scores`). The scores are averaged over the
windows and the ``r`` largest of each (layer, KV head) become its labels. The result is a JSON
object (:func:`write_channels`) that ``--set double_sparsity.channels=@FILE`` (or
``hshare.channels``) reads; it carries its provenance beside the table:

.. code-block:: text

   {"format": "prhs-double-sparsity-channels/1", "model": "smollm2-135m", "revision": "…",
    "text": "kjv", "context_len": 2048, "samples": 4, "seed": 0, "prompt_queries": 256,
    "label_channels": 8, "num_layers": 30, "num_kv_heads": 3, "head_dim": 64,
    "channels": [[[1, 5, …], …], …], "scores": [[[…64 floats…], …], …]}

``channels[l][h]`` lists the ``r`` label channels of layer ``l``, KV head ``h`` in ascending
order; a sliding-window layer (Gemma3's local layers, which no selector sees) has ``null``.
``scores`` holds the averaged channel scores the labels were chosen from.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from prhs_core.layout import ContiguousKV
from prhs_core.state import SelectorState
from prhs_selectors.double_sparsity import (
    CHANNELS_FORMAT,
    DoubleSparsity,
    DoubleSparsityConfig,
    channel_scores,
    choose_labels,
)

__all__ = ["calibrate_channels", "write_channels"]


class _ChannelStats(DoubleSparsity):
    """Double Sparsity in prompt mode that also sums every prompt's channel scores."""

    def __init__(self, config: DoubleSparsityConfig) -> None:
        super().__init__(config)
        self.sums: dict[int, torch.Tensor] = {}
        self.counts: dict[int, int] = {}

    def observe_prompt(
        self,
        state: SelectorState,
        layer: int,
        slots: Sequence[int],
        queries: torch.Tensor,
        kv: ContiguousKV,
        scaling: float,
        bounds: Sequence[tuple[int, int]] | None = None,
        locations: torch.Tensor | None = None,
    ) -> None:
        _, rows = self.check_prompt_observation(state, layer, slots, queries, kv, scaling, bounds)
        for i, (st, n) in enumerate(rows):
            s = channel_scores(queries[i], kv.k[i, :, st : st + n]).double().cpu()
            self.sums[layer] = self.sums.get(layer, 0) + s
            self.counts[layer] = self.counts.get(layer, 0) + 1


def calibrate_channels(
    model: str = "smollm2-135m",
    *,
    text: str | os.PathLike[str] = "kjv",
    context_len: int = 2048,
    samples: int = 4,
    seed: int = 0,
    label_channels: int | None = None,
    prompt_queries: int = 256,
    device: str | None = None,
    dtype: str | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """The calibration object of ``model`` (an embedded name, local directory or hub id) on
    ``samples`` windows of ``context_len`` tokens of ``text`` (``"kjv"``, ``"essays"`` or a
    UTF-8 file), drawn with ``seed`` as the perplexity task draws them. ``label_channels``:
    ``r`` (``None``: ``head_dim // 8``); ``prompt_queries``: the last queries of each window
    that score the channels (at most the window). See the module docstring for the format."""
    from prhs_eval.integration import attention_spec, enable
    from prhs_eval.models import load_model
    from prhs_eval.tasks.perplexity import perplexity_text

    if prompt_queries > context_len:
        raise ValueError(
            f"prompt_queries ({prompt_queries}) must not exceed context_len ({context_len})"
        )
    config = DoubleSparsityConfig(label_channels=label_channels, prompt_queries=prompt_queries)
    load_kwargs = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
    loaded = load_model(model, **load_kwargs)
    windows = perplexity_text(
        loaded.tokenizer, context_len=context_len, num_samples=samples, seed=seed, source=text
    )
    spec = attention_spec(loaded.model.config)
    stats = _ChannelStats(config)
    dev = next(loaded.model.parameters()).device
    with enable(loaded.model, stats, max_seq_len=context_len + 1):
        for i, sample in enumerate(windows):
            ids = loaded.tokenizer(sample.prompt, add_special_tokens=False, return_tensors="pt")
            with torch.no_grad():
                loaded.model(input_ids=ids["input_ids"].to(dev), use_cache=True, logits_to_keep=1)
            if progress:
                print(f"calibrate: window {i + 1}/{len(windows)}", flush=True)
    r = stats.num_labels()
    channels: list[list[list[int]] | None] = []
    scores: list[list[list[float]] | None] = []
    for layer in range(spec.num_layers):
        if layer not in stats.sums:
            channels.append(None)
            scores.append(None)
            continue
        mean = stats.sums[layer] / stats.counts[layer]  # [Hkv, D]
        channels.append(choose_labels(mean, r).tolist())
        scores.append([[float(f"{x:.6g}") for x in row] for row in mean.tolist()])
    missing = [x for x in spec.selectable_layers if channels[x] is None]
    if missing:
        raise RuntimeError(f"calibration saw no prompt at layers {missing}")
    return {
        "format": CHANNELS_FORMAT,
        "model": loaded.name,
        "revision": loaded.revision,
        "text": os.fspath(text),
        "context_len": context_len,
        "samples": samples,
        "seed": seed,
        "prompt_queries": prompt_queries,
        "label_channels": r,
        "num_layers": spec.num_layers,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "channels": channels,
        "scores": scores,
    }


def write_channels(result: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write a calibration object as JSON (a table's layers one per line) and return the
    path."""
    lines = []
    for key, value in result.items():
        if isinstance(value, list):
            rows = ",\n  ".join(json.dumps(row) for row in value)
            lines.append(f" {json.dumps(key)}: [\n  {rows}\n ]")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("{\n" + ",\n".join(lines) + "\n}\n", encoding="utf-8")
    return out
