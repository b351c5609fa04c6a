"""A router-side radix tree of the prompts each worker has seen: an estimate of whose
prefix cache holds what, without asking the workers (as SGLang's cache-aware router).

Sequences are strings (request text) or tuples of token ids; one tree holds one kind
in practice, and the two never match each other. Each node is marked with the workers
whose requests passed through it and when (a logical clock); a worker marked on a node
is marked on all its ancestors, so its match length is the depth of the deepest marked
node on the request's path. The tree is bounded: past `max_size` elements the least
recently used leaves are dropped (for all workers at once: an approximation that keeps
eviction cheap).
"""

from __future__ import annotations

from typing import Sequence, Union

Seq = Union[str, tuple]


class _Node:
    __slots__ = ("label", "children", "workers", "parent")

    def __init__(self, label: Seq, parent: "_Node | None") -> None:
        self.label = label
        self.children: dict[object, _Node] = {}
        self.workers: dict[str, int] = {}  # worker -> logical time of its last request through here
        self.parent = parent


def _common(a: Seq, b: Seq, start: int) -> int:
    """Length of the common prefix of `a` and `b[start:]` (without slicing b)."""
    n = min(len(a), len(b) - start)
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


class PrefixTree:
    def __init__(self, max_size: int = 1 << 22) -> None:
        self.max_size = max_size
        self.size = 0  # elements stored in labels
        self._clock = 0
        self._root = _Node("", None)

    def insert(self, seq: Seq, worker: str) -> None:
        """Record that `worker` served a request starting with `seq`."""
        seq = _normalise(seq)
        self._clock += 1
        node, i = self._root, 0
        node.workers[worker] = self._clock
        while i < len(seq):
            child = node.children.get(seq[i])
            if child is None:
                leaf = _Node(seq[i:], node)
                leaf.workers[worker] = self._clock
                node.children[seq[i]] = leaf
                self.size += len(leaf.label)
                break
            k = _common(child.label, seq, i)
            if k < len(child.label):
                child = self._split(child, k)
            child.workers[worker] = self._clock
            node, i = child, i + k
        if self.size > self.max_size:
            self._evict()

    def match(self, seq: Seq) -> dict[str, int]:
        """worker -> length of the longest prefix of `seq` it is known to have seen."""
        seq = _normalise(seq)
        out: dict[str, int] = {}
        node, i = self._root, 0
        while i < len(seq):
            child = node.children.get(seq[i])
            if child is None:
                break
            k = _common(child.label, seq, i)
            for w in child.workers:
                out[w] = i + k
            if k < len(child.label):
                break
            node, i = child, i + k
        return out

    def remove_worker(self, worker: str) -> None:
        """Forget `worker` (it left the router): its marks go, and so do the nodes only it
        had marked (a node's marks include every mark below it, so such a node's whole
        subtree is unmarked and goes with it)."""
        stack = [self._root]
        self._root.workers.pop(worker, None)
        while stack:
            node = stack.pop()
            for key, child in list(node.children.items()):
                child.workers.pop(worker, None)
                if child.workers:
                    stack.append(child)
                else:
                    del node.children[key]
                    self.size -= _subtree_size(child)

    def _split(self, child: _Node, k: int) -> _Node:
        """Cut `child`'s edge after k elements; returns the new middle node."""
        parent = child.parent
        assert parent is not None
        mid = _Node(child.label[:k], parent)
        mid.workers = dict(child.workers)
        parent.children[mid.label[0]] = mid
        child.label = child.label[k:]
        child.parent = mid
        mid.children[child.label[0]] = child
        return mid

    def _evict(self) -> None:
        """Drop least recently used leaves until the tree is at 90% of its bound (batched
        so that eviction runs rarely, not on every insert past the bound)."""
        target = int(self.max_size * 0.9)
        while self.size > target:
            leaves = []
            stack = [self._root]
            while stack:
                n = stack.pop()
                if n.children:
                    stack.extend(n.children.values())
                elif n is not self._root:
                    leaves.append(n)
            if not leaves:
                return
            leaves.sort(key=lambda n: max(n.workers.values(), default=0))
            for leaf in leaves:
                if self.size <= target:
                    break
                assert leaf.parent is not None
                del leaf.parent.children[leaf.label[0]]
                self.size -= len(leaf.label)


def _subtree_size(node: _Node) -> int:
    total, stack = 0, [node]
    while stack:
        n = stack.pop()
        total += len(n.label)
        stack.extend(n.children.values())
    return total


def _normalise(seq: Sequence) -> Seq:
    return seq if isinstance(seq, (str, tuple)) else tuple(seq)
