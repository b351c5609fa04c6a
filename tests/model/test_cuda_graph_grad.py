"""CUDA graphs are captured, and their static-buffer forward run, with autograd off
(inference mode): captured with it on, every output of a forward reading a parameter
that requires grad keeps that forward's autograd graph and saved activations alive in
the graph's memory pool (about 11 GiB for Llama-3.1-8B). Checked on the CPU: the
eager static-buffer path, and the capture loop with the CUDA calls stubbed."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pdserve.model.attention import RowLayout
from pdserve.model.cuda_graph import DecodeGraphs, capture_each

pytestmark = pytest.mark.fast

CPU = torch.device("cpu")


def test_static_buffer_decode_records_no_autograd():
    # A parameter that requires grad: what the runner's weights were before they were frozen.
    weight = nn.Parameter(torch.randn(16, 8))
    modes: list[bool] = []

    def forward(input_ids: torch.Tensor, layout: RowLayout) -> torch.Tensor:
        modes.append(torch.is_inference_mode_enabled())
        return weight[input_ids] * layout.prefix_lens.unsqueeze(1)

    graphs = DecodeGraphs(forward, padding_row=9, max_bs=4, device=CPU)
    logits = graphs.run(torch.tensor([1, 2, 3]), RowLayout.upload([0, 1, 2], [3, 4, 5], [1, 1, 1], CPU))
    assert logits.shape == (3, 8) and modes == [True] and not logits.requires_grad
    torch.testing.assert_close(logits, weight.detach()[[1, 2, 3]] * torch.tensor([[3.0], [4.0], [5.0]]))


class _Graph:
    """Stands in for torch.cuda.CUDAGraph: capture records nothing, the forward just runs."""

    def pool(self) -> str:
        return "pool"


def test_capture_records_no_autograd(monkeypatch: pytest.MonkeyPatch):
    stream = SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    weight = nn.Parameter(torch.randn(8, 4))
    runs: list[tuple[int, bool]] = []

    def forward(size: int) -> torch.Tensor:
        runs.append((size, torch.is_inference_mode_enabled()))
        return weight[:size] * 2

    graphs, outputs = capture_each([1, 2, 4], forward, torch.device("cuda", 0), "test")
    assert sorted(graphs) == sorted(outputs) == [1, 2, 4]
    # A warm-up run, then the capture, largest first; all with autograd off.
    assert runs == [(4, True), (4, True), (2, True), (2, True), (1, True), (1, True)]
    assert not any(out.requires_grad for out in outputs.values())
