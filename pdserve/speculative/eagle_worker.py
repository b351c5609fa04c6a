"""EAGLE / EAGLE3 (and MTP: EAGLE with the target's own NextN layer) speculative decoding:
the draft side of every round.

The scheduler owns slots and finishing; this module owns the draft model, the
draft KV pool and the target-feature pool, and does the tree math:

  catch_up   draft extend over positions [draft_len, kv_len) of each request:
             row p reads (x_{p+1}, f_p) at RoPE position p and writes the
             draft KV of p; the last row's top-k seeds the next tree.  It runs
             after every prefill chunk (features come from the feature pool,
             so a radix-cache hit or a retraction simply recomputes the draft
             KV of the whole prefix) and after every verify.
  propose    S - 1 draft forwards grow the tree: level 0 is the carried top-k,
             each later level keeps the k best of the frontier's k x k children
             (scores are products of probabilities); the N - 1 best nodes over
             all levels, in ascending index order, form the tree.  Draft step i
             (1-based) runs at position kv_len + i - 1 and attends to the
             prefix plus the node's exact ancestors.
  verify_input / accept
             one target forward over [root, nodes] with an ancestry mask at
             positions kv_len + depth; at every node the target's token is
             drawn exactly as plain decoding would draw it at that output
             position (the sampler's noise is a function of the position), and
             the walk descends while that token is a child.  Output is
             therefore identical to non-speculative decoding, greedy or not.

Slots: a request's positions [kv_len, kv_len + lookahead) hold the tree for one
round: target KV of node j at position kv_len + j, draft scratch KV of the
j-th forwarded frontier node at position kv_len + j (the draft pool shares slot
indices with the target pool).  Accepted nodes are then moved into place
(target KV and features), and the draft extend rewrites their draft KV.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pdserve.config import ServerArgs
from pdserve.model.attention_backends import DraftAttentionBackend, create_backend
from pdserve.model.forward_context import RowLayout
from pdserve.model.device_io import upload, upload_rows
from pdserve.model.layers import RotaryEmbedding
from pdserve.model.model_config import ModelConfig
from pdserve.model.runner import ForwardInput, ModelRunner
from pdserve.scheduler.memory import TokenToKVPool
from pdserve.scheduler.req import Req
from pdserve.speculative.draft_config import draft_identity
from pdserve.speculative.draft_model import DraftConfig, EagleDraftModel

if TYPE_CHECKING:
    from pdserve.speculative.draft_graphs import DraftGraphs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CarriedState:
    """What a request carries into its next round (a copy, for inspection)."""
    topk_p: torch.Tensor      # [k] draft probabilities of the next token's candidates
    topk_index: torch.Tensor  # [k] their target token ids
    hidden: torch.Tensor      # [H] draft output at the last position


@dataclass
class DraftTree:
    """N nodes per request; node 0 is the root (the last committed token)."""
    tokens: torch.Tensor   # [B, N]
    parents: torch.Tensor  # [B, N] (-1 for the root)
    depths: torch.Tensor   # [B, N]
    masks: torch.Tensor    # [B, N, N] bool: node i sees node j (ancestors and itself)


class EagleWorker:
    def __init__(self, args: ServerArgs, runner: ModelRunner, num_slots: int) -> None:
        assert args.speculative_algorithm is not None and args.speculative_draft_model_path is not None
        self.runner = runner
        self.device = runner.device
        self.algorithm = args.speculative_algorithm
        self.steps, self.topk, self.num_draft_tokens = args.speculative_shape(runner.config.architecture)
        if args.speculative_num_steps is None:
            logger.info("speculative decoding: default shape for %s: num_steps %d, eagle_topk %d, "
                        "num_draft_tokens %d", runner.config.architecture, self.steps, self.topk,
                        self.num_draft_tokens)
        draft_dir = Path(args.speculative_draft_model_path)
        self.config = DraftConfig.from_dir(draft_dir, self.algorithm, runner.config)
        self.identity = draft_identity(draft_dir, self.algorithm, self.config.layout)  # compared across a PD pair
        target = runner.model
        self.draft = EagleDraftModel.load(draft_dir, self.config, target.model.embed_tokens, target.lm_head,
                                          self.device, runner.dtype, runner.tp)
        lay = self.config.layer
        logger.info("draft head: %s, %s layout, %d layer(s), hidden %d, draft vocab %d%s%s", self.algorithm,
                    "MTP (the checkpoint's NextN layer)" if self.config.is_mtp else self.config.layout, self.config.num_layers, lay.hidden_size, self.config.draft_vocab_size,
                    ", own embedding" if self.config.own_embed else "",
                    "" if self.config.own_head or self.algorithm == "EAGLE" else ", the target's lm_head")
        # One KV layer per draft layer, slot-indexed like the target pool, this rank's heads,
        # in its dtype (fp8 too: draft heads ship no KV scales, so an fp8 draft pool uses
        # 1.0, as SGLang's).
        attn = self.draft.layers[0].self_attn
        self.draft_pool = TokenToKVPool("draft", self.config.num_layers, num_slots, attn.num_kv_heads, lay.head_dim,
                                        runner.kv_dtype, self.device, compute_dtype=runner.dtype)
        # The target feature of every slot: what the draft extend reads (and what a
        # prefill server sends a speculative decode server).
        self.features = torch.zeros(num_slots, self.config.feature_width, dtype=runner.dtype, device=self.device)
        self.capture_layers: tuple[int, ...] = self.config.capture_layers
        # Positions past kv_len one round uses: the verified tree and the draft scratch.
        self.lookahead = max(self.num_draft_tokens, (self.steps - 1) * self.topk)
        self.backend = self._attention(args.resolved_attention_backend(), lay)
        self.draft.bind(self.backend,
                        RotaryEmbedding(lay.head_dim, runner.context_len + self.lookahead, lay.rope).to(self.device))
        self.req_to_token: torch.Tensor | None = None
        self.graphs: "DraftGraphs | None" = None
        self.num_verify_rounds = 0
        self.num_emitted_tokens = 0

    def _attention(self, name: str, lay: ModelConfig) -> DraftAttentionBackend:
        """The draft's attention follows the target's backend (one that supports the draft
        tree): with ``triton`` its tree steps read each request's prefix in place, from
        lengths on the device."""
        attn = self.draft.layers[0].self_attn  # this rank's heads
        return create_backend(name, self.draft_pool, attn.num_heads, attn.num_kv_heads, lay.head_dim, draft=True)

    @staticmethod
    def bytes_per_slot(args: ServerArgs, runner: ModelRunner) -> int:
        """Bytes the draft KV pool and the feature pool take per KV slot (read from the
        draft's config before anything is allocated, to size the pools together)."""
        assert args.speculative_algorithm is not None and args.speculative_draft_model_path is not None
        config = DraftConfig.from_dir(Path(args.speculative_draft_model_path), args.speculative_algorithm,
                                      runner.config)
        lay = config.layer
        size = runner.tp.size  # KV heads per rank, sharded as QKVParallelLinear shards them
        heads = lay.num_kv_heads // size if lay.num_kv_heads >= size else 1
        draft_kv = TokenToKVPool.bytes_per_token(config.num_layers, heads, lay.head_dim, runner.kv_dtype)
        return draft_kv + config.feature_width * torch.empty(0, dtype=runner.dtype).element_size()

    def bind(self, req_to_token: torch.Tensor) -> None:
        self.req_to_token = req_to_token
        # What each request carries from one round to the next, by request-table row
        # (valid while its draft_len == kv_len): the draft's top-k candidates for the
        # next token (probabilities, target ids) and its output at the last position.
        rows, dev = req_to_token.shape[0], self.device
        self.carried_p = torch.zeros(rows, self.topk, dtype=torch.float32, device=dev)
        self.carried_index = torch.zeros(rows, self.topk, dtype=torch.int64, device=dev)
        self.carried_hidden = torch.zeros(rows, self.config.hidden_size, dtype=self.features.dtype, device=dev)

    def carried(self, req: Req) -> CarriedState:
        """A copy of what ``req`` carries into its next round (its row's state)."""
        assert req.row is not None and req.draft_len == req.kv_len, "catch_up() first"
        return CarriedState(self.carried_p[req.row].clone(), self.carried_index[req.row].clone(),
                            self.carried_hidden[req.row].clone())

    def restore(self, req: Req, state: CarriedState) -> None:
        """Start ``req`` from a draft state computed elsewhere (a PD prefill server running
        the same draft): its draft KV for [0, kv_len) is in the draft pool already, and
        ``state`` is what its first round reads."""
        assert req.row is not None
        if state.topk_p.shape != (self.topk,) or state.hidden.shape != (self.config.hidden_size,):
            raise ValueError(f"draft state of shape top-k {tuple(state.topk_p.shape)}, hidden "
                             f"{tuple(state.hidden.shape)}; this draft reads top-{self.topk} and hidden "
                             f"{self.config.hidden_size}")
        self.carried_p[req.row] = state.topk_p.to(self.device)
        self.carried_index[req.row] = state.topk_index.to(self.device)
        self.carried_hidden[req.row] = state.hidden.to(self.device, self.carried_hidden.dtype)
        req.draft_len = req.kv_len

    @property
    def avg_accept_length(self) -> float:
        """Tokens emitted per verify round (accepted drafts + the bonus), SGLang's convention."""
        return self.num_emitted_tokens / self.num_verify_rounds if self.num_verify_rounds else 0.0

    # ---- feature pool -----------------------------------------------------------
    def copy_slots(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Slot moves the target KV makes (compaction, forks) apply to the features too."""
        self.features[dst] = self.features[src]

    # ---- draft extend -------------------------------------------------------------
    @torch.inference_mode()
    def catch_up(self, reqs: list[Req]) -> None:
        """Draft extend over each request's positions [draft_len, kv_len) (x_{p+1} known)."""
        table = self.req_to_token
        assert table is not None
        todo = [r for r in reqs if r.row is not None and r.kv_len > r.draft_len]
        if not todo:
            return
        ids: list[int] = []
        for r in todo:
            fill = r.fill_ids
            assert len(fill) > r.kv_len, "the token after the last KV position must be known"
            ids += fill[r.draft_len + 1: r.kv_len + 1]
        dev = self.device
        layout = RowLayout.upload([r.row for r in todo], [r.draft_len for r in todo],
                                  [r.kv_len - r.draft_len for r in todo], dev)
        ctx = self.backend.draft_extend_context(table, layout)
        hidden = self.draft(upload(ids, torch.int64, dev), self.features[ctx.out_cache_loc], ctx, from_target=True)
        last_hidden = hidden.index_select(0, torch.cumsum(layout.extend_lens, 0) - 1)   # [B, H]
        topk_p, topk_index = self._topk(last_hidden)
        self.carried_p.index_copy_(0, layout.rows, topk_p)
        self.carried_index.index_copy_(0, layout.rows, topk_index)
        self.carried_hidden.index_copy_(0, layout.rows, last_hidden)
        for r in todo:
            r.draft_len = r.kv_len

    def _topk(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.draft.compute_logits(hidden), dim=-1)
        p, idx = torch.topk(probs, self.topk, dim=-1)
        mapping = self.draft.draft_to_target
        return p, (mapping[idx] if mapping is not None else idx)

    # ---- the draft tree ---------------------------------------------------------
    @torch.inference_mode()
    def propose(self, reqs: list[Req]) -> DraftTree:
        """Grow every request's draft tree from its carried state, planned from host
        values only (no device read)."""
        table = self.req_to_token
        assert table is not None
        assert all(r.draft_len == r.kv_len for r in reqs), "catch_up() before propose()"
        rows, n, root = upload_rows([[r.row for r in reqs], [r.kv_len for r in reqs],
                                     [r.output_ids[-1] for r in reqs]], torch.int64, self.device)
        carried = (self.carried_index[rows], self.carried_p[rows], self.carried_hidden[rows])
        if self.graphs is not None and self.graphs.fits(len(reqs)):
            return self.graphs.run(rows, n, root, *carried)
        tree_round = self.backend.plan_tree_round(table, rows, n, max(r.kv_len for r in reqs))
        return self.grow_tree(tree_round, rows, n, root, *carried)

    def enable_graphs(self, padding_row: int, max_bs: int, capture: bool) -> None:
        """Rounds of up to ``max_bs`` requests grow their trees through static buffers,
        replayed from CUDA graphs when ``capture`` (else run eagerly: the CPU tests).
        Needs the triton backend (its tree steps read no host lengths)."""
        from pdserve.model.attention_backends import backends_supporting
        from pdserve.speculative.draft_graphs import DraftGraphs

        if not self.backend.supports_cuda_graphs:
            raise ValueError(f"the draft's CUDA graphs need --attention-backend "
                             f"{' or '.join(backends_supporting('supports_cuda_graphs'))}")
        assert self.req_to_token is not None, "bind() first"
        self.graphs = DraftGraphs(self, padding_row, max_bs)
        if capture:
            self.graphs.capture()

    def grow_tree(self, tree_round: Any, rows: torch.Tensor, n: torch.Tensor, root: torch.Tensor,
                  front_tok: torch.Tensor, front_score: torch.Tensor, hidden: torch.Tensor) -> DraftTree:
        """S - 1 draft forwards over device tensors only (shapes from B, k and S: what a
        CUDA graph can record): rows, n (kv_len), root (last token) [B]; the carried
        top-k [B, k] and draft hidden state [B, H]. Each step attends to a request's
        prefix once for all its k branches, not once per branch."""
        table = self.req_to_token
        assert table is not None
        dev, k, b = self.device, self.topk, rows.shape[0]
        front_h = hidden.unsqueeze(1).expand(b, k, -1)
        front_entry = torch.arange(k, device=dev).expand(b, k)
        front_anc = torch.empty(b, k, 0, dtype=torch.int64, device=dev)  # ancestors' scratch offsets
        ent_tok, ent_score, ent_parent = [front_tok], [front_score], [torch.full((b, k), -1, device=dev)]
        for i in range(1, self.steps):
            own_off = (i - 1) * k + torch.arange(k, device=dev)            # scratch offsets of this step
            offs = torch.cat([front_anc, own_off.view(1, k, 1).expand(b, k, 1)], dim=2)  # [B, k, i]
            tree_slots = table[rows.view(b, 1, 1), n.view(b, 1, 1) + offs]            # [B, k, i]
            ctx = self.backend.tree_step_context(tree_round, tree_slots, (n + i - 1).repeat_interleave(k))
            h = self.draft(front_tok.reshape(-1), front_h.reshape(b * k, -1), ctx, from_target=False)
            child_p, child_tok = self._topk(h)                                        # [B*k, k]
            expand = (front_score.unsqueeze(2) * child_p.view(b, k, k)).view(b, k * k)
            ent_tok.append(child_tok.view(b, k * k))
            ent_score.append(expand)
            ent_parent.append(front_entry.unsqueeze(2).expand(b, k, k).reshape(b, k * k))
            # Stable order: among equal scores the earlier (shallower) entry wins, so a
            # node is never kept without its parent.
            sel = torch.sort(-expand, dim=1, stable=True).indices[:, :k]
            parent_front = torch.div(sel, k, rounding_mode="floor")
            front_tok = child_tok.view(b, k * k).gather(1, sel)
            front_score = expand.gather(1, sel)
            front_h = h.view(b, k, -1).gather(1, parent_front.unsqueeze(2).expand(b, k, h.shape[-1]))
            front_entry = k + (i - 1) * k * k + sel
            front_anc = offs.gather(1, parent_front.unsqueeze(2).expand(b, k, i))
        return self._select(root, torch.cat(ent_tok, 1), torch.cat(ent_score, 1), torch.cat(ent_parent, 1))

    def _select(self, root: torch.Tensor, tok: torch.Tensor, score: torch.Tensor, parent: torch.Tensor
                ) -> DraftTree:
        dev, b, n_nodes = self.device, root.shape[0], self.num_draft_tokens
        order = torch.sort(-score, dim=1, stable=True).indices[:, : n_nodes - 1]
        chosen = order.sort(dim=1).values                                   # parents before children
        entry_node = torch.full_like(score, -1, dtype=torch.int64)
        entry_node.scatter_(1, chosen, torch.arange(1, n_nodes, device=dev).expand(b, n_nodes - 1))
        par_entry = parent.gather(1, chosen)
        # Every kept node's parent is kept (propose's stable sorts never keep a child
        # without its parent), so each lookup below finds a node.
        par_node = torch.where(par_entry < 0, 0, entry_node.gather(1, par_entry.clamp(min=0)))
        tokens = torch.cat([root.unsqueeze(1), tok.gather(1, chosen)], dim=1)
        parents = torch.cat([torch.full((b, 1), -1, dtype=torch.int64, device=dev), par_node], dim=1)
        depths = torch.zeros(b, n_nodes, dtype=torch.int64, device=dev)
        masks = torch.zeros(b, n_nodes, n_nodes, dtype=torch.bool, device=dev)
        masks[:, 0, 0] = True
        ar = torch.arange(b, device=dev)
        for j in range(1, n_nodes):
            p = parents[:, j]
            depths[:, j] = depths[ar, p] + 1
            masks[:, j] = masks[ar, p]
            masks[:, j, j] = True
        return DraftTree(tokens, parents, depths, masks)

    # ---- verification -------------------------------------------------------------
    def verify_input(self, reqs: list[Req], tree: DraftTree) -> ForwardInput:
        nodes = self.num_draft_tokens
        fwd = ForwardInput.upload(tree.tokens.reshape(-1), [r.row for r in reqs], [r.kv_len for r in reqs],
                                  [nodes] * len(reqs), None, self.device, extra_masks=tree.masks)
        fwd.positions = (fwd.layout.prefix_lens.unsqueeze(1) + tree.depths).reshape(-1)
        return fwd

    @staticmethod
    def accept_path(tree_tokens: list[int], tree_parents: list[int], drawn: list[int]) -> list[int]:
        """Nodes whose draws are emitted, from the root: descend while the token drawn
        at the current node is one of its children. The last node's draw is the
        bonus token; every other draw equals the next node's token."""
        children: dict[tuple[int, int], int] = {}
        for node in range(1, len(tree_tokens)):
            children.setdefault((tree_parents[node], tree_tokens[node]), node)
        path = [0]
        while (path[-1], drawn[path[-1]]) in children:
            path.append(children[(path[-1], drawn[path[-1]])])
        return path
