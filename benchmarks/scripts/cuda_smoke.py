"""Real-GPU check of the plain-torch paths: every selector decodes on CUDA tensors.

Run on a CUDA machine with the packages' src/ on PYTHONPATH:

    python benchmarks/scripts/cuda_smoke.py

For each supported family (tiny random models built from configs, no download) it checks that
a full-budget oracle reproduces dense greedy generation on the GPU, that every registered
selector decodes a left-padded batch, and that certified CIS reports no violation.
"""

from __future__ import annotations

import sys
import time

import torch
import transformers as tf

import prhs_eval
import prhs_selectors  # noqa: F401  (registers the selectors)
from prhs_core.registry import selectors
from prhs_eval.metrics import SelectionMeter


def tiny(family: str, device: str) -> torch.nn.Module:
    common = dict(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
    )
    if family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    elif family == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    else:
        cfg = tf.Gemma3TextConfig(
            **common, sliding_window=64, layer_types=["sliding_attention", "full_attention"] * 2
        )
        model = tf.Gemma3ForCausalLM(cfg)
    model.generation_config.pad_token_id = 0
    return model.to(device).eval()


def batch(device: str, lengths: list[int]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    t = max(lengths)
    ids = torch.randint(1, 256, (len(lengths), t), generator=g)
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, t - n :] = 1
        ids[i, : t - n] = 0
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def generate(model, b, n=16):
    with torch.no_grad():
        return model.generate(**b, max_new_tokens=n, min_new_tokens=n, do_sample=False)


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device={device} torch={torch.__version__} transformers={tf.__version__}")
    failures = 0
    for family in ("llama", "qwen2", "gemma3"):
        torch.manual_seed(0)
        model = tiny(family, device)
        b = batch(device, [700, 512, 300])
        dense = generate(model, b)
        rt = prhs_eval.enable(model, "oracle", budget=100_000, block_size=1)
        same = torch.equal(generate(model, b), dense)
        rt.disable()
        print(f"{family}: full-budget oracle == dense generation: {same}")
        failures += not same
        for name in selectors.names():
            opts = {"delta_max": 0.5} if name == "cis" else {}
            rt = prhs_eval.enable(model, name, **opts)
            meter = SelectionMeter()
            rt.add_observer(meter)
            t0 = time.perf_counter()
            out = generate(model, b)
            secs = time.perf_counter() - t0
            rt.disable()
            m = meter.result()
            ok = out.shape == dense.shape and (m.certificate_violations in (None, 0))
            failures += not ok
            print(
                f"  {name:10s} ok={ok} delta={m.delta_mean:.4f} rho={m.retrieval_ratio:5.1f} "
                f"avg_kv={m.avg_kv:7.1f} cert={m.certificate_violations} {secs:.2f}s"
            )
    print("FAILURES", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
