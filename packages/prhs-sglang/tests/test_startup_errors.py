"""Bad input to ``python -m sglang.launch_server``: a clear error before any scheduler starts."""

from __future__ import annotations

import json
import subprocess

import pytest

pytestmark = pytest.mark.slow


def _launch(launch_cmd, env, model_dir, *args):
    return subprocess.run(
        launch_cmd(model_dir, *args), capture_output=True, text=True, timeout=300, env=env
    )


@pytest.fixture(scope="module")
def unsupported_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("mamba")
    (d / "config.json").write_text(
        json.dumps({"architectures": ["MambaForCausalLM"], "model_type": "mamba"})
    )
    return d


CASES = {
    "unknown-selector": (
        ["--sparse-attn", "nope"],
        "error: --sparse-attn: unknown selector 'nope'",
    ),
    "malformed-config": (
        ["--sparse-attn", "cis", "--sparse-config", '{"budget": '],
        "is not valid JSON",
    ),
    "zero-budget": (
        ["--sparse-attn", "prhs", "--sparse-config", '{"budget": 0}'],
        "budget must be",
    ),
    "backend-conflict": (
        ["--sparse-attn", "cis", "--attention-backend", "triton"],
        "--attention-backend triton was given",
    ),
    "h2o-radix": (["--sparse-attn", "h2o"], "--disable-radix-cache"),
}

# Runs SGLang's own argument path (plugins loaded, then prepare_server_args, as the launcher
# does) for every case in one process: importing SGLang takes tens of seconds.
PARSE_ALL = """
import json, sys
from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import prepare_server_args
load_plugins()
out = {}
for name, argv in json.loads(sys.argv[1]).items():
    try:
        prepare_server_args(argv)
        out[name] = [0, ""]
    except SystemExit as e:
        out[name] = [1, str(e.code)]
print("RESULT" + json.dumps(out))
"""


def test_bad_input_is_refused_while_parsing(server_env, model_dir, unsupported_model):
    import sys

    cases = {
        k: ["--model-path", str(model_dir), "--device", "cpu", *a] for k, (a, _) in CASES.items()
    }
    cases["unsupported-model"] = ["--model-path", str(unsupported_model), "--sparse-attn", "cis"]
    cases["good"] = ["--model-path", str(model_dir), "--device", "cpu", "--sparse-attn", "cis"]
    done = subprocess.run(
        [sys.executable, "-c", PARSE_ALL, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=300,
        env=server_env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT", 1)[1])
    for name, (_, message) in CASES.items():
        assert result[name][0] == 1 and message in result[name][1], (name, result[name])
    unsupported = result["unsupported-model"]
    assert unsupported[0] == 1
    assert "does not support model architecture(s) ['MambaForCausalLM']" in unsupported[1]
    assert result["good"] == [0, ""]


def test_launcher_fails_before_a_scheduler_starts(launch_cmd, server_env, model_dir):
    out = _launch(launch_cmd, server_env, model_dir, "--sparse-attn", "nope")
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert "error: --sparse-attn: unknown selector 'nope'. Known selectors:" in text, text[-3000:]
    assert "Load weight" not in text and "Scheduler hit an exception" not in text
