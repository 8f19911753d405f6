"""Real SGLang servers for the plugin's tests: each in its own process group, on the CPU, with
the offline SmolLM2 model converted to a transformers directory (cached by prhs-eval)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# Under a loaded 2-core CI machine three servers (nine processes importing SGLang) once took
# 420 s to come up; idle, 4 minutes.
STARTUP_TIMEOUT_S = 900
REQUEST_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env() -> dict[str, str]:
    """The test process's environment without any prhs-sglang choice (each server sets its own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRHS_SGLANG_")}
    env.pop("SGLANG_USE_CPU_ENGINE", None)
    return env


def launch_command(model_dir: str | Path, *args: str, port: int | None = None) -> list[str]:
    return [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model_dir),
        "--device",
        "cpu",
        "--host",
        "127.0.0.1",
        "--port",
        str(port if port is not None else _free_port()),
        "--mem-fraction-static",
        "0.5",
        "--skip-server-warmup",
        "--sleep-on-idle",  # an idle scheduler would otherwise spin a whole core
        *args,
    ]


@dataclass
class Server:
    """A running server: its URL, process and log file."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def post(self, path: str, payload: dict[str, Any], timeout: float = REQUEST_TIMEOUT_S) -> Any:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
        return json.loads(body) if body else None

    def get(self, path: str, timeout: float = 60) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return json.loads(r.read())

    def generate(self, ids: list[int], max_new_tokens: int, **extra: Any) -> dict[str, Any]:
        payload = {
            "input_ids": ids,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens},
            **extra,
        }
        return self.post("/generate", payload)

    def prhs(self) -> dict[str, Any]:
        """The plugin's statistics from ``/server_info``."""
        states = self.get("/server_info")["internal_states"]
        return states[0]["prhs"]

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def start_server(model_dir: str | Path, *args: str, log_dir: Path) -> Server:
    """Start a server in its own process group (returns at once; see :func:`wait_healthy`)."""
    port = _free_port()
    log = log_dir / f"server-{port}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            launch_command(model_dir, *args, port=port),
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=clean_env(),
            start_new_session=True,
        )
    return Server(f"http://127.0.0.1:{port}", proc, log)


def wait_healthy(server: Server, timeout: float = STARTUP_TIMEOUT_S) -> Server:
    deadline = time.monotonic() + timeout
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(
                f"server exited with {server.proc.returncode}:\n{server.log_text()[-6000:]}"
            )
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
                if r.status == 200:
                    return server
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"server not healthy after {timeout} s:\n{server.log_text()[-4000:]}"
            )
        time.sleep(2)


def stop_server(server: Server) -> None:
    if server.proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.proc.pid, signal.SIGTERM)
    try:
        server.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=30)


CHUNKS = ("--chunked-prefill-size", "512")
SERVERS: dict[str, tuple[str, ...]] = {
    # SGLang's dense backend: the reference of the parity test.
    "dense": ("--attention-backend", "torch_native", *CHUNKS, "--max-total-tokens", "8192"),
    # A budget covering every position (sink 4 + local 32 + 1024 >= the 700-token prompt and
    # its new tokens), prefill dense (no PSAW): must reproduce "dense" token for token.
    "full": (
        "--sparse-attn",
        "prhs",
        "--sparse-config",
        json.dumps({"budget": 1024, "use_psaw": False, "log_interval": 0, "tau": "auto"}),
        *CHUNKS,
        "--max-total-tokens",
        "8192",
    ),
    # PrHS with PSAW's windowed prefill switched on (off by default) and CIS decode, with a
    # 64-position budget; a 2000-token prompt prefills in 4 chunks.
    "small": (
        "--sparse-attn",
        "prhs",
        "--sparse-config",
        json.dumps({"budget": 64, "use_psaw": True, "log_interval": 4}),
        *CHUNKS,
        "--max-total-tokens",
        "24576",
        "--max-running-requests",
        "32",
    ),
}


class ServerPool:
    """The test servers, all started at once (starting one takes a minute or more, mostly
    imports; idle servers sleep), each waited for when a test first needs it."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self._servers = {
            name: start_server(model_dir, *args, log_dir=log_dir) for name, args in SERVERS.items()
        }
        self._ready: set[str] = set()

    def __getitem__(self, name: str) -> Server:
        server = self._servers[name]
        if name not in self._ready:
            wait_healthy(server)
            self._ready.add(name)
        return server

    def stop(self, *names: str) -> None:
        for name in names or tuple(self._servers):
            stop_server(self._servers[name])


@pytest.fixture(scope="session")
def servers(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerPool]:
    pool = ServerPool(model_dir, tmp_path_factory.mktemp("servers"))
    try:
        yield pool
    finally:
        pool.stop()


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """SmolLM2-135M-Instruct as a transformers directory (converted once, then cached)."""
    from prhs_eval.models import model_directory

    return model_directory("smollm2-135m")


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def launch_cmd() -> Any:
    """``launch_cmd(model_dir, *args)``: the launcher's command line (see launch_command)."""
    return launch_command


@pytest.fixture(scope="session")
def server_env() -> dict[str, str]:
    """The environment a test server starts with (see clean_env)."""
    return clean_env()


@pytest.fixture(scope="session")
def passkey(tokenizer: Any) -> Any:
    """``passkey(key, n_tokens, seed)``: token ids of a pass-key prompt (see passkey_prompt)."""
    return lambda key, n, seed=0: passkey_prompt(tokenizer, key, n, seed)


def passkey_prompt(tokenizer: Any, key: str, n_tokens: int, seed: int = 0) -> list[int]:
    """``n_tokens`` (about) of repeated filler with one passkey line inside, then the question."""
    filler = (
        "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    )
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    question = "What is the pass key? The pass key is"
    f_ids = tokenizer(filler, add_special_tokens=False)["input_ids"]
    reps = max(1, (n_tokens - 40) // len(f_ids))
    at = (seed * 7919) % reps
    text = filler * at + needle + filler * (reps - at) + question
    return tokenizer(text)["input_ids"]
