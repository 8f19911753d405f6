"""What ``--sparse-attn`` / ``--sparse-config`` mean, checked without importing SGLang.

The launcher checks them (and the model) before any scheduler process starts, then hands the
normalised choice to its scheduler processes through two environment variables, which
spawned processes inherit: SGLang's ``ServerArgs`` is a closed record and takes no new fields.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prhs_core.config import load_option_file
from prhs_core.registry import UnknownSelectorError, selectors

__all__ = [
    "ENV_CONFIG",
    "ENV_SELECTOR",
    "PLUGIN_OPTIONS",
    "SparseAttnConfig",
    "SparseConfigError",
    "parse_sparse_config",
    "resolve",
]

ENV_SELECTOR = "PRHS_SGLANG_SPARSE_ATTN"
"""Environment variable naming the selector the scheduler processes build."""
ENV_CONFIG = "PRHS_SGLANG_SPARSE_CONFIG"
"""Environment variable holding the normalised ``--sparse-config`` (a JSON object)."""

DEFAULT_SELECTOR = "prhs"

PLUGIN_OPTIONS: dict[str, str] = {
    "log_interval": "decode steps between two statistics log lines (0: none; default 64)",
    "stats": "keep per-step statistics (ρ̂, Avg KV, δ̂) on the device (default true)",
    "checked": "check values on the host at every step (slow; for debugging; default false)",
    "dense_backend": "SGLang backend for prefill/extend and non-selected layers "
    "(default: torch_native on the CPU, triton on CUDA)",
}
"""Keys of ``--sparse-config`` that configure the plugin rather than the selector."""


class SparseConfigError(ValueError):
    """``--sparse-attn`` / ``--sparse-config`` (or the model) cannot be served."""


@dataclass(frozen=True)
class SparseAttnConfig:
    """A validated choice of selector plus the plugin's own options."""

    selector: str = DEFAULT_SELECTOR
    options: Mapping[str, Any] = field(default_factory=dict)
    log_interval: int = 64
    stats: bool = True
    checked: bool = False
    dense_backend: str | None = None

    def build(self) -> Any:
        """A fresh selector instance (the options were validated on :func:`resolve`)."""
        return selectors.create(self.selector, **self.options)

    def to_json(self) -> str:
        """The whole choice as one JSON object (selector options and plugin options)."""
        plugin = {
            "log_interval": self.log_interval,
            "stats": self.stats,
            "checked": self.checked,
            "dense_backend": self.dense_backend,
        }
        return json.dumps({**self.options, **plugin}, sort_keys=True)

    def to_env(self) -> dict[str, str]:
        """The environment variables that carry this choice to SGLang's scheduler processes."""
        return {ENV_SELECTOR: self.selector, ENV_CONFIG: self.to_json()}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SparseAttnConfig:
        """The choice the launcher exported (the default selector when it exported none)."""
        env = os.environ if environ is None else environ
        return resolve(env.get(ENV_SELECTOR) or DEFAULT_SELECTOR, env.get(ENV_CONFIG))


def parse_sparse_config(value: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """``--sparse-config``: a JSON object, or the path of a file holding one (``None``: ``{}``).
    An option whose value is ``"@FILE"`` takes its value from the JSON file ``FILE`` (its entry
    of the option's name when the file holds an object: a calibration file)."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    if not isinstance(value, str):
        raise SparseConfigError(
            f"--sparse-config must be a JSON object or a path to a JSON file, got "
            f"{type(value).__name__}"
        )
    text = value.strip()
    source = "--sparse-config"
    looks_json = text.startswith(("{", "["))
    path = Path(text).expanduser()
    if not looks_json:
        if not path.is_file():
            raise SparseConfigError(
                f"--sparse-config {value!r} is neither a JSON object (it does not start with "
                "'{') nor an existing file; expected e.g. '{\"budget\": 256}' or a path to a "
                ".json file holding such an object"
            )
        source = f"--sparse-config file {str(path)!r}"
        text = path.read_text(encoding="utf-8")
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as e:
        raise SparseConfigError(
            f"{source} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
            'expected an object such as {"budget": 256}'
        ) from None
    if not isinstance(parsed, dict):
        raise SparseConfigError(
            f"{source} must hold a JSON object of options, got a JSON {type(parsed).__name__}"
        )
    for key, item in parsed.items():
        if isinstance(item, str) and item.startswith("@"):  # "KEY": "@FILE", as prhs-eval's
            try:
                parsed[key] = load_option_file(key, str(Path(item[1:]).expanduser()))
            except ValueError as exc:
                raise SparseConfigError(f"{source}: option {key!r}: {exc}") from None
    return parsed


def _plugin_option(options: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    if key not in options:
        return default
    value = options.pop(key)
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise SparseConfigError(f"--sparse-config {key} must be an integer >= 0, got {value!r}")
    elif kind is bool:
        if not isinstance(value, bool):
            raise SparseConfigError(f"--sparse-config {key} must be true or false, got {value!r}")
    elif value is not None and (not isinstance(value, str) or not value):
        raise SparseConfigError(
            f"--sparse-config {key} must be an SGLang attention backend name, got {value!r}"
        )
    return value


SGLANG_DEFAULT_TAU = 0.72
"""CIS's threshold under SGLang when ``--sparse-config`` gives none (see :func:`resolve`)."""


def resolve(
    selector: str | None, config: str | Mapping[str, Any] | None = None
) -> SparseAttnConfig:
    """Check a selector name and its ``--sparse-config``; raise :class:`SparseConfigError`
    with what was wrong and what was expected."""
    name = DEFAULT_SELECTOR if selector is None else selector
    if not isinstance(name, str) or not name:
        raise SparseConfigError(f"--sparse-attn must be a selector name, got {selector!r}")
    try:
        selectors.get(name)
    except UnknownSelectorError as e:
        raise SparseConfigError(f"--sparse-attn: {e}") from None
    options = parse_sparse_config(config)
    log_interval = _plugin_option(options, "log_interval", int, 64)
    stats = _plugin_option(options, "stats", bool, True)
    checked = _plugin_option(options, "checked", bool, False)
    dense_backend = _plugin_option(options, "dense_backend", str, None)
    if dense_backend == "prhs":
        raise SparseConfigError("--sparse-config dense_backend cannot be 'prhs' itself")
    if "tau" in selectors.get(name).defaults() and "tau" not in options:
        # tau="auto" calibrates on each extend's last queries; under chunked prefill and the
        # radix cache those depend on how a prompt was split, so a request's output would
        # depend on its batch. A fixed threshold keeps them independent; "auto" is opt-in.
        options["tau"] = SGLANG_DEFAULT_TAU
    try:
        selectors.create(name, **options)
    except (TypeError, ValueError) as e:
        raise SparseConfigError(
            f"--sparse-config for selector {name!r}: {e} (plugin options: {sorted(PLUGIN_OPTIONS)})"
        ) from None
    return SparseAttnConfig(name, options, log_interval, stats, checked, dense_backend)
