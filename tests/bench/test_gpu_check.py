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

    gpu_check.main(["--smoke", "--only", "kernels,sync", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(report) == {"kernels", "sync"}
    kernels = report["kernels"]
    assert kernels["ok"] is True, kernels
    assert kernels["worst_rel_err"] < kernels["tolerance"] == gpu_check.REL_TOL
    # the tree cases (a long and a short prefix) can fail: a causal mask in the tree's
    # place is off by more than the tolerance
    trees = {k: v for k, v in kernels.items() if k.endswith("_tree")}
    assert len(trees) == 2 and any("_pre0_" in k for k in trees)
    assert all(v["rel_err_vs_causal_mask"] > 5 * gpu_check.REL_TOL for v in trees.values())
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


def test_gpu_check_refuses_unknown_sections(tmp_path, capsys):
    from pdserve.bench import gpu_check

    with pytest.raises(SystemExit):
        gpu_check.main(["--smoke", "--only", "kernels,warp", "--out", str(tmp_path)])
    assert "warp" in capsys.readouterr().err


def test_relative_error_reads_a_small_output_as_wrong():
    """An absolute 2e-2 would pass an answer 60% off when the outputs are ~0.03."""
    from pdserve.bench.gpu_check import REL_TOL, relative_error

    want = [torch.full((4, 8), 0.03)]
    assert relative_error([want[0] * 1.6], want) > REL_TOL
    assert relative_error([want[0] * 1.001], want) < REL_TOL


def test_gpu_pd_servers_counts_a_load_only_when_nothing_failed():
    from types import SimpleNamespace

    from pdserve.bench.gpu_pd_servers import check_load

    check_load("1P1D", "mixed", SimpleNamespace(failed=0, completed=5))  # type: ignore[arg-type]
    for bad in (SimpleNamespace(failed=1, completed=5), SimpleNamespace(failed=0, completed=0)):
        with pytest.raises(AssertionError, match="1P1D"):
            check_load("1P1D", "mixed", bad)  # type: ignore[arg-type]


def test_gpu_check_pd_reports_every_cell_when_one_fails(tmp_path, monkeypatch):
    """One broken staging cell must not hide the others' results (each reports on its own)."""
    from pdserve.bench import gpu_check_pd
    from pdserve.bench.gpu_check import Report
    from pdserve.disagg import local_pair
    from pdserve.testing import build_random_draft, build_random_model

    real = local_pair.build_side
    calls: list[str] = []

    def build_side(cls, model_dir, args, *a, **kw):  # type: ignore[no-untyped-def]
        calls.append(args["disaggregation_kv_staging"])
        if len(calls) == 1:
            raise RuntimeError("this staging cell is broken")
        return real(cls, model_dir, args, *a, **kw)
    monkeypatch.setattr(local_pair, "build_side", build_side)
    target = build_random_model(tmp_path / "t", "llama", num_layers=2)
    draft = build_random_draft(target, tmp_path / "e", "EAGLE")
    entry: dict = {}
    with pytest.raises(AssertionError, match="P direct / D direct($|;)"):
        gpu_check_pd.check_pd(Report(None), entry, target, draft, torch.device("cpu"), 2)
    cells = [k for k in entry if k.startswith("P ")]
    assert len(cells) == 4
    assert entry["P direct / D direct"]["ok"] is False and "broken" in entry["P direct / D direct"]["error"]
    assert all(entry[c]["ok"] for c in cells[1:]), entry
