"""The decode-step benchmark runs both engines and reports equal greedy outputs."""

from __future__ import annotations

import re

import pytest
import torch

from pdserve.bench import decode_step

pytestmark = pytest.mark.fast


def test_decode_step_reports_both_rows_and_identical_outputs(llama_dir, capsys):
    decode_step.main(["--model-path", str(llama_dir), "--batch", "3", "--min-len", "20", "--max-len", "60",
                      "--new", "6", "--rounds", "1",
                      "--threads", str(torch.get_num_threads())])  # leave the process as it was
    out = capsys.readouterr().out
    rows = re.findall(r"decode step ms: ([\d.]+)", out)
    assert len(rows) == 2 and all(float(x) > 0 for x in rows)
    assert "identical greedy outputs: True" in out
