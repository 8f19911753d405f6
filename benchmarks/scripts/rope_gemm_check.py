"""The q|k|v GEMM with the rotary embedding and the cache write in its epilogue
(``decode_linear_rope``) on the GPU: the Llama shapes' q|k|v over a folded weight, against the
float32 layer (rms_norm, the projection, ``apply_rotary_pos_emb``, the cache row), and timed as
a CUDA graph of 16 calls over distinct weights beside the same GEMM without the epilogue
(``decode_linear_rms``, whose rotation and cache write are launches of their own in a layer).
``--sweep``: the rotary GEMM at each launch of :data:`LAUNCHES` too. Then a 2-layer
Llama-3-8B-shaped model (random weights) decodes a few steps into a static cache under prhs,
through ``decode_gemms(fuse_layers=True)`` with and without the rotary epilogue, eager and
replayed from a CUDA graph, with the dense selector and with prhs: the logits and the caches
the two write, compared (lengths 3005).

    python benchmarks/scripts/rope_gemm_check.py [--sweep] [--decode-only]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from skinny_gemm_probe import CALLS, graph_ms  # this folder: run as a script

import prhs_kernels.gemm.triton as gt
from prhs_kernels.gemm import decode_linear_rms, decode_linear_rope, fold_norm_weight

#: (BLOCK_N, BLOCK_K, warps, stages): BLOCK_N/2 columns of a head's first half and their partners.
LAUNCHES = [(64, 128, 4, 3), (64, 128, 4, 4), (64, 128, 4, 6), (64, 256, 4, 4), (128, 128, 8, 4)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--decode-only", action="store_true", help="only the model's decode check")
    args = ap.parse_args()
    dev, bf, eps, d, t = torch.device("cuda"), torch.bfloat16, 1e-5, 128, 4096
    shipped = gt.TUNING_ROPE["launch"]
    for name, h_q, h_kv in (("llama2-7b", 32, 32), ("llama3-8b", 32, 8)):
        k = 4096
        n = (h_q + 2 * h_kv) * d
        ws = [torch.randn(n, k, device=dev, dtype=bf) / k**0.5 for _ in range(CALLS)]
        g = (1 + 0.2 * torch.randn(k, device=dev)).to(bf)
        folded = [fold_norm_weight(w, g) for w in ws]
        for m in (1, 8, 16):
            x = (2 * torch.randn(m, 1, k, device=dev)).to(bf)
            angles = torch.rand(m, 1, d // 2, device=dev) * 1000
            emb = torch.cat([angles, angles], dim=-1)
            cos, sin = emb.cos().to(bf), emb.sin().to(bf)
            kc = torch.zeros(m, h_kv, t, d, device=dev, dtype=bf)
            vc = torch.zeros_like(kc)
            pos = torch.tensor(t - 7, device=dev)
            # The float32 layer: norm, projection, rotation of q and k; its cache row.
            y = F.linear(F.rms_norm(x.float(), (k,), g.float(), eps), ws[0].float())
            heads = y.view(m, -1, d)
            c, s = cos.float(), sin.float()

            def rotate(h, c=c, s=s):
                return h * c + torch.cat((-h[..., d // 2 :], h[..., : d // 2]), -1) * s

            q_want = rotate(heads[:, :h_q])
            k_want, v_want = rotate(heads[:, h_q : h_q + h_kv]), heads[:, h_q + h_kv :]
            q = decode_linear_rope(x, folded[0], cos=cos, sin=sin, k_cache=kc, v_cache=vc,
                                   position=pos, eps=eps).float().view(m, h_q, d)  # fmt: skip
            torch.cuda.synchronize()

            def rel(a, b):
                return float((a - b).norm() / b.norm())

            row = {"shape": name, "M": m, "N": n, "K": k,
                   "rel_err_q": rel(q, q_want), "rel_err_k": rel(kc[:, :, t - 7].float(), k_want),
                   "rel_err_v": rel(vc[:, :, t - 7].float(), v_want),
                   "pos_after": int(pos), "untouched_rows_zero": bool(
                       kc[:, :, : t - 7].abs().sum() == 0 and vc[:, :, t - 6 :].abs().sum() == 0
                   )}  # fmt: skip

            def rope(i, x=x, folded=folded, cos=cos, sin=sin, kc=kc, vc=vc, pos=pos):
                decode_linear_rope(x, folded[i], cos=cos, sin=sin, k_cache=kc, v_cache=vc,
                                   position=pos, eps=eps, advance=False)  # fmt: skip

            def rms(i, x=x, folded=folded):
                decode_linear_rms(x, folded[i], eps=eps)

            row["us_rms"] = round(graph_ms(rms) * 1e3, 2)
            for launch in [shipped, *(LAUNCHES if args.sweep else [])]:
                gt.TUNING_ROPE["launch"] = launch
                label = "_".join(map(str, gt.plan_rope(n, k, d)))
                row[f"us_rope_{label}" + ("_shipped" if launch == shipped else "")] = round(
                    graph_ms(rope) * 1e3, 2)  # fmt: skip
            gt.TUNING_ROPE["launch"] = shipped
            print(row, flush=True)


def decode_check() -> None:
    import prhs_eval.throughput as tp
    import prhs_selectors  # noqa: F401  (registers the selectors: no installed entry points here)
    from prhs_eval.integration import enable

    dev, bf = torch.device("cuda"), torch.bfloat16
    model = tp.random_model(tp.model_config("llama3-8b", layers=2, max_positions=8192), dev, bf)
    cache = tp._static_cache(model, 4, 4096, dev)

    def run(rope: bool, graph: bool, name: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Five steps after a 3000-token fill: two eager, then three eager or replayed from a
        graph (``tp._capture``: the two eager steps on its side stream, then the capture);
        the last step's logits and the cache rows around the written ones."""
        tp.ROPE_EPILOGUE = rope
        tp._fill(cache, 3000, 0)
        opts = {"budget": 256, "block_size": 8} if name == "prhs" else {}
        rt = enable(model, name, max_seq_len=4096, checked=False, **opts)
        rt.attach(cache, 4)
        tokens = torch.tensor([[1], [2], [3], [4]], device=dev)
        logits = torch.zeros(4, model.config.vocab_size, device=dev)
        with tp.decode_gemms(model, fuse=True, fuse_layers=True), torch.no_grad():

            def step() -> None:
                out = model(input_ids=tokens, past_key_values=cache, use_cache=True)
                logits.copy_(out.logits[:, -1])

            if graph:
                g = tp._capture(step, dev)
                for _ in range(3):
                    g.replay()
            else:
                for _ in range(5):
                    step()
        torch.cuda.synchronize()
        rt.disable()
        kv = [torch.cat([layer.keys[:, :, 2995:3010], layer.values[:, :, 2995:3010]]).float()
              for layer in cache.layers]  # fmt: skip
        return logits.clone(), kv

    for name, graph in (("dense", False), ("dense", True), ("prhs", False), ("prhs", True)):
        ref_logits, ref_kv = run(False, graph, name)
        got_logits, got_kv = run(True, graph, name)
        agree = (got_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()
        kv_diff = [float((a - b).abs().max()) for a, b in zip(got_kv, ref_kv, strict=True)]
        row = {"decode_check": name + (" graph" if graph else " eager"),
               "logits_rel": float((got_logits - ref_logits).norm() / ref_logits.norm()),
               "argmax_agree": float(agree), "kv_max_abs_per_layer": kv_diff,
               "kv_max": max(float(a.abs().max()) for a in ref_kv),
               "lengths": [int(layer.cumulative_length) for layer in cache.layers]}  # fmt: skip
        print(row, flush=True)
        if name == "dense" and not (row["logits_rel"] < 0.02 and max(kv_diff) < 0.1):
            raise SystemExit(f"the rotary epilogue's decode differs from the layers': {row}")
    tp.ROPE_EPILOGUE = True


if __name__ == "__main__":
    import sys

    if "--decode-only" not in sys.argv:
        main()
    decode_check()
