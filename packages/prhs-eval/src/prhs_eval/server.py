"""A running SGLang server as the model under test (``prhs-eval run NAME --server URL``).

The tasks are the same as in-process: prompts are generated and tokenized here, with the
tokenizer of ``--model``, and the token ids are sent to the server's native ``/generate``
endpoint, so the server sees exactly the tokens the in-process path would feed the model. The
server must serve that same model: :func:`connect` compares the ``model_path`` the server
reports with where ``--model`` resolves here, and refuses another model.

What a :class:`ServerSession` does over HTTP (standard library only), and how it maps onto the
in-process session of :mod:`prhs_eval.runner`:

- greedy generation: ``/generate`` with ``input_ids``, ``temperature 0`` and
  ``max_new_tokens``, streamed (``stream: true``) so that the time to the first streamed chunk
  (the prefill and the first token) and the time of the rest (the decode steps) are measured
  apart, on the client. The completion is decoded here from the returned ``output_ids``, the
  end-of-sequence token the server stopped on left out, as the in-process path does;
- teacher-forced NLL (perplexity): one ``/generate`` request with the prompt followed by the
  scored tokens, ``max_new_tokens 0``, ``return_logprob`` and ``logprob_start_len`` set to the
  position before the first scored token; the server answers ``input_token_logprobs``, one
  ``[logprob, token_id, text]`` per position from there on (the first with logprob ``null``).
  These are the logprobs of the server's *prefill* of the scored tokens: the in-process path
  decodes them one step at a time through the selector instead, so a sparse-attention server
  whose prefill is dense reports the dense perplexity here;
- preflight (:func:`probe`): ``/health``, then ``/model_info`` (``/get_model_info`` on older
  servers) for the model path, ``/server_info`` (``/get_server_info``) for the version and the
  server arguments, and the OpenAI-compatible ``/v1/models`` for ``max_model_len``, the one
  place the server reports its context length. The OpenAI ``/v1/completions`` endpoint is not
  used: it takes text or token ids but answers text, and its logprobs would be text-keyed.

A server reports no per-step selection statistics (δ, β, overlap, ρ̂, Avg KV, bytes read): the
rows of a server run leave them empty, they are not estimated.
"""

from __future__ import annotations

import json
import math
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from http.client import HTTPException
from pathlib import Path
from typing import Any

__all__ = [
    "LABEL_PATTERN",
    "PREFLIGHT_TIMEOUT_S",
    "REQUEST_TIMEOUT_S",
    "Generation",
    "ServerError",
    "ServerInfo",
    "ServerSession",
    "ServerTarget",
    "check_label",
    "check_server_url",
    "connect",
    "model_location",
    "probe",
]

PREFLIGHT_TIMEOUT_S = 10.0
"""Seconds to wait for each preflight answer (health, model and server info)."""

REQUEST_TIMEOUT_S = 600.0
"""Seconds to wait for a generation or scoring request (a long prompt on a busy server)."""

LABEL_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
"""What ``run NAME`` may be with ``--server``: the label recorded as the selector."""

_SERVER_ARGS = (
    "attention_backend",
    "device",
    "dtype",
    "kv_cache_dtype",
    "page_size",
    "tp_size",
    "context_length",
    "disable_radix_cache",
)
"""Server arguments recorded with the results (besides every ``sparse*`` argument)."""


