"""prhs inside SGLang's server against SGLang's dense backend: time to first token and decode speed.

One server per configuration, started and stopped here; for each, ``--repeats`` rounds of
``--batch`` concurrent requests of ``--context`` prompt tokens (filler with a pass key, each
request its own) and ``--new-tokens`` greedy tokens, streamed. A benchmark, not a test: it prints
and saves figures and asserts nothing.

Per configuration: median time to first token, median decode time per token (after the first),
the pass keys found, and the plugin's statistics (``/server_info``: ρ̂, Avg KV of cached).

Usage (needs SGLang and prhs-sglang installed, e.g. ``uv run``)::

    uv run python benchmarks/scripts/sglang_serve.py --model-path DIR --device cpu \\
        --config dense --config 'prhs:{"budget": 64}' --context 2000 --batch 1 --batch 8 \\
        --out benchmarks/results/<date>-sglang-serve-cpu

``--config`` is ``dense`` (``--attention-backend torch_native`` on the CPU, SGLang's default on
CUDA) or ``NAME[:JSON]`` (``--sparse-attn NAME --sparse-config JSON``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_args(config: str, device: str) -> list[str]:
    if config == "dense":
        return ["--attention-backend", "torch_native"] if device == "cpu" else []
    name, _, options = config.partition(":")
    args = ["--sparse-attn", name]
    if options:
        args += ["--sparse-config", options]
    return args


@contextlib.contextmanager
def _server(model: str, device: str, extra: list[str], log: Path) -> Any:
    port = _port()
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model,
        "--device",
        device,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--skip-server-warmup",
        "--sleep-on-idle",  # an idle scheduler would spin a core the clients need
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRHS_SGLANG_")}
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited ({proc.returncode}); see {log}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after 600 s; see {log}")
            time.sleep(2)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _prompt(tokenizer: Any, key: str, n_tokens: int, depth: float) -> list[int]:
    f = tokenizer(FILLER, add_special_tokens=False)["input_ids"]
    reps = max(1, (n_tokens - 40) // len(f))
    at = int(depth * reps)
    text = (
        FILLER * at
        + f"The pass key is {key}. Remember it. {key} is the pass key. "
        + FILLER * (reps - at)
        + "What is the pass key? The pass key is"
    )
    return tokenizer(text)["input_ids"]


def _stream(url: str, ids: list[int], new_tokens: int) -> dict[str, Any]:
    payload = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True},
    }
    req = urllib.request.Request(
        url + "/generate",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    first = None
    last: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            if not line.startswith(b"data:") or b"[DONE]" in line:
                continue
            if first is None:
                first = time.perf_counter()
            last = json.loads(line[5:])
    end = time.perf_counter()
    n = len(last.get("output_ids", [])) or new_tokens
    return {
        "ttft_s": (first or end) - t0,
        "decode_s_per_token": (end - (first or end)) / max(1, n - 1),
        "text": last.get("text", ""),
    }


def _round(url: str, prompts: list[list[int]], new_tokens: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{}] * len(prompts)

    def one(i: int) -> None:
        out[i] = _stream(url, prompts[i], new_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _environment(device: str) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "device": device,
    }
    with contextlib.suppress(Exception):
        import sglang

        env["sglang"] = sglang.__version__
    with contextlib.suppress(Exception):
        env["commit"] = subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], text=True
        ).strip()
    if device == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--config", action="append", required=True)
    p.add_argument("--context", type=int, action="append")
    p.add_argument("--batch", type=int, action="append")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-total-tokens", type=int, default=32768)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model_path)
    args.out.mkdir(parents=True, exist_ok=True)
    contexts, batches = args.context or [2000], args.batch or [1]
    rows = []
    for config in args.config:
        extra = [
            *_server_args(config, args.device),
            "--max-total-tokens",
            str(args.max_total_tokens),
        ]
        log = args.out / f"server-{config.split(':')[0]}-{len(rows)}.log"
        with _server(args.model_path, args.device, extra, log) as url:
            for ctx in contexts:
                for b in batches:
                    samples, found = [], 0
                    for rep in range(args.repeats):
                        keys = [
                            f"{(31337 + 7919 * (rep * b + i)) % 90000 + 10000}" for i in range(b)
                        ]
                        prompts = [
                            _prompt(tok, k, ctx, (i + 1) / (b + 1)) for i, k in enumerate(keys)
                        ]
                        res = _round(url, prompts, args.new_tokens)
                        samples += res
                        found += sum(k in r["text"] for k, r in zip(keys, res, strict=True))
                    with urllib.request.urlopen(url + "/server_info", timeout=60) as r:
                        info = json.loads(r.read())
                    prhs = (info.get("internal_states") or [{}])[0].get("prhs")
                    row = {
                        "config": config,
                        "context": ctx,
                        "batch": b,
                        "new_tokens": args.new_tokens,
                        "requests": len(samples),
                        "ttft_s": statistics.median(s["ttft_s"] for s in samples),
                        "decode_ms_per_token": 1e3
                        * statistics.median(s["decode_s_per_token"] for s in samples),
                        "passkeys_found": found,
                        "prhs": prhs,
                    }
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "prhs"}), flush=True)
    env = _environment(args.device)
    with open(args.out / "serve.jsonl", "w") as fh:
        for row in rows:
            fh.write(json.dumps({**row, "environment": env}) + "\n")
    print(json.dumps(env))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
