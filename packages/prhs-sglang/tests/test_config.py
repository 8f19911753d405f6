"""``--sparse-attn`` / ``--sparse-config`` and the model check, without starting SGLang."""

from __future__ import annotations

import json

import pytest

from prhs_sglang.config import (
    ENV_CONFIG,
    ENV_SELECTOR,
    SparseAttnConfig,
    SparseConfigError,
    parse_sparse_config,
    resolve,
)
from prhs_sglang.plugin import configure, engine_args
from prhs_sglang.support import check_model


def test_resolve_splits_plugin_options_from_selector_options():
    cfg = resolve("cis", '{"budget": 128, "log_interval": 8, "checked": true}')
    assert cfg.selector == "cis"
    assert dict(cfg.options) == {"budget": 128, "tau": 0.72}  # tau: the SGLang default
    assert (cfg.log_interval, cfg.checked, cfg.stats, cfg.dense_backend) == (8, True, True, None)
    assert cfg.build().config.budget == 128


def test_default_selector_is_prhs():
    assert resolve(None).selector == "prhs"


def test_cis_threshold_is_fixed_unless_auto_is_asked_for():
    """Under SGLang a calibrated threshold would depend on how a prompt was chunked or cached:
    the default is 0.72, and tau="auto" is opt-in."""
    assert resolve("prhs", '{"budget": 64}').build().config.tau == 0.72
    assert resolve("cis", None).build().prompt_queries() == 0
    auto = resolve("cis", '{"tau": "auto"}').build()
    assert auto.config.tau == "auto" and auto.prompt_queries() == 32
    assert "tau" not in resolve("quest", None).options


def test_env_round_trip():
    cfg = resolve("quest", {"budget": 96, "stats": False, "dense_backend": "triton"})
    env = cfg.to_env()
    assert env[ENV_SELECTOR] == "quest"
    back = SparseAttnConfig.from_env(env)
    assert back == cfg


def test_unknown_selector_names_the_known_ones():
    with pytest.raises(SparseConfigError, match=r"unknown selector 'cys'.*Did you mean 'cis'"):
        resolve("cys")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"budget": 64', r"not valid JSON .*line 1"),
        ("[1, 2]", r"must hold a JSON object of options, got a JSON list"),
        ("no-such-file.json", r"neither a JSON object .* nor an existing file"),
    ],
)
def test_malformed_config(text, message):
    with pytest.raises(SparseConfigError, match=message):
        parse_sparse_config(text)


def test_config_from_file(tmp_path):
    path = tmp_path / "sparse.json"
    path.write_text(json.dumps({"budget": 32}))
    assert resolve("streaming", str(path)).options == {"budget": 32}
    path.write_text("{oops")
    with pytest.raises(SparseConfigError, match=r"file .*sparse.json.* is not valid JSON"):
        resolve("streaming", str(path))


def test_an_option_can_come_from_a_calibration_file(tmp_path):
    """``"channels": "@FILE"`` reads the file's ``channels`` entry (a ``prhs-eval calibrate``
    table); a missing file or entry is refused with what was wrong."""
    table = [[[0, 3]], [[1, 2]]]
    calib = tmp_path / "ds.json"
    calib.write_text(json.dumps({"format": "x", "model": "m", "channels": table}))
    cfg = resolve("double_sparsity", json.dumps({"budget": 8, "channels": f"@{calib}"}))
    assert cfg.options["channels"] == table
    with pytest.raises(SparseConfigError, match="option 'channels': cannot read"):
        resolve("double_sparsity", '{"channels": "@/no/such.json"}')
    other = tmp_path / "other.json"
    other.write_text('{"budget": 3}')
    with pytest.raises(SparseConfigError, match="holds an object without 'channels'"):
        resolve("double_sparsity", json.dumps({"channels": f"@{other}"}))


