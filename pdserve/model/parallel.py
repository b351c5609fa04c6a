"""Tensor-parallel group: the only place that calls torch.distributed collectives."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(x)
        return x

    def all_reduce_min(self, x: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(x, op=dist.ReduceOp.MIN)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.enabled:
            dist.broadcast(x, src=src)
        return x

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        if not self.enabled:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src)
        return box[0]


def init_tp_group(rank: int, size: int, init_method: str, device: torch.device) -> TPGroup:
    if size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=size)
    return TPGroup(rank=rank, size=size)


def shard_range(total: int, rank: int, size: int, what: str) -> tuple[int, int]:
    if total % size:
        raise ValueError(f"{what} ({total}) is not divisible by --tp-size {size}")
    per = total // size
    return rank * per, (rank + 1) * per
