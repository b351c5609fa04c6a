"""The GPU proof script must run when a GPU is finally lent: its kernel and sync
sections run here under Triton's interpreter with tiny shapes (--smoke), and the
report lands in --out."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                       reason="needs Triton's interpreter or a GPU"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def test_gpu_check_smoke_writes_its_report(tmp_path):
    from pdserve.bench import gpu_check

    gpu_check.main(["--smoke", "--skip", "graphs,speed", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["kernels"]["ok"] is True, report["kernels"]
    assert report["kernels"]["worst_err"] < 2e-2
    assert report["sync"]["ok"] is True, report["sync"]
    assert report["sync"]["steady_decode_steps_without_sync"] == 16
    assert "all sections ok" in (tmp_path / "gpu_check.txt").read_text()
