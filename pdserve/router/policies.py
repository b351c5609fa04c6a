"""Which worker of a role gets the next request.

A policy sees only the healthy candidates and the router's own view of their load
(`in_flight`: requests the router has sent and not yet seen answered), never the
workers themselves: picking must be cheap and must not wait on the network.

Policies are chosen by name from `POLICY_CLASSES` (the registry at the end of this
module): the router's --policy / --prefill-policy / --decode-policy choices and their
validation come from it, and `make_policy` builds one. Each class declares what it
needs: `needs_key` (the router extracts the request's text or token ids only when a
policy in use routes on them) and `from_options` (which of the router's policy options,
`PolicyOptions`, it takes). Adding a policy is one class here and one entry in
`POLICY_CLASSES`.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import ClassVar, Protocol, Sequence

from pdserve.router.prefix_tree import PrefixTree, Seq


class Candidate(Protocol):
    url: str
    in_flight: int


@dataclass(frozen=True)
class PolicyOptions:
    """The router's policy options (its flags); each policy class takes what it needs."""
    threshold: float = 0.5              # --cache-threshold
    balance_abs_threshold: int = 32     # --balance-abs-threshold
    max_tree_size: int = 1 << 22        # --max-tree-size
    rng: random.Random | None = None    # tests inject a seeded one


class Policy(Protocol):
    name: str
    needs_key: bool  # whether `pick` routes on the request's text or token ids

    def pick(self, candidates: Sequence[Candidate], key: Seq | None = None) -> Candidate:
        """`candidates` is non-empty; `key` is the request's text or token ids (or None)."""
        ...

    def remove_worker(self, url: str) -> None:
        """Forget what the policy holds about a worker that left the router."""
        ...


class _Stateless:
    """A policy that keeps nothing per worker: removing one changes nothing. It does not
    look at the request, and takes no options but the random source."""

    needs_key: ClassVar[bool] = False

    @classmethod
    def from_options(cls, opts: PolicyOptions) -> Policy:
        return cls()  # type: ignore[return-value]

    def remove_worker(self, url: str) -> None:
        return None


class RoundRobin(_Stateless):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: Sequence[Candidate], key: Seq | None = None) -> Candidate:
        return candidates[next(self._counter) % len(candidates)]


class RandomPolicy(_Stateless):
    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    @classmethod
    def from_options(cls, opts: PolicyOptions) -> Policy:
        return cls(opts.rng)

    def pick(self, candidates: Sequence[Candidate], key: Seq | None = None) -> Candidate:
        return self._rng.choice(candidates)


class PowerOfTwo(_Stateless):
    """The less loaded of two distinct random candidates: near least-loaded balance
    without every router decision herding onto the same momentarily idle worker."""
    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    @classmethod
    def from_options(cls, opts: PolicyOptions) -> Policy:
        return cls(opts.rng)

    def pick(self, candidates: Sequence[Candidate], key: Seq | None = None) -> Candidate:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(list(candidates), 2)
        return b if b.in_flight < a.in_flight else a


class CacheAware:
    """Prefix affinity: send a request to the worker that has seen the longest prefix of
    it (its radix cache likely still holds that KV) when that prefix covers more than
    `threshold` of the request; otherwise to the least loaded worker. Load guard:
    affinity never sends a request to a worker with more than `balance_abs_threshold`
    requests in flight above the least loaded one.

    Each instance owns its tree, so a PD router's prefill and decode policies choose
    independently. On prefill it aims at the prompt KV prefill computed before; on
    decode at the KV a decode server keeps of finished requests (prompt and output), so
    a conversation's next turn, whose prompt extends the last one's, goes back to the
    decode server that holds it and is sent only the pages it lacks."""
    name = "cache_aware"
    needs_key: ClassVar[bool] = True

    def __init__(self, threshold: float = 0.5, balance_abs_threshold: int = 32,
                 max_tree_size: int = 1 << 22) -> None:
        self.threshold = threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.tree = PrefixTree(max_tree_size)
        self._new_prefixes: dict[str, int] = {}  # worker -> prefixes it got without affinity

    @classmethod
    def from_options(cls, opts: PolicyOptions) -> Policy:
        return cls(opts.threshold, opts.balance_abs_threshold, opts.max_tree_size)

    def pick(self, candidates: Sequence[Candidate], key: Seq | None = None) -> Candidate:
        least = self._least_loaded(candidates)
        if not key:
            return least
        matched = self.tree.match(key)
        best = max(candidates, key=lambda c: (matched.get(c.url, 0), -c.in_flight))
        share = matched.get(best.url, 0) / len(key)
        chosen = best if share > self.threshold else least
        if chosen.in_flight - least.in_flight > self.balance_abs_threshold:
            chosen = least
        if chosen is least and share <= self.threshold:
            self._new_prefixes[chosen.url] = self._new_prefixes.get(chosen.url, 0) + 1
        self.tree.insert(key, chosen.url)
        return chosen

    def remove_worker(self, url: str) -> None:
        """A removed worker's prefixes would otherwise keep attracting (and, were its URL
        added again for a fresh server, mislead) affinity, and hold tree space."""
        self.tree.remove_worker(url)
        self._new_prefixes.pop(url, None)

    def _least_loaded(self, candidates: Sequence[Candidate]) -> Candidate:
        """Fewest in flight; among those, the one that has been given the fewest new
        prefixes, so that distinct prefixes (and the cache they fill) spread out."""
        return min(candidates, key=lambda c: (c.in_flight, self._new_prefixes.get(c.url, 0)))


# ---- the registry -------------------------------------------------------------------------
# name -> class. A new policy: its class above (name, needs_key, from_options, pick,
# remove_worker) and one line here.
POLICY_CLASSES: dict[str, type] = {cls.name: cls for cls in (
    RoundRobin,
    RandomPolicy,
    PowerOfTwo,
    CacheAware,
)}
POLICY_NAMES: tuple[str, ...] = tuple(POLICY_CLASSES)  # the flags' choices, in this order


def policy_class(name: str) -> type:
    """The class registered as `name`; ValueError listing the known names otherwise."""
    try:
        return POLICY_CLASSES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICY_CLASSES)})") from None


def make_policy(name: str, *, threshold: float = 0.5, balance_abs_threshold: int = 32,
                max_tree_size: int = 1 << 22, rng: random.Random | None = None) -> Policy:
    """A fresh policy `name`, given the options it declares it takes (`from_options`)."""
    opts = PolicyOptions(threshold, balance_abs_threshold, max_tree_size, rng)
    return policy_class(name).from_options(opts)