class ServerError(RuntimeError):
    """The server cannot be used as asked: a malformed URL, no answer, an HTTP error, an answer
    that is not what SGLang sends, or another model than ``--model``.

    ``status`` is the HTTP status of an error answer, else ``None``.
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


# --------------------------------------------------------------------------------------------
# HTTP


def check_server_url(url: str) -> str:
    """The base URL of a server, checked: ``http(s)://host[:port][/prefix]``.

    Returns
    -------
    str
        The URL without a trailing slash.

    Raises
    ------
    ServerError
        Not an http(s) URL with a host, a bad port, or a query or fragment.
    """
    expected = "expected an http(s) URL such as http://127.0.0.1:30000"
    try:
        parts = urllib.parse.urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise ServerError(f"--server {url!r} is not a valid URL ({exc}); {expected}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ServerError(f"--server {url!r} is not an http(s) URL with a host; {expected}")
    if port == 0:
        raise ServerError(f"--server {url!r} has port 0; {expected}")
    if parts.query or parts.fragment:
        raise ServerError(f"--server {url!r} has a query or fragment; {expected}")
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))


def _error_detail(raw: bytes) -> str:
    """The message of an error body (SGLang's ``{"error": {"message"}}``, ``{"error": str}``,
    FastAPI's ``{"detail"}``, OpenAI's ``{"message"}``), else its start."""
    text = raw.decode("utf-8", "replace").strip()
    try:
        body = json.loads(text)
    except ValueError:
        return text[:300]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        for value in (error, body.get("detail"), body.get("message")):
            if value:
                return value if isinstance(value, str) else json.dumps(value)[:300]
    return text[:300]


def _unreachable(url: str, exc: BaseException) -> ServerError:
    reason = getattr(exc, "reason", exc)
    if isinstance(reason, TimeoutError):
        what = "no answer in time"
    elif isinstance(reason, ConnectionRefusedError):
        what = "connection refused"
    elif isinstance(reason, socket.gaierror):
        what = f"unknown host ({reason.strerror})"
    else:
        what = str(reason) or type(reason).__name__
    return ServerError(
        f"cannot reach the SGLang server at {url}: {what}; is it running "
        "(python -m sglang.launch_server ...) and is the URL right?"
    )


def _open(url: str, body: Mapping[str, Any] | None, timeout: float) -> Any:
    """Send a GET (``body`` None) or a JSON POST; the open response, or :class:`ServerError`."""
    data = None if body is None else json.dumps(body).encode("utf-8")
    request = urllib.request.Request(
        url,
        data=data,
        method="GET" if body is None else "POST",
        headers={"Content-Type": "application/json", "Accept": "application/json"},
    )
    try:
        return urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        detail = _error_detail(exc.read())
        method = request.get_method()
        raise ServerError(
            f"{method} {url} answered HTTP {exc.code} {exc.reason}"
            + (f": {detail}" if detail else ""),
            status=exc.code,
        ) from None
    except (urllib.error.URLError, OSError, HTTPException) as exc:
        raise _unreachable(url, exc) from None


def _json(url: str, raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        start = raw[:120].decode("utf-8", "replace")
        raise ServerError(f"{url} answered something that is not JSON: {start!r}") from None


def _get(url: str, timeout: float) -> Any:
    with _open(url, None, timeout) as response:
        return _json(url, _read(url, response))


def _post(url: str, body: Mapping[str, Any], timeout: float) -> Any:
    with _open(url, body, timeout) as response:
        return _json(url, _read(url, response))


def _read(url: str, response: Any) -> bytes:
    try:
        return bytes(response.read())
    except (OSError, HTTPException) as exc:
        raise _unreachable(url, exc) from None


def _get_first(base: str, paths: Sequence[str], timeout: float) -> Any:
    """GET the first of ``paths`` the server has (a 404 tries the next); ``None`` if none."""
    for path in paths:
        try:
            return _get(base + path, timeout)
        except ServerError as exc:
            if exc.status != 404:
                raise
    return None


def _stream(url: str, body: Mapping[str, Any], timeout: float) -> Iterator[dict[str, Any]]:
    """The JSON events of a streamed ``/generate`` (``data: {...}`` lines up to
    ``data: [DONE]``); an ``{"error": ...}`` event raises :class:`ServerError`."""
    with _open(url, body, timeout) as response:
        try:
            for raw in response:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:") :].strip()
                if payload == "[DONE]":
                    return
                event = _json(url, payload.encode("utf-8"))
                if isinstance(event, dict) and "error" in event:
                    detail = _error_detail(payload.encode("utf-8"))
                    raise ServerError(f"{url} failed the request: {detail}")
                if not isinstance(event, dict):
                    raise ServerError(f"{url} streamed an event that is not an object: {line}")
                yield event
        except (OSError, HTTPException) as exc:
            raise _unreachable(url, exc) from None
    raise ServerError(f"{url} closed the stream before its final 'data: [DONE]'")


# --------------------------------------------------------------------------------------------
# What the server is


@dataclass(frozen=True)
class ServerInfo:
    """What a server reports about itself (:func:`probe`).

    Attributes
    ----------
    url:
        The base URL.
    model_path:
        The model it serves (``--model-path``).
    served_model_name, tokenizer_path, weight_version:
        As ``/model_info`` reports them.
    version:
        SGLang's version (``/server_info``), ``None`` when not reported.
    max_model_len:
        The served context length in tokens (``/v1/models``), ``None`` when not reported.
    args:
        The server arguments recorded with results: ``attention_backend``, ``dtype``,
        ``kv_cache_dtype``, ``page_size``, ``tp_size``, ``context_length``,
        ``disable_radix_cache`` and every argument whose name starts with ``sparse`` (those
        reported).
    """

    url: str
    model_path: str
    served_model_name: str | None = None
    tokenizer_path: str | None = None
    weight_version: str | None = None
    version: str | None = None
    max_model_len: int | None = None
    args: Mapping[str, Any] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """The ``server`` entry of a result's environment."""
        return {
            "url": self.url,
            "sglang": self.version,
            "model_path": self.model_path,
            "served_model_name": self.served_model_name,
            "tokenizer_path": self.tokenizer_path,
            "weight_version": self.weight_version,
            "max_model_len": self.max_model_len,
            **dict(self.args),
        }


