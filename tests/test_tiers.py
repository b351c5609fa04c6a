"""The fast tier's promise is enforced (tests/conftest.py): inside a test marked `fast`,
its fixtures included, starting a process or launching a Triton-interpreter kernel
fails naming the test; tests without the mark are untouched."""

from __future__ import annotations

import multiprocessing
import os
import subprocess

import pytest


@pytest.mark.fast
def test_a_fast_test_cannot_start_a_subprocess(request):
    with pytest.raises(AssertionError, match="fast tier .* starts no processes") as err:
        subprocess.run(["true"], check=True)
    assert request.node.nodeid in str(err.value) and "subprocess.Popen" in str(err.value)
    with pytest.raises(AssertionError, match="os.system"):
        os.system("true")


@pytest.mark.fast
def test_a_fast_test_cannot_start_a_multiprocessing_process():
    for method in ("spawn", "fork"):
        proc = multiprocessing.get_context(method).Process(target=print)
        with pytest.raises(AssertionError, match="multiprocessing.Process.start"):
            proc.start()
    with pytest.raises(AssertionError, match="os.fork"):
        os.fork()


@pytest.mark.fast
def test_a_fast_test_cannot_launch_an_interpreted_triton_kernel():
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    with pytest.raises(AssertionError, match="Triton kernel"):
        interpreter.InterpretedFunction.run(None, grid=(1,), warmup=False)


def test_unmarked_tests_may_start_processes():
    assert subprocess.run(["true"]).returncode == 0
