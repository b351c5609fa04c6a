"""Decode forwards replayed from CUDA graphs.

A decode step launches hundreds of small kernels; on a GPU their launch cost is
most of the step at small batch. A graph records the launches of one decode
forward once and replays them with one call. Graphs have fixed shapes and fixed
addresses, so:

- inputs live in static buffers sized for the largest captured batch; a real
  batch is copied into their first rows and padded up to the next captured size
  (``capture_sizes``). Padding rows read and write only the padding request-table
  row, whose every position maps to KV slot 0, the pool's padding slot;
- one graph per size, captured at startup (largest first, sharing one memory
  pool), each with its own output logits;
- the sampler runs outside the graph on the real rows' logits.

The same static-buffer forward also runs eagerly (CPU, or sizes not captured):
that is how the bookkeeping is tested without a GPU. Only the triton backend is
graphable: its decode plan reads no host lengths.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any, Callable

import torch

from pdserve.model.attention import RowLayout

logger = logging.getLogger(__name__)


def capture_sizes(max_bs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then every multiple of 8, up to ``max_bs``."""
    if max_bs < 1:
        raise ValueError(f"max batch size must be >= 1, got {max_bs}")
    sizes = {s for s in (1, 2, 4) if s <= max_bs} | set(range(8, max_bs + 1, 8)) | {max_bs}
    return sorted(sizes)


def bucket_for(batch_size: int, sizes: list[int]) -> int | None:
    """The smallest captured size holding ``batch_size`` rows (None: too big, run eagerly)."""
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    """Static decode inputs, padding, and (on CUDA) one captured graph per size.

    ``forward(input_ids, layout)`` is the model's decode forward returning logits
    for every row; it must read nothing from the host but shapes."""

    def __init__(self, forward: Callable[[torch.Tensor, RowLayout], torch.Tensor], padding_row: int,
                 max_bs: int, device: torch.device) -> None:
        self.forward = forward
        self.padding_row = padding_row
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.device = device
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.rows = torch.full((self.max_bs,), padding_row, dtype=torch.int64, device=device)
        self.prefix_lens = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.ones = torch.ones(self.max_bs, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.max_bs

    def load(self, input_ids: torch.Tensor, layout: RowLayout) -> int:
        """Copy a decode batch into the static buffers and pad it; returns the size run."""
        bs = layout.batch_size
        size = bucket_for(bs, self.sizes)
        assert size is not None, f"batch of {bs} exceeds the captured maximum {self.max_bs}"
        self.input_ids[:bs].copy_(input_ids, non_blocking=True)
        self.rows[:bs].copy_(layout.rows, non_blocking=True)
        self.prefix_lens[:bs].copy_(layout.prefix_lens, non_blocking=True)
        self.input_ids[bs:size].zero_()
        self.rows[bs:size].fill_(self.padding_row)
        self.prefix_lens[bs:size].zero_()
        return size

    def static_layout(self, size: int) -> RowLayout:
        """The first ``size`` static rows as a layout. Its host values only give the
        shape (one token per row): a graphable plan reads no host lengths."""
        return RowLayout(self.rows[:size], self.prefix_lens[:size], self.ones[:size],
                         (self.padding_row,) * size, (0,) * size, (1,) * size)

    @torch.inference_mode()  # as captured (``capture_each``): no autograd state in the logits
    def run(self, input_ids: torch.Tensor, layout: RowLayout) -> torch.Tensor:
        """Logits [B, V] of a decode batch: a graph replay where one was captured."""
        bs = layout.batch_size
        size = self.load(input_ids, layout)
        graph = self.graphs.get(size)
        if graph is None:
            return self.forward(self.input_ids[:size], self.static_layout(size))[:bs]
        graph.replay()
        return self.outputs[size][:bs]

    def capture(self) -> None:
        """Capture every size (CUDA only), largest first, into one memory pool."""
        self.graphs, self.outputs = capture_each(
            self.sizes, lambda size: self.forward(self.input_ids[:size], self.static_layout(size)), self.device,
            "decode")


def capture_each(sizes: list[int], forward: Callable[[int], Any], device: torch.device, what: str
                 ) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, Any]]:
    """One CUDA graph per size of ``forward(size)`` (a forward over static buffers),
    largest first, sharing one memory pool; each after a warm-up run outside capture
    (kernel compilation and allocations happen there). Returns the graphs and the
    outputs each one refills on replay.

    Captured under inference mode: with autograd on, each captured output would keep the
    autograd graph of its forward (and its saved activations) alive in the graph's pool,
    whenever a parameter requires grad."""
    assert device.type == "cuda", "CUDA graphs need a CUDA device"
    before = torch.cuda.memory_allocated(device)
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    outputs: dict[int, Any] = {}
    pool = None
    stream = torch.cuda.Stream(device)
    with torch.inference_mode():
        for size in reversed(sizes):
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                forward(size)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs[size] = forward(size)
            pool = graph.pool()
            graphs[size] = graph
    torch.cuda.synchronize(device)
    taken = (torch.cuda.memory_allocated(device) - before) / 2**20
    logger.info("CUDA graphs captured for %s batch sizes %s (%.0f MiB)", what, sizes, taken)
    return graphs, outputs