def probe(url: str, *, timeout: float = PREFLIGHT_TIMEOUT_S) -> ServerInfo:
    """Check that an SGLang server answers at ``url``, is healthy and generates; what it serves.

    Raises
    ------
    ServerError
        A malformed URL, no answer, an HTTP error (a starting server answers ``/health``
        with 503), an answer that is not SGLang's, or a server that does not generate text
        (an embedding model).
    """
    base = check_server_url(url)
    try:
        with _open(base + "/health", None, timeout) as response:
            _read(base + "/health", response)
    except ServerError as exc:
        if exc.status == 503:
            raise ServerError(
                f"{exc} (SGLang answers 503 while it starts or when it is unhealthy: wait until "
                "its log says the server is ready)",
                status=503,
            ) from None
        raise
    model = _get_first(base, ("/model_info", "/get_model_info"), timeout)
    if not isinstance(model, dict) or not isinstance(model.get("model_path"), str):
        raise ServerError(
            f"{base} has neither /model_info nor /get_model_info with a model_path: is it an "
            f"SGLang server? (answer: {str(model)[:200]})"
        )
    if model.get("is_generation") is False:
        raise ServerError(
            f"{base} serves {model['model_path']!r} as an embedding model, not a generation model"
        )
    info = _get_first(base, ("/server_info", "/get_server_info"), timeout) or {}
    if not isinstance(info, dict):
        raise ServerError(f"{base}/server_info is not a JSON object: {str(info)[:200]}")
    models = _get_first(base, ("/v1/models",), timeout)
    cards = models.get("data") if isinstance(models, dict) else None
    max_len = None
    for card in cards if isinstance(cards, list) else []:
        length = card.get("max_model_len") if isinstance(card, dict) else None
        if isinstance(card, dict) and card.get("parent") is None and _is_int(length):
            max_len = int(length)
            break
    args = {k: info[k] for k in _SERVER_ARGS if k in info}
    args.update({k: v for k, v in info.items() if k.startswith("sparse")})
    # The prhs-sglang plugin reports its selector (and statistics) per scheduler under
    # internal_states[i]["prhs"]; --sparse-attn itself is not a ServerArgs field.
    states = info.get("internal_states")
    first = states[0] if isinstance(states, list) and states else None
    prhs = first.get("prhs") if isinstance(first, dict) else None
    if isinstance(prhs, list) and prhs:
        prhs = prhs[0]
    if isinstance(prhs, dict) and isinstance(prhs.get("selector"), str):
        args.setdefault("sparse_attn", prhs["selector"])
    version = info.get("version")
    return ServerInfo(
        url=base,
        model_path=model["model_path"],
        served_model_name=_str_or_none(model.get("served_model_name")),
        tokenizer_path=_str_or_none(model.get("tokenizer_path")),
        weight_version=_str_or_none(model.get("weight_version")),
        version=version if isinstance(version, str) else None,
        max_model_len=max_len,
        args=args,
    )


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def model_location(name_or_path: str) -> tuple[str, str | None]:
    """Where ``--model`` is here, as a server would be given it: ``(location, revision)``.

    An embedded model: its converted cache directory (written by the first in-process run or
    ``prhs_eval.models.load_model``; the server needs a transformers directory, which the GGUF
    file is not). A local directory: its path. A hub id: the id.

    Raises
    ------
    ServerError
        An embedded model not converted yet.
    ValueError, ModelNotAvailableError
        As :func:`prhs_eval.models.check_model_name`.
    """
    from prhs_eval import models

    kind = models._classify(name_or_path)
    if kind == "hub":
        return name_or_path, None
    if kind == "local":
        directory = Path(name_or_path).expanduser()
        return str(directory.resolve()), models._local_revision(directory)
    source = models.EMBEDDED_MODELS[name_or_path]
    sha256 = models.gguf_sha256(models.resolve_gguf_parts(source))
    directory = models.default_cache_dir() / models.cache_key(source.name, sha256)
    if not models._is_complete(directory, sha256):
        raise ServerError(
            f"embedded model {name_or_path!r} has no converted directory yet ({directory}), "
            'and an SGLang server needs one: convert it once with `python -c "from '
            f"prhs_eval.models import load_model; print(load_model('{name_or_path}')"
            '.source_path)"` and start the server with --model-path set to the printed path'
        )
    return str(directory.resolve()), sha256


