"""lm-evaluation-harness integration: the ``prhs-hf`` model.

``prhs-hf`` is lm-eval's ``hf`` model (:class:`lm_eval.models.huggingface.HFLM`) with a prhs
selector enabled on it (:func:`prhs_eval.enable`)::

    prhs-lm-eval run --model prhs-hf \\
        --model_args pretrained=smollm2-135m,selector=prhs,budget=128 \\
        --tasks gsm8k --batch_size 4

``prhs-lm-eval`` is lm-eval's own command line with ``prhs-hf`` registered (lm-eval 0.4 finds
models only in its own table, so the stock ``lm_eval`` command cannot see it); every lm-eval
argument works as documented there. From Python, importing this module registers the model::

    import prhs_eval.harness  # registers "prhs-hf"
    import lm_eval
    lm_eval.simple_evaluate(model="prhs-hf", model_args="pretrained=...,selector=cis", ...)

``model_args``: ``pretrained`` is an embedded model name (``prhs-eval models``), a local
directory or a hub id; ``selector`` a registered selector (default ``prhs``); every other key
that is an option of that selector (``budget``, ``tau``, ``use_psaw`` ...) configures it, and
the rest go to ``HFLM`` (``dtype``, ``max_length``, ``device`` ...). An embedded name is loaded
by :func:`prhs_eval.models.load_model` (offline, from its GGUF), with ``device`` and
``dtype`` when given.

What the selector changes: generation tasks (``generate_until``: GSM8K, CoQA, LongBench v2,
RULER) decode through it at every step. Scoring tasks (``loglikelihood``) run one forward over
each context and continuation, a prefill: only a selector that changes prefill (PSAW, ETF, the
``prhs`` selector with ``use_psaw`` / ``use_etf``) changes their scores.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["MODEL_NAME", "main", "model_class", "register"]

MODEL_NAME = "prhs-hf"
_CLASS: Any = None


def _split_options(selector: str, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(selector options, HFLM keyword arguments) of lm-eval's ``model_args``."""
    import prhs_selectors  # noqa: F401  (registers the selectors where no entry points exist)
    from prhs_core.registry import selectors
    from prhs_eval.runner import parse_option_value

    fields = set(selectors.get(selector).defaults())
    sel = {k: (parse_option_value(v) if isinstance(v, str) else v)
           for k, v in kwargs.items() if k in fields}  # fmt: skip
    rest = {k: v for k, v in kwargs.items() if k not in fields}
    return sel, rest


def model_class() -> type:
    """The ``prhs-hf`` class (a subclass of lm-eval's ``HFLM``); needs ``lm-eval``."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    try:
        from lm_eval.models.huggingface import HFLM
    except ImportError as exc:  # pragma: no cover - the extra is not installed
        raise ImportError(
            "prhs-hf needs lm-evaluation-harness: pip install 'prhs-eval[lm-eval]'"
        ) from exc

    import prhs_eval
    from prhs_core.registry import selectors
    from prhs_eval.models import EMBEDDED_MODELS, load_model

    class PrhsHFLM(HFLM):
        """lm-eval's ``hf`` model decoding through a prhs selector (see the module docs)."""

        def __init__(
            self,
            pretrained: Any,
            selector: str = "prhs",
            max_seq_len: int | None = None,
            **kwargs: Any,
        ) -> None:
            options, rest = _split_options(selector, kwargs)
            instance = selectors.create(selector, **options)  # bad options fail before loading
            if isinstance(pretrained, str) and pretrained in EMBEDDED_MODELS:
                load = {k: rest.pop(k) for k in ("device", "dtype") if rest.get(k) is not None}
                if load.get("dtype") == "auto":
                    del load["dtype"]
                loaded = load_model(pretrained, **load)
                rest.pop("tokenizer", None)
                super().__init__(pretrained=loaded.model, tokenizer=loaded.tokenizer, **rest)
            else:
                super().__init__(pretrained=pretrained, **rest)
            self.prhs_selector_name = selector
            self.prhs_options = options
            self.prhs_runtime = prhs_eval.enable(
                self.model, instance, max_seq_len=max_seq_len, stats=True
            )

    PrhsHFLM.__name__ = PrhsHFLM.__qualname__ = "PrhsHFLM"
    _CLASS = PrhsHFLM
    return PrhsHFLM


def register() -> type:
    """Register ``prhs-hf`` with lm-eval's model registry (idempotent); the class."""
    from lm_eval.api.registry import model_registry, register_model

    cls = model_class()
    if MODEL_NAME not in model_registry or model_registry.get(MODEL_NAME) is not cls:
        import lm_eval.models  # noqa: F401  (its own table first, so it cannot override ours)

        register_model(MODEL_NAME)(cls)
    return cls


def main(argv: Sequence[str] | None = None) -> int:
    """``prhs-lm-eval``: lm-eval's command line with ``prhs-hf`` registered."""
    try:
        register()
    except ImportError as exc:
        sys.stderr.write(f"prhs-lm-eval: error: {exc}\n")
        return 2
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = ["prhs-lm-eval", *argv]
    result = cli_evaluate()
    return int(result) if isinstance(result, int) else 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
