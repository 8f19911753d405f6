"""Bad input to ``python -m sglang.launch_server``: a clear error before any scheduler starts."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest

pytestmark = pytest.mark.slow


def _unsupported_model(directory):
    (directory / "config.json").write_text(
        json.dumps({"architectures": ["MambaForCausalLM"], "model_type": "mamba"})
    )
    return directory


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


@dataclass
class Run:
    """A command started in the background; :meth:`wait` gives its exit code and output."""

    proc: subprocess.Popen[str]

    def wait(self, timeout: float = 600) -> tuple[int, str, str]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            pytest.fail(f"{self.proc.args[:4]} still running after {timeout} s:\n{err[-3000:]}")
        return self.proc.returncode, out, err


@pytest.fixture(scope="module")
def runs(launch_cmd, server_env, model_dir, tmp_path_factory):
    """Both commands of this module, started together (each spends most of a minute importing
    SGLang, on one core: together they take the time of one on a machine with two)."""
    unsupported = _unsupported_model(tmp_path_factory.mktemp("mamba"))
    cases = {
        k: ["--model-path", str(model_dir), "--device", "cpu", *a] for k, (a, _) in CASES.items()
    }
    cases["unsupported-model"] = ["--model-path", str(unsupported), "--sparse-attn", "cis"]
    cases["good"] = ["--model-path", str(model_dir), "--device", "cpu", "--sparse-attn", "cis"]
    commands = {
        "parse": [sys.executable, "-c", PARSE_ALL, json.dumps(cases)],
        "launch": launch_cmd(model_dir, "--sparse-attn", "nope"),
    }
    started = {
        name: Run(
            subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=server_env
            )
        )
        for name, cmd in commands.items()
    }
    yield started
    for run in started.values():
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.communicate()


def test_bad_input_is_refused_while_parsing(runs):
    code, out, err = runs["parse"].wait()
    assert code == 0, err[-3000:]
    result = json.loads(out.split("RESULT", 1)[1])
    for name, (_, message) in CASES.items():
        assert result[name][0] == 1 and message in result[name][1], (name, result[name])
    unsupported = result["unsupported-model"]
    assert unsupported[0] == 1
    assert "does not support model architecture(s) ['MambaForCausalLM']" in unsupported[1]
    assert result["good"] == [0, ""]


def test_launcher_fails_before_a_scheduler_starts(runs):
    code, out, err = runs["launch"].wait()
    text = out + err
    assert code != 0
    assert "error: --sparse-attn: unknown selector 'nope'. Known selectors:" in text, text[-3000:]
    assert "Load weight" not in text and "Scheduler hit an exception" not in text