def _same_model(served: str, location: str) -> bool:
    if served == location:
        return True
    a, b = Path(served).expanduser(), Path(location).expanduser()
    return a.is_dir() and b.is_dir() and a.resolve() == b.resolve()


def check_label(label: str, info: ServerInfo) -> None:
    """``run NAME`` with ``--server``: NAME is a label; it must match the server's
    ``sparse_attn`` argument when the server reports one.

    Raises
    ------
    ServerError
        A label that is not a plain name, or another selector than the server's.
    """
    if not LABEL_PATTERN.match(label):
        raise ServerError(
            f"{label!r} is not a selector label: use letters, digits and _ . + - "
            "(with --server, NAME only labels the results)"
        )
    served = info.args.get("sparse_attn")
    if isinstance(served, str) and served and served != label:
        raise ServerError(
            f"the server at {info.url} runs sparse attention {served!r} (--sparse-attn), not "
            f"{label!r}: run `prhs-eval run {served} --server {info.url} ...`, or start a "
            f"server with --sparse-attn {label}"
        )


@dataclass(frozen=True)
class ServerTarget:
    """A checked server and the model it serves (:func:`connect`).

    Attributes
    ----------
    info:
        What the server reports.
    model:
        ``--model`` as given (the run's model name).
    location:
        Where ``--model`` is here; the server serves the same (the tokenizer is loaded from it).
    revision:
        Which weights exactly, when known (the GGUF SHA-256 of an embedded model).
    """

    info: ServerInfo
    model: str
    location: str
    revision: str | None


