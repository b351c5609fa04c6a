"""The draft's tree steps replayed from CUDA graphs.

A round's S - 1 draft forwards (plus the top-k, the frontier sorts and the tree
selection) launch many small kernels, like a decode step: on a GPU their launch
cost dominates at small batch. ``EagleWorker.grow_tree`` reads only device tensors
and takes its shapes from B, k and S (the triton backend's tree steps read prefix
lengths on the device), so one graph per batch size records a whole round, as
``model.cuda_graph`` does for decode:

- inputs live in static buffers sized for the largest captured batch: each
  request's table row, KV length, last token, carried top-k and draft hidden
  state. A batch is copied into their first rows and padded to the next captured
  size; padding rows use the padding table row (every position maps to slot 0,
  the padding slot) with no prefix, so they read and write nothing of a request;
- the tree outputs are the graph's own tensors, refilled by each replay: a round
  consumes its tree (verify, accept) before the next round replays.

Without CUDA (the tests) the same static-buffer forward runs eagerly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.model.cuda_graph import bucket_for, capture_each, capture_sizes

if TYPE_CHECKING:
    from pdserve.speculative.eagle_worker import DraftTree, EagleWorker


class DraftGraphs:
    def __init__(self, worker: "EagleWorker", padding_row: int, max_bs: int) -> None:
        self.worker = worker
        self.padding_row = padding_row
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        device, k = worker.device, worker.topk
        self.device = device
        self.rows = torch.full((self.max_bs,), padding_row, dtype=torch.int64, device=device)
        self.kv_lens = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.root = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.topk_index = torch.zeros(self.max_bs, k, dtype=torch.int64, device=device)
        self.topk_p = torch.zeros(self.max_bs, k, dtype=torch.float32, device=device)
        carried = worker.carried_hidden  # the draft's hidden state: its width and dtype
        self.hidden = torch.zeros(self.max_bs, carried.shape[1], dtype=carried.dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, "DraftTree"] = {}

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.max_bs

    def _grow(self, size: int) -> "DraftTree":
        w = self.worker
        assert w.req_to_token is not None
        rows, kv_lens = self.rows[:size], self.kv_lens[:size]
        # (The longest prefix is a shape for torch_native only; graphs run on triton.)
        tree_round = w.backend.plan_tree_round(w.req_to_token, rows, kv_lens, 0)
        return w.grow_tree(tree_round, rows, kv_lens, self.root[:size], self.topk_index[:size],
                           self.topk_p[:size], self.hidden[:size])

    @torch.inference_mode()  # as captured (``capture_each``): no autograd state in the tree
    def run(self, rows: torch.Tensor, kv_lens: torch.Tensor, root: torch.Tensor, topk_index: torch.Tensor,
            topk_p: torch.Tensor, hidden: torch.Tensor) -> "DraftTree":
        """The round's tree for a batch of B requests (inputs as ``grow_tree`` takes
        them): a graph replay where one was captured for its padded size."""
        from pdserve.speculative.eagle_worker import DraftTree

        bs = rows.shape[0]
        size = bucket_for(bs, self.sizes)
        assert size is not None, f"batch of {bs} exceeds the captured maximum {self.max_bs}"
        for buf, value, pad in ((self.rows, rows, self.padding_row), (self.kv_lens, kv_lens, 0),
                                (self.root, root, 0), (self.topk_index, topk_index, 0), (self.topk_p, topk_p, 0),
                                (self.hidden, hidden, 0)):
            buf[:bs].copy_(value, non_blocking=True)
            buf[bs:size].fill_(pad)
        graph = self.graphs.get(size)
        if graph is None:
            tree = self._grow(size)
        else:
            graph.replay()
            tree = self.outputs[size]
        return DraftTree(tree.tokens[:bs], tree.parents[:bs], tree.depths[:bs], tree.masks[:bs])

    def capture(self) -> None:
        self.graphs, self.outputs = capture_each(self.sizes, self._grow, self.device, "draft tree")
