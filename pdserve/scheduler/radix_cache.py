"""Prefix caches: a radix tree over token ids (page granular) and the no-op chunk cache.

Tree nodes hold one reference on the KV pages under their key. Requests that
match a prefix take their own references and lock the matched path, so that a
locked node is never counted as evictable (evicting it would free nothing).
Eviction removes unlocked leaves, least recently used first.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import torch

from pdserve.scheduler.memory import PageAllocator

_clock = itertools.count()


@dataclass(eq=False)
class RadixNode:
    key: tuple[int, ...] = ()
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    parent: "RadixNode | None" = None
    children: dict[tuple[int, ...], "RadixNode"] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0

    def touch(self) -> None:
        self.last_access = next(_clock)


@dataclass
class PrefixMatch:
    slots: torch.Tensor   # KV slots of the matched prefix (page aligned length)
    node: RadixNode | None  # deepest matched node, to lock while in use


class RadixCache:
    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.reset()

    def reset(self) -> None:
        """Drop every cached prefix (releasing the tree's page references)."""
        if getattr(self, "root", None) is not None:
            for node in self._all_nodes():
                if node is not self.root:
                    self.allocator.release(self._pages(node.slots))
        self.root = RadixNode()
        self.root.lock_ref = 1
        self.evictable_tokens = 0
        self.protected_tokens = 0

    # ---- queries --------------------------------------------------------------
    def match_prefix(self, ids: list[int]) -> PrefixMatch:
        ps = self.page_size
        limit = len(ids) // ps * ps
        node, pos, parts = self.root, 0, []
        while pos < limit:
            child = node.children.get(tuple(ids[pos:pos + ps]))
            if child is None:
                break
            n = self._common_len(child.key, ids, pos, limit)
            if n < len(child.key):
                child = self._split(child, n)
            parts.append(child.slots)
            pos += n
            node = child
            node.touch()
            if n < len(child.key):
                break
        slots = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        return PrefixMatch(slots, node if node is not self.root else None)

    @property
    def evictable_pages(self) -> int:
        return self.evictable_tokens // self.page_size

    # ---- updates --------------------------------------------------------------
    def insert(self, ids: list[int], slots: torch.Tensor) -> int:
        """Cache KV `slots` for the page-aligned prefix of `ids`. Returns the number
        of tokens that were already cached."""
        ps = self.page_size
        limit = min(len(ids), slots.numel()) // ps * ps
        node, pos = self.root, 0
        while pos < limit:
            node.touch()
            child = node.children.get(tuple(ids[pos:pos + ps]))
            if child is None:
                new = RadixNode(key=tuple(ids[pos:limit]), slots=slots[pos:limit].clone(), parent=node)
                new.touch()
                node.children[new.key[:ps]] = new
                self.allocator.retain(self._pages(new.slots))
                self._account(new, +1)
                return pos
            n = self._common_len(child.key, ids, pos, limit)
            if n < len(child.key):
                child = self._split(child, n)
            pos += n
            node = child
        node.touch()
        return pos

    def lock(self, node: RadixNode | None) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                self.evictable_tokens -= len(node.key)
                self.protected_tokens += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode | None) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("radix node unlocked more often than locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_tokens += len(node.key)
                self.protected_tokens -= len(node.key)
            node = node.parent

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages if possible; returns pages released by the tree."""
        leaves = [(n.last_access, id(n), n) for n in self._all_nodes()
                  if n is not self.root and not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        released = 0
        while released < num_pages and leaves:
            _, _, node = heapq.heappop(leaves)
            self.allocator.release(self._pages(node.slots))
            released += len(node.key) // self.page_size
            self._account(node, -1)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[: self.page_size]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        return released

    # ---- internals ------------------------------------------------------------
    def _pages(self, slots: torch.Tensor) -> torch.Tensor:
        return slots[:: self.page_size] // self.page_size

    def _account(self, node: RadixNode, sign: int) -> None:
        if node.lock_ref == 0:
            self.evictable_tokens += sign * len(node.key)
        else:
            self.protected_tokens += sign * len(node.key)

    def _common_len(self, key: tuple[int, ...], ids: list[int], pos: int, limit: int) -> int:
        """Length of the common prefix of key and ids[pos:limit], in whole pages."""
        n = 0
        end = min(len(key), limit - pos)
        while n < end and key[n] == ids[pos + n]:
            n += 1
        return n // self.page_size * self.page_size

    def _split(self, child: RadixNode, n: int) -> RadixNode:
        """Split `child` so that its first `n` tokens become a new parent node."""
        ps = self.page_size
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        head = RadixNode(key=child.key[:n], slots=child.slots[:n], parent=parent,
                         lock_ref=child.lock_ref, last_access=child.last_access)
        parent.children[head.key[:ps]] = head
        child.key = child.key[n:]
        child.slots = child.slots[n:]
        child.parent = head
        head.children[child.key[:ps]] = child
        return head

    def _all_nodes(self) -> list[RadixNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out


class ChunkCache:
    """--disable-radix-cache: nothing is shared between requests."""

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.evictable_tokens = 0
        self.protected_tokens = 0

    def match_prefix(self, ids: list[int]) -> PrefixMatch:
        return PrefixMatch(torch.empty(0, dtype=torch.int64), None)

    @property
    def evictable_pages(self) -> int:
        return 0

    def insert(self, ids: list[int], slots: torch.Tensor) -> int:
        return 0

    def lock(self, node: RadixNode | None) -> None:
        pass

    def unlock(self, node: RadixNode | None) -> None:
        pass

    def evict(self, num_pages: int) -> int:
        return 0

    def reset(self) -> None:
        pass