@pytest.mark.parametrize("budget", [0, -5])
def test_budget_must_be_positive(budget):
    with pytest.raises(SparseConfigError, match=r"selector 'prhs': budget must be"):
        resolve("prhs", {"budget": budget})


def test_unknown_option_lists_the_options():
    with pytest.raises(SparseConfigError, match=r"no option\(s\) \['budgte'\].*plugin options"):
        resolve("cis", {"budgte": 4})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"log_interval": -1}, "log_interval must be an integer >= 0"),
        ({"stats": "yes"}, "stats must be true or false"),
        ({"dense_backend": ""}, "dense_backend must be an SGLang attention backend name"),
        ({"dense_backend": "prhs"}, "cannot be 'prhs' itself"),
    ],
)
def test_bad_plugin_options(options, message):
    with pytest.raises(SparseConfigError, match=message):
        resolve("cis", options)


def _model_dir(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_unsupported_model_family(tmp_path):
    with pytest.raises(
        SparseConfigError,
        match=r"does not support model architecture\(s\) "
        r"\['MambaForCausalLM'\]; supported: \['LlamaForCausalLM'",
    ):
        check_model({"architectures": ["MambaForCausalLM"]})
    with pytest.raises(SparseConfigError, match="sliding-window"):
        check_model(
            {
                "architectures": ["MistralForCausalLM"],
                "sliding_window": 4096,
                "max_position_embeddings": 32768,
            }
        )
    check_model({"architectures": ["LlamaForCausalLM"]})


def test_configure_exports_and_checks_model(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_SELECTOR, raising=False)
    monkeypatch.delenv(ENV_CONFIG, raising=False)
    bad = _model_dir(tmp_path, architectures=["DeepseekV3ForCausalLM"])
    with pytest.raises(SparseConfigError, match="DeepseekV3ForCausalLM"):
        configure("cis", None, model_path=bad)
    import os

    assert ENV_SELECTOR not in os.environ  # a refused choice changes nothing
    good = tmp_path / "good"
    good.mkdir()
    (good / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    configure("cis", {"budget": 16}, model_path=str(good))
    assert os.environ[ENV_SELECTOR] == "cis"
    assert json.loads(os.environ[ENV_CONFIG])["budget"] == 16


@pytest.mark.parametrize("name", ["h2o", "rabitq"])
def test_per_request_side_caches_need_the_radix_cache_off(monkeypatch, name):
    monkeypatch.delenv(ENV_SELECTOR, raising=False)
    with pytest.raises(SparseConfigError, match="--disable-radix-cache"):
        configure(name, None)
    assert configure(name, None, radix_cache=False).selector == name


def test_page_certified_cis_needs_the_radix_cache_off(monkeypatch):
    """The per-page certificate keeps the anchor's masses per KV page; the global one and paper
    mode keep nothing per location."""
    monkeypatch.delenv(ENV_SELECTOR, raising=False)
    with pytest.raises(SparseConfigError, match="--disable-radix-cache"):
        configure("cis", {"delta_max": 0.05})
    assert configure("cis", {"delta_max": 0.05}, radix_cache=False).selector == "cis"
    assert configure("cis", {"delta_max": 0.05, "certificate": "global"}).selector == "cis"
    assert configure("cis", {"tau": 0.8}).selector == "cis"


def test_engine_args(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_SELECTOR, raising=False)
    model = _model_dir(tmp_path, architectures=["Qwen2ForCausalLM"])
    kwargs = engine_args("streaming", {"budget": 48}, model_path=model, mem_fraction_static=0.5)
    assert kwargs == {
        "model_path": model,
        "mem_fraction_static": 0.5,
        "attention_backend": "prhs",
        "disable_decode_cuda_graph": True,
        "cuda_graph_backend_decode": "disabled",
        "disable_prefill_cuda_graph": True,
        "cuda_graph_backend_prefill": "disabled",
    }
    with pytest.raises(SparseConfigError, match="attention_backend='triton' conflicts"):
        engine_args("cis", attention_backend="triton")