def connect(url: str, model: str, *, timeout: float = PREFLIGHT_TIMEOUT_S) -> ServerTarget:
    """:func:`probe` the server and check that it serves ``model`` (nothing is loaded).

    Raises
    ------
    ServerError
        As :func:`probe` and :func:`model_location`, and when the server serves another model
        path than where ``model`` is here.
    """
    location, revision = model_location(model)
    info = probe(url, timeout=timeout)
    if not _same_model(info.model_path, location):
        raise ServerError(
            f"the server at {info.url} serves {info.model_path!r}, but --model {model!r} is "
            f"{location!r}: prompts are tokenized here with --model's tokenizer, so the server "
            f"must serve the same model (start it with --model-path {location}, or pass "
            f"--model {info.model_path})"
        )
    return ServerTarget(info=info, model=model, location=location, revision=revision)


# --------------------------------------------------------------------------------------------
# Requests


@dataclass(frozen=True)
class Generation:
    """A greedy completion from the server (:meth:`ServerSession.greedy`).

    Attributes
    ----------
    text:
        The completion, decoded here from ``tokens`` (special tokens skipped).
    tokens:
        The generated ids, without the end-of-sequence token the server stopped on.
    decode_steps:
        Decode forwards the server ran: generated ids (stop token included) − 1.
    prefill_seconds:
        Wall time from sending the request to its first streamed chunk (prefill and the
        first token, and the HTTP round trip), measured here.
    decode_seconds:
        Wall time from the first streamed chunk to the last.
    """

    text: str
    tokens: tuple[int, ...]
    decode_steps: int
    prefill_seconds: float
    decode_seconds: float


def _finish(url: str, meta: Mapping[str, Any]) -> dict[str, Any]:
    finish = meta.get("finish_reason")
    if not isinstance(finish, dict):
        raise ServerError(f"{url} ended the request without a finish_reason")
    if finish.get("type") == "abort":
        raise ServerError(f"{url} aborted the request: {finish.get('message') or 'no reason'}")
    return finish


