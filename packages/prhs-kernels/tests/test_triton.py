"""Runs ``interpreted/`` (the Triton kernels against their references under Triton's CPU
interpreter) in a pytest process of its own started with ``TRITON_INTERPRET=1``: Triton reads
that variable when it is imported, and in this process it may already be imported without it.
The process starts when collection finishes (``conftest.py``), so it runs beside the rest of
the session; this test waits for it."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")


def test_triton_kernels_under_the_interpreter(interpreted_result):
    returncode, output = interpreted_result
    assert returncode == 0, output[-9000:]
    assert " passed" in output and "skipped" not in output, output[-2000:]
