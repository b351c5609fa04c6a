"""EAGLE decoding: the decode strategy of a scheduler with a draft model.

One round for every running request: draft a tree (the draft model's forwards
happen while planning), verify it with one target forward, emit the accepted
tokens and the bonus token, and compact the KV of the accepted path.
"""

from __future__ import annotations

from typing import Callable

import torch

from pdserve.model import device_io
from pdserve.model.parallel import TPGroup, assert_agree
from pdserve.scheduler.batch import Draws, Gain, Sampler, ScheduledBatch
from pdserve.scheduler.kv_manager import KVManager
from pdserve.scheduler.req import FinishReason, Req
from pdserve.speculative.eagle_worker import EagleWorker


def accept_on_device(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, drawn: torch.Tensor,
                     max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The accepted paths of a batch of trees ([B, N] each), without leaving the device:
    from the root, descend while the token drawn at the current node is one of its
    children (the lowest-index such child, as ``EagleWorker.accept_path``). Returns
    the path's nodes [B, max_depth + 1] (its last node repeated past its end) and
    its length [B] (the root included)."""
    b = tokens.shape[0]
    # Node j is a candidate when its token is what its parent drew.
    drew_me = drawn.gather(1, parents.clamp(min=0)) == tokens
    current = torch.zeros(b, dtype=torch.int64, device=tokens.device)
    lengths = torch.ones(b, dtype=torch.int64, device=tokens.device)
    path = [current]
    for depth in range(1, max_depth + 1):
        child = drew_me & (depths == depth) & (parents == current.unsqueeze(1))
        found = child.any(dim=1)
        current = torch.where(found, child.to(torch.uint8).argmax(dim=1), current)  # argmax: the first
        lengths += found
        path.append(current)
    return torch.stack(path, dim=1), lengths


def path_tokens(tokens: list[int], parents: list[int], node: int) -> list[int]:
    """Tokens of a draft tree node's ancestors below the root, and its own, root first."""
    out: list[int] = []
    while node > 0:
        out.append(tokens[node])
        node = parents[node]
    return out[::-1]


class DrawView:
    """A request as it would be after emitting a tree path: what the sampler reads.
    The extended output list is only built when penalties need it (not per node
    of every round)."""

    def __init__(self, req: Req, path: list[int]) -> None:
        self.params = req.params
        self.seed = req.seed
        self._req = req
        self._path = path
        self.num_output_tokens = len(req.output_ids) + len(path)
        # The sampler's penalty state counts the request's committed output once and
        # adds the path's tokens on top for this draw only.
        self.base = req
        self.extra_ids = path

    @property
    def output_ids(self) -> list[int]:
        return self._req.output_ids + self._path

    @property
    def fill_ids(self) -> list[int]:
        return self._req.prompt_ids + self.output_ids


class EagleDecoding:
    """One speculative round per step for the requests it is given. Its dependencies
    are explicit (the KV manager, the sampler, the draft worker, the stop check); it
    returns what each request gained and never touches the scheduler."""

    def __init__(self, kv: KVManager, sampler: Sampler, spec: EagleWorker,
                 stop: Callable[[Req], FinishReason | None], agreement: TPGroup | None = None) -> None:
        """``agreement``: the TP group whose ranks must propose the same tree and accept the
        same path each round, checked (``--debug-tp-agreement``); None: not checked."""
        self.kv = kv
        self.sampler = sampler
        self.spec = spec
        self.stop = stop
        self.agreement = agreement
        self.lookahead = spec.lookahead  # positions past kv_len one round uses: the tree and the draft scratch
        # The deepest node a tree can have (and the longest accepted path, minus the root).
        self.max_depth = min(spec.steps, spec.num_draft_tokens - 1)

    def plan(self, reqs: list[Req]) -> ScheduledBatch:
        """Open the round's pages (closed by ``process``, or released with a request that
        ends first), then draft the tree: the draft model's forwards run here."""
        self.kv.open_rounds(reqs, self.spec.lookahead)
        tree = self.spec.propose(reqs)
        if self.agreement is not None:
            assert_agree(self.agreement, torch.cat([tree.tokens, tree.parents], dim=1), "the draft tree")
        return ScheduledBatch("verify", reqs, self.spec.verify_input(reqs, tree), tree=tree)

    def process(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[Gain]:
        spec = self.spec
        reqs = batch.reqs
        starts = [r.kv_len for r in reqs]  # each request's kv_len before the round
        # Every node draws the token plain decoding would draw at its output position
        # (same parameters, same seeded noise), and the walk emits the nodes whose
        # tokens their parents drew: exactly the non-speculative output.
        if self.sampler.tree_drawable(reqs):
            paths, draws = self._accept_on_device(batch, logits, starts)
            compacted = True
        else:
            paths, draws = self._accept_by_views(batch, logits)
            compacted = False
        moves: list[tuple[int, int, int]] = []
        gains: list[Gain] = []
        for req, n, (path, rows) in zip(reqs, starts, paths):
            reason = None
            emitted = 0
            for row in rows:
                draws.append_to(req, row)
                emitted += 1
                reason = self.stop(req)
                if reason is not None:
                    break
            # Position n + j now holds the input of the j-th emitted token: node path[j].
            if not compacted:
                moves += [(req.row, n + j, n + path[j]) for j in range(1, emitted) if path[j] != j]
            req.kv_len = n + emitted
            req.spec_verify_ct += 1
            req.spec_accepted_drafts += min(emitted, len(path) - 1)
            spec.num_verify_rounds += 1
            spec.num_emitted_tokens += emitted
            gains.append(Gain(req, reason))
        if self.agreement is not None:
            # Fixed size per request (a length that differed would break the all-gather).
            assert_agree(self.agreement, torch.tensor([(r.kv_len, len(r.output_ids), r.output_ids[-1]) for r in reqs],
                                                      dtype=torch.int64), "the accepted tokens")
        # One batched compaction (done on the device already on the batched path), then
        # the round's pages past each kept length go back (page ids from the host: no
        # device read); requests that stop release their compacted KV when the
        # scheduler finishes them.
        self.kv.move_positions(moves)
        self.kv.close_rounds(reqs)
        spec.catch_up([g.req for g in gains if g.stop is None])
        return gains

    def _accept_on_device(self, batch: ScheduledBatch, logits: torch.Tensor, starts: list[int]
                          ) -> tuple[list[tuple[list[int], list[int]]], Draws]:
        """Draw every node, walk the accepted paths and compact their KV on the device,
        then read the paths' draws back in the round's one device read."""
        tree = batch.tree
        reqs, nodes = batch.reqs, self.spec.num_draft_tokens
        b = len(reqs)
        result = self.sampler.draw_tree(logits, reqs, tree.tokens, tree.masks, tree.depths)
        drawn = result.next_ids.view(b, nodes)
        path, lengths = accept_on_device(tree.tokens, tree.parents, tree.depths, drawn, self.max_depth)
        self._compact(reqs, starts, path, lengths)
        width = path.shape[1]
        flat = (path + torch.arange(b, device=path.device).unsqueeze(1) * nodes).reshape(-1)
        # The paths' draws, then each row's node and its path's length: one read.
        extra = torch.stack([path.reshape(-1), lengths.repeat_interleave(width)], dim=1).double()
        host = device_io.fetch(torch.cat([Draws.pack(result, flat), extra], dim=1))
        draws = Draws.unpack([r[:-2] for r in host], result)
        paths = []
        for i in range(b):
            length = int(host[i * width][-1])
            paths.append(([int(r[-2]) for r in host[i * width: i * width + length]],
                          list(range(i * width, i * width + length))))
        return paths, draws

    def _compact(self, reqs: list[Req], starts: list[int], path: torch.Tensor, lengths: torch.Tensor) -> None:
        """Position n + j of each request takes the KV (and target feature) of its path's
        j-th node, as one copy of a fixed B x depth slots (no read of how many moved:
        slots off the path copy onto themselves; positions a stop cuts off later are
        trimmed or rewritten)."""
        kv = self.kv
        depth = path.shape[1] - 1
        if depth == 0:
            return
        rows, n = device_io.upload_rows([[r.row for r in reqs], starts], torch.int64, kv.device)
        j = torch.arange(1, depth + 1, device=path.device).unsqueeze(0)
        on_path = j < lengths.unsqueeze(1)
        dst = n.unsqueeze(1) + j
        src = torch.where(on_path, n.unsqueeze(1) + path[:, 1:], dst)
        table = kv.req_table.table
        kv.copy_slots(table[rows.unsqueeze(1), dst].reshape(-1), table[rows.unsqueeze(1), src].reshape(-1))

    def _accept_by_views(self, batch: ScheduledBatch, logits: torch.Tensor
                         ) -> tuple[list[tuple[list[int], list[int]]], Draws]:
        """Constrained requests (their grammar's state along a path lives in a host
        matcher): each node is drawn from a view of its request with the path emitted.
        Two device reads: the tree, then the draws."""
        spec = self.spec
        reqs, nodes = batch.reqs, spec.num_draft_tokens
        tokens, parents = device_io.fetch(torch.stack([batch.tree.tokens, batch.tree.parents]))
        views = [DrawView(r, path_tokens(tokens[b], parents[b], j)) for b, r in enumerate(reqs)
                 for j in range(nodes)]
        draws = self.sampler.draw(logits, views, reqs)
        paths = []
        for b in range(len(reqs)):
            path = spec.accept_path(tokens[b], parents[b], draws.ids[b * nodes: (b + 1) * nodes])
            paths.append((path, [b * nodes + node for node in path]))
        return paths, draws

    def prefilled(self, reqs: list[Req]) -> None:
        """Draft KV for what a prefill added; the next token is known now."""
        self.spec.catch_up(reqs)
