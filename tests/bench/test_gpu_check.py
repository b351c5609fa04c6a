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


def test_gpu_check_pd_smoke_writes_its_report(tmp_path):
    """Issue 23's in-process GPU proof (PD pairs over every staging mode, EAGLE chain and
    tree, the staged transfer's bandwidth) runs end to end with tiny shapes."""
    from pdserve.bench import gpu_check_pd

    gpu_check_pd.main(["--smoke", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "gpu_check_pd.json").read_text())
    for section in ("pd", "spec", "transfer"):
        assert report[section]["ok"] is True, report[section]
    assert all(cell["turn1_equal"] == cell["requests"] == cell["turn2_equal"]
               for name, cell in report["pd"].items() if name.startswith("P "))
    assert report["spec"]["tree"]["equal"] == report["spec"]["tree"]["requests"]
    assert report["transfer"]["staged"] > 0
    assert "all sections ok" in (tmp_path / "gpu_check_pd.txt").read_text()


def test_gpu_pd_servers_smoke_writes_its_report(tmp_path):
    """Issue 23's two-server proof (`pdserve up` deployments on one device, router in
    front, Mooncake between the servers) runs end to end with tiny shapes: the 1P1D
    deployment with EAGLE on decode gives the colocated server's greedy outputs and
    serves both loads."""
    from pdserve.bench import gpu_pd_servers

    gpu_pd_servers.main(["--smoke", "--only", "1P1D decode-EAGLE", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "gpu_pd_servers.json").read_text())
    assert set(report) == {"colocated", "1P1D decode-EAGLE"}
    pd = report["1P1D decode-EAGLE"]
    assert pd["ok"] is True, pd
    assert pd["greedy_equal_colocated"] == "4/4"
    for load in ("mixed", "multiturn_round2"):
        assert pd[load]["failed"] == 0 and pd[load]["completed"] > 0
    assert pd["mixed"]["accept_length"] >= 1.0
    assert "all deployments ok" in (tmp_path / "gpu_pd_servers.txt").read_text()