class ServerSession:
    """An SGLang server as the runner's model: tokenize here, generate and score there.

    Parameters
    ----------
    target:
        The checked server (:func:`connect`).
    tokenizer:
        The tokenizer of ``target.model``; default: loaded from ``target.location`` with
        ``AutoTokenizer.from_pretrained``, as :func:`prhs_eval.models.load_model` loads it.
    timeout:
        Seconds to wait for each request.
    """

    def __init__(
        self, target: ServerTarget, tokenizer: Any = None, *, timeout: float = REQUEST_TIMEOUT_S
    ) -> None:
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(target.location)
        self.target = target
        self.info = target.info
        self.tokenizer = tokenizer
        self.timeout = timeout
        self._generate = target.info.url + "/generate"

    @property
    def name(self) -> str:
        """The model's name (``--model`` as given)."""
        return self.target.model

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt, special tokens (BOS) included, as the in-process path."""
        return [int(i) for i in self.tokenizer(text, add_special_tokens=True).input_ids]

    def greedy(self, ids: Sequence[int], max_new_tokens: int) -> Generation:
        """Greedy completion (temperature 0) of at most ``max_new_tokens`` tokens.

        Raises
        ------
        ServerError
            An HTTP error, an aborted request, or an answer that is not SGLang's.
        """
        body = {
            "input_ids": [int(i) for i in ids],
            "sampling_params": {"max_new_tokens": int(max_new_tokens), "temperature": 0.0},
            "stream": True,
        }
        url = self._generate
        t0 = time.perf_counter()
        first = None
        pieces: list[list[int]] = []
        last: dict[str, Any] | None = None
        for event in _stream(url, body, self.timeout):
            if first is None:
                first = time.perf_counter()
            out = event.get("output_ids")
            if not isinstance(out, list) or not all(_is_int(t) for t in out):
                raise ServerError(f"{url} streamed a chunk without output_ids: {str(event)[:200]}")
            pieces.append(out)
            last = event
        end = time.perf_counter()
        if last is None or first is None:
            raise ServerError(f"{url} streamed no output for the request")
        meta = last.get("meta_info")
        if not isinstance(meta, dict):
            raise ServerError(f"{url} streamed a final chunk without meta_info")
        finish = _finish(url, meta)
        count = meta.get("completion_tokens")
        if not _is_int(count):
            raise ServerError(f"{url} reported no completion_tokens")
        # Chunks carry every id so far, or only the new ones (--incremental-streaming-output).
        if len(pieces[-1]) == count:
            output = pieces[-1]
        elif sum(len(p) for p in pieces) == count:
            output = [t for p in pieces for t in p]
        else:
            raise ServerError(
                f"{url} streamed output_ids that do not add up to its completion_tokens {count}"
            )
        if len(output) > max_new_tokens:
            raise ServerError(f"{url} generated {len(output)} tokens, asked for {max_new_tokens}")
        tokens = list(output)
        matched = finish.get("matched")
        stops = matched if isinstance(matched, list) else [matched]
        if finish.get("type") == "stop" and tokens and tokens[-1] in stops:
            tokens.pop()  # the end-of-sequence token: the in-process path never emits it
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return Generation(
            text=text,
            tokens=tuple(tokens),
            decode_steps=max(0, len(output) - 1),
            prefill_seconds=first - t0,
            decode_seconds=end - first,
        )

    def nll(self, prefix: Sequence[int], targets: Sequence[int]) -> tuple[float, float]:
        """Mean negative log-likelihood of ``targets`` after ``prefix``: ``(nll, seconds)``.

        One request over ``prefix + targets`` returns the prompt logprobs from the last
        prefix position on; ``seconds`` is its wall time.

        Raises
        ------
        ValueError
            An empty ``prefix`` or ``targets``.
        ServerError
            An HTTP error, or logprobs that are not one finite value per target token.
        """
        if not prefix or not targets:
            raise ValueError("nll needs a non-empty prefix and at least one target token")
        ids = [int(i) for i in (*prefix, *targets)]
        start = len(prefix) - 1
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": start,
        }
        url = self._generate
        t0 = time.perf_counter()
        answer = _post(url, body, self.timeout)
        seconds = time.perf_counter() - t0
        meta = answer.get("meta_info") if isinstance(answer, dict) else None
        if not isinstance(meta, dict):
            raise ServerError(f"{url} answered without meta_info: {str(answer)[:200]}")
        _finish(url, meta)
        entries = meta.get("input_token_logprobs")
        n = len(targets)
        if not isinstance(entries, list) or len(entries) != n + 1:
            got = len(entries) if isinstance(entries, list) else "none"
            raise ServerError(
                f"{url} answered {got} input_token_logprobs for logprob_start_len {start} of "
                f"{len(ids)} tokens; expected {n + 1}"
            )
        total = []
        for i, (entry, want) in enumerate(zip(entries[1:], targets, strict=True)):
            ok = isinstance(entry, list | tuple) and len(entry) >= 2
            logprob, token = (entry[0], entry[1]) if ok else (None, None)
            if token != want or not isinstance(logprob, int | float) or isinstance(logprob, bool):
                raise ServerError(
                    f"{url} answered input_token_logprobs[{i + 1}] = {entry!r} for scored token "
                    f"{want}; expected [logprob, {want}, text]"
                )
            if not math.isfinite(logprob) or logprob > 0:
                raise ServerError(f"{url} answered logprob {logprob} for token {want}")
            total.append(float(logprob))
        return -math.fsum(total) / n, seconds

    def environment(self) -> dict[str, Any]:
        """Where and with what a server run runs (recorded in every row and result): the
        client (:func:`prhs_eval.results.host_environment`), the model's revision, the
        server's device and dtype when it reports them, and ``server``
        (:meth:`ServerInfo.record`)."""
        from prhs_eval.results import host_environment

        try:
            import transformers

            tf_version: str | None = transformers.__version__
        except ImportError:  # pragma: no cover - a dependency
            tf_version = None
        return {
            "model_revision": self.target.revision,
            **host_environment(),
            "transformers": tf_version,
            "device": self.info.args.get("device"),
            "dtype": self.info.args.get("dtype"),
            "server": self.info.record(),
        }
