"""Tensor-parallel group: the only place that calls torch.distributed collectives."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in the TP group. Collectives on device tensors (activations,
    sampled ids) go through ``device_group`` (NCCL on CUDA); those on host values
    (pickled commands, host tensors such as the KV pool size or the PD readiness
    codes) through ``host_group`` (gloo), chosen by the tensor's device. None is the
    default (world) group: on CPU one gloo group serves both. ``TPGroup()`` is TP 1."""

    rank: int = 0
    size: int = 1
    device_group: Any = field(default=None, compare=False, repr=False)
    host_group: Any = field(default=None, compare=False, repr=False)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def group_for(self, x: torch.Tensor) -> Any:
        return self.host_group if x.device.type == "cpu" else self.device_group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(x, group=self.group_for(x))
        return x

    def all_reduce_min(self, x: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.group_for(x))
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group_for(x))
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.enabled:  # every group spans all ranks: group rank == global rank
            dist.broadcast(x, src=src, group=self.group_for(x))
        return x

    def barrier(self) -> None:
        """Every rank, on every node, got here (a host collective: gloo on any device)."""
        if self.enabled:
            self.all_reduce(torch.zeros(1))

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        if not self.enabled:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, group=self.host_group)  # pickled on the host
        return box[0]


class TPDisagreement(RuntimeError):
    """TP ranks computed different values where they must agree (``assert_agree``)."""


def assert_agree(tp: TPGroup, x: torch.Tensor, what: str) -> None:
    """Raise TPDisagreement on every rank unless ``x`` is the same on all of them: the
    ranks share no state but their commands, so whatever decides a request's next tokens
    (a draft tree, the accepted path) must come out bit-identical on each. One host
    all-gather (``--debug-tp-agreement``: a bring-up and test check, not a hot-path one)."""
    if not tp.enabled:
        return
    host = x.detach().to("cpu", torch.float64).reshape(-1)  # token ids are exact in float64
    parts = [torch.empty_like(host) for _ in range(tp.size)]
    dist.all_gather(parts, host, group=tp.host_group)
    differ = [r for r, part in enumerate(parts) if not torch.equal(part, parts[0])]
    if differ:
        raise TPDisagreement(f"TP ranks disagree on {what}: rank(s) {differ} differ from rank 0 "
                             f"(this is rank {tp.rank})")


def bind_device(rank: int, device: torch.device) -> torch.device:
    """The device rank ``rank`` builds on. On CUDA it becomes the current device (GPU
    ``index + rank``) before anything is allocated: a plain "cuda" then means this
    rank's GPU everywhere (the model, the KV pool, NCCL, mem_get_info)."""
    if device.type != "cuda":
        return device
    index = (device.index or 0) + rank
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def init_tp_group(rank: int, size: int, init_method: str, device: torch.device,
                  timeout_s: float = 300.0) -> TPGroup:
    """Join the TP group (call `bind_device` first) at ``init_method`` (tcp://HOST:PORT;
    rank 0 listens there). The rendezvous (every rank, on every node, joining) gives up
    after ``timeout_s`` with an error naming the address; the collectives afterwards keep
    torch's own deadline (an idle follower waits in one). On CUDA the world group is NCCL
    and a gloo group next to it carries the host-side collectives; on CPU gloo does both."""
    if size == 1:
        return TPGroup(rank=rank, size=size)
    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    host = host.strip("[]")
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        # Our own store rather than init_method=: its timeout bounds the rendezvous alone
        # (rank 0 waits for every rank to connect; the others for their peers' addresses).
        store = dist.TCPStore(host, int(port), size, is_master=rank == 0, timeout=timedelta(seconds=timeout_s))
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=size)
    except (RuntimeError, OSError) as exc:  # torch's DistError subclasses RuntimeError
        raise RuntimeError(f"TP rank {rank}: the TP group of {size} ranks did not meet at {init_method} "
                           f"within {timeout_s:g} s (is every node started, with the same --dist-init-addr, "
                           f"--nnodes and --tp-size?): {str(exc).splitlines()[0]}") from None
    if device.type == "cuda":
        return TPGroup(rank=rank, size=size, host_group=dist.new_group(backend="gloo"))
    return TPGroup(rank=rank, size=size)


def shard_range(total: int, rank: int, size: int, what: str) -> tuple[int, int]:
    if total % size:
        raise ValueError(f"{what} ({total}) is not divisible by --tp-size {size}")
    per = total // size
    return rank * per, (rank + 1) * per
