"""The batched accept walk (tensor ops, no host read) against the per-request walk it
replaces, on random trees and draws: the same paths, node for node."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.speculative.decoding import accept_on_device
from pdserve.speculative.eagle_worker import EagleWorker

pytestmark = pytest.mark.fast


def random_tree(rng: random.Random, nodes: int, vocab: int) -> tuple[list[int], list[int], list[int]]:
    """Tokens, parents and depths of a tree whose nodes come after their parents (as
    _select orders them); siblings may repeat a token (the walk takes the first)."""
    tokens, parents, depths = [rng.randrange(vocab)], [-1], [0]
    for _ in range(1, nodes):
        p = rng.randrange(len(tokens))
        tokens.append(rng.randrange(vocab))
        parents.append(p)
        depths.append(depths[p] + 1)
    return tokens, parents, depths


def test_accept_on_device_walks_the_per_request_paths():
    rng = random.Random(0)
    for nodes, vocab in [(2, 2), (4, 3), (8, 3), (12, 5), (16, 2)]:
        trees = [random_tree(rng, nodes, vocab) for _ in range(64)]
        # Draws that often follow the tree (so paths get long) and sometimes leave it.
        drawn = [[rng.choice([t for t, p in zip(tok, par) if p == j] or [rng.randrange(vocab)])
                  if rng.random() < 0.8 else rng.randrange(vocab) for j in range(nodes)] for tok, par, _ in trees]
        tokens, parents, depths = (torch.tensor([t[i] for t in trees]) for i in range(3))
        max_depth = int(depths.max())
        path, lengths = accept_on_device(tokens, parents, depths, torch.tensor(drawn), max_depth)
        for b, (tok, par, _) in enumerate(trees):
            want = EagleWorker.accept_path(tok, par, drawn[b])
            assert lengths[b].item() == len(want)
            assert path[b, : len(want)].tolist() == want
            assert (path[b, len(want):] == want[-1]).all()  # the last node repeated past the end
