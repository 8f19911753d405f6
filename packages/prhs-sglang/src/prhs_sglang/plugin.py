"""The SGLang plugin: what the ``sglang.srt.plugins`` entry point ``prhs`` runs in each process.

SGLang calls :func:`load` early in the launcher and again in every scheduler process. It uses
only SGLang's documented extension points:

- ``attention_registry.register_attention_backend("prhs")`` and
  ``arg_groups.choices.add_attention_backend_choices(["prhs"])``: the backend;
- ``plugins.hook_registry.HookRegistry`` hooks on
  ``ServerArgs.add_cli_args`` (adds ``--sparse-attn`` / ``--sparse-config``),
  ``ServerArgs.from_cli_args`` (checks them and the model, before any scheduler starts),
  ``ReqToTokenPool.free_rows`` / ``ReqToTokenPool.clear`` (a freed request row releases its
  selector state) and ``SchedulerInternalStateController.get_internal_state`` (the
  statistics appear in
  ``GET /get_server_info`` under ``internal_states[i]["prhs"]``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import types
from typing import Any

from prhs_sglang.config import (
    ENV_CONFIG,
    ENV_SELECTOR,
    SparseAttnConfig,
    SparseConfigError,
    resolve,
)

__all__ = ["BACKEND_NAME", "configure", "engine_args", "load"]

logger = logging.getLogger("prhs_sglang")

BACKEND_NAME = "prhs"

_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
_REQ_POOL = "sglang.srt.mem_cache.memory_pool.ReqToTokenPool"
_INTERNAL_STATE = (
    "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController"
)

_loaded = False

# Server arguments that keep SGLang from capturing the prhs backend in CUDA graphs.
_EAGER: dict[str, Any] = {
    "disable_decode_cuda_graph": True,
    "cuda_graph_backend_decode": "disabled",
    "disable_prefill_cuda_graph": True,
    "cuda_graph_backend_prefill": "disabled",
}


def _create_backend(runner: Any) -> Any:
    from prhs_sglang.backend import PrhsAttnBackend

    return PrhsAttnBackend(runner)


def _add_cli_args(result: Any, parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("prhs sparse attention (prhs-sglang plugin)")
    group.add_argument(
        "--sparse-attn",
        metavar="NAME",
        default=None,
        help="decode through the prhs selector NAME (e.g. prhs, cis, quest, streaming); "
        "implies --attention-backend prhs",
    )
    group.add_argument(
        "--sparse-config",
        metavar="JSON|PATH",
        default=None,
        help="the selector's options as a JSON object (e.g. '{\"budget\": 256}') or a path to "
        "a JSON file; plugin options: log_interval, stats, checked, dense_backend",
    )


def configure(
    sparse_attn: str | None,
    sparse_config: str | dict[str, Any] | None,
    *,
    model_path: str | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    radix_cache: bool = True,
) -> SparseAttnConfig:
    """Check a selector choice (and the model, when given) and export it to the scheduler
    processes SGLang will spawn. Raises :class:`~prhs_sglang.config.SparseConfigError`."""
    sparse = resolve(sparse_attn, sparse_config)
    if radix_cache and getattr(sparse.build(), "state_per_location", False):
        raise SparseConfigError(
            f"selector {sparse.selector!r} keeps per-request scores in a side cache indexed by "
            "KV location; locations shared through SGLang's radix cache would mix requests: "
            "start SGLang with --disable-radix-cache"
        )
    if model_path is not None:
        from prhs_sglang.support import check_model, read_model_config

        check_model(read_model_config(model_path, revision, trust_remote_code))
    os.environ.update(sparse.to_env())
    return sparse


def _from_cli_args(original: Any, cls: Any, args: argparse.Namespace) -> Any:
    name = getattr(args, "sparse_attn", None)
    config = getattr(args, "sparse_config", None)
    backend = getattr(args, "attention_backend", None)
    if name is None and config is None and backend != BACKEND_NAME:
        return original(cls, args)
    if name is not None and backend not in (None, BACKEND_NAME):
        raise SystemExit(
            f"error: --sparse-attn {name} runs through the prhs attention backend, but "
            f"--attention-backend {backend} was given; drop it or pass --attention-backend prhs"
        )
    try:
        configure(
            name,
            config,
            model_path=getattr(args, "model_path", None),
            revision=getattr(args, "revision", None),
            trust_remote_code=bool(getattr(args, "trust_remote_code", False)),
            radix_cache=not getattr(args, "disable_radix_cache", False),
        )
    except SparseConfigError as e:
        raise SystemExit(f"error: {e}") from None
    args.attention_backend = BACKEND_NAME
    for phase in ("prefill", "decode"):
        attr = f"{phase}_attention_backend"
        if getattr(args, attr, None) not in (None, BACKEND_NAME):
            raise SystemExit(
                f"error: --{phase}-attention-backend {getattr(args, attr)} conflicts with "
                "--sparse-attn: prhs serves both phases (set dense_backend in --sparse-config)"
            )
    logger.info(
        "prhs-sglang: CUDA graphs disabled: the prhs backend runs decode and prefill eagerly (its "
        "decode step is graph-safe, but capture through SGLang's graph runners is not wired yet)"
    )
    for key, value in _EAGER.items():
        setattr(args, key, value)
    return original(cls, args)


def engine_args(
    sparse_attn: str | None = "prhs",
    sparse_config: str | dict[str, Any] | None = None,
    **server_args: Any,
) -> dict[str, Any]:
    """Keyword arguments for ``sglang.Engine`` that serve through the prhs selector
    ``sparse_attn`` with options ``sparse_config``: checks them (and ``model_path``), exports
    them to the engine's scheduler processes and returns ``server_args`` with the prhs attention
    backend and no CUDA graphs::

        engine = sglang.Engine(**prhs_sglang.engine_args("prhs", {"budget": 256},
                                                         model_path="..."))
    """
    backend = server_args.get("attention_backend")
    if backend not in (None, BACKEND_NAME):
        raise SparseConfigError(
            f"engine_args: attention_backend={backend!r} conflicts with sparse_attn; leave it out"
        )
    configure(
        sparse_attn,
        sparse_config,
        model_path=server_args.get("model_path"),
        revision=server_args.get("revision"),
        trust_remote_code=bool(server_args.get("trust_remote_code", False)),
        radix_cache=not server_args.get("disable_radix_cache", False),
    )
    return {**server_args, "attention_backend": BACKEND_NAME, **_EAGER}


def _release_rows(result: Any, pool: Any, indices: Any) -> None:
    from prhs_sglang.backend import live_backends

    rows = [int(i) for i in indices]
    for backend in live_backends():
        if backend.req_to_token_pool is pool:
            backend.release_rows(rows)


def _release_all(result: Any, pool: Any) -> None:
    from prhs_sglang.backend import live_backends

    for backend in live_backends():
        if backend.req_to_token_pool is pool:
            backend.release_all()


def _internal_state(result: Any, *args: Any, **kwargs: Any) -> None:
    from prhs_sglang.backend import live_backends

    reports = [b.report() for b in live_backends()]
    if reports and isinstance(getattr(result, "internal_state", None), dict):
        result.internal_state["prhs"] = reports[0] if len(reports) == 1 else reports


def _install_vllm_placeholder() -> None:
    """SGLang imports kernels from ``vllm._custom_ops`` on CPU paths that never call them (e.g.
    the rotary embedding's unused fallback); vLLM is not a dependency. A placeholder module
    whose every name is a function that raises when called lets those imports succeed without
    pretending to provide the kernels."""
    if "vllm._custom_ops" in sys.modules:
        return
    try:
        import vllm._custom_ops

        return
    except ImportError:
        pass

    def missing(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def kernel(*args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(
                f"vllm._custom_ops.{name} was called, but vLLM is not installed (prhs-sglang "
                "installed a placeholder for imports SGLang makes on the CPU)"
            )

        kernel.__name__ = name
        return kernel

    vllm = sys.modules.get("vllm") or types.ModuleType("vllm")
    ops = types.ModuleType("vllm._custom_ops")
    ops.__doc__ = "placeholder installed by prhs-sglang: vLLM is not installed"
    ops.__getattr__ = missing  # type: ignore[attr-defined]
    vllm._custom_ops = ops  # type: ignore[attr-defined]
    sys.modules.setdefault("vllm", vllm)
    sys.modules["vllm._custom_ops"] = ops


def load() -> None:
    """The plugin entry point (idempotent): register the backend, the options and the hooks."""
    global _loaded
    if _loaded:
        return
    from sglang.srt.arg_groups.choices import add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    register_attention_backend(BACKEND_NAME)(_create_backend)
    add_attention_backend_choices([BACKEND_NAME])
    HookRegistry.register(f"{_SERVER_ARGS}.add_cli_args", _add_cli_args, HookType.AFTER)
    HookRegistry.register(f"{_SERVER_ARGS}.from_cli_args", _from_cli_args, HookType.AROUND)
    HookRegistry.register(f"{_REQ_POOL}.free_rows", _release_rows, HookType.AFTER)
    HookRegistry.register(f"{_REQ_POOL}.clear", _release_all, HookType.AFTER)
    HookRegistry.register(f"{_INTERNAL_STATE}.get_internal_state", _internal_state, HookType.AFTER)
    _install_vllm_placeholder()
    _loaded = True
    if os.environ.get(ENV_SELECTOR) or os.environ.get(ENV_CONFIG):
        logger.debug("prhs-sglang: selector from the environment: %s", os.environ[ENV_SELECTOR])
