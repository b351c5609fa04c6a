"""How many KV pages a scheduler rank gets: ``--max-total-tokens`` when given, else
the share of the device ``--mem-fraction-static`` allows (the CPU: a flag's budget),
with every TP rank agreeing on the smallest. Kept apart from ``KVManager``, which
is built from the resulting geometry and never asks the device."""

from __future__ import annotations

import logging

import torch

from pdserve.config import ServerArgs
from pdserve.model.parallel import TPGroup
from pdserve.model.runner import ModelRunner
from pdserve.scheduler.memory import TokenToKVPool

logger = logging.getLogger(__name__)


class MemoryBudgetError(ValueError):
    """The device memory a server may hold cannot hold its KV pool."""


# Below this much device memory left free beside the static pools, activations and
# CUDA graphs are likely to run out: said in the log, not refused.
MIN_HEADROOM_BYTES = 1 << 30


def device_kv_budget(free: int, total: int, held: int, fraction: float, cached: int = 0) -> int:
    """Bytes for the KV pools of a server on a device of ``total`` bytes, ``free`` of
    them free now, ``held`` already taken by this process (weights, buffers), ``cached``
    reserved by this process's caching allocator but unallocated (tensors freed since, a
    shut-down engine's pools): the driver counts those as used, yet this process can
    allocate them, so they count as free.

    ``--mem-fraction-static`` is the share of the whole device the server's static
    memory (weights + KV pools) may take, as in SGLang, so servers sharing one GPU
    (a prefill and a decode server, 0.4 each) get what they ask whichever starts
    first. Refused when the share is smaller than the weights or larger than what is
    free now (another process holds the rest)."""
    gib = 2 ** 30
    free += cached
    budget = int(total * fraction) - held
    if budget <= 0:
        raise MemoryBudgetError(
            f"--mem-fraction-static {fraction} allows {total * fraction / gib:.2f} GiB of the device's "
            f"{total / gib:.2f} GiB, but the weights and buffers already take {held / gib:.2f} GiB: no room "
            "for the KV cache; raise --mem-fraction-static")
    if budget > free:
        raise MemoryBudgetError(
            f"--mem-fraction-static {fraction} asks for {budget / gib:.2f} GiB of KV cache but only "
            f"{free / gib:.2f} GiB of the device's {total / gib:.2f} GiB are free (another process holds "
            f"{(total - free - held) / gib:.2f} GiB); lower --mem-fraction-static (servers sharing a GPU: "
            "fractions that add up to at most about 0.9)")
    if free - budget < MIN_HEADROOM_BYTES:
        logger.warning("--mem-fraction-static %.3f leaves %.2f GiB of device memory for activations and CUDA "
                       "graphs", fraction, (free - budget) / gib)
    return budget


def cached_bytes(device: torch.device) -> int:
    """Memory of a CUDA device this process's caching allocator holds reserved but
    unallocated: busy to the driver (``mem_get_info``), free to this process."""
    return torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def device_free_bytes(device: torch.device) -> int | None:
    """Memory of a CUDA device this process can allocate now, the allocator's unused
    reservations included (None for the CPU, whose budget is a flag)."""
    return torch.cuda.mem_get_info(device)[0] + cached_bytes(device) if device.type == "cuda" else None


def size_kv_pages(args: ServerArgs, runner: ModelRunner, tp: TPGroup, slot_followers_bytes: int = 0) -> int:
    """Pages of the KV pool, the padding page included (every TP rank gets the same).
    ``slot_followers_bytes``: what every slot also costs in pools indexed like it (a
    draft's KV and target features), so the memory budget covers them too."""
    cfg = runner.config
    per_token = TokenToKVPool.bytes_per_token(cfg.num_layers, runner.num_local_kv_heads, cfg.head_dim,
                                              runner.kv_dtype) + slot_followers_bytes
    if args.max_total_tokens is not None:
        tokens = args.max_total_tokens
    else:
        if runner.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(runner.device)
            budget = device_kv_budget(free, total, torch.cuda.memory_allocated(runner.device),
                                      args.mem_fraction_static, cached_bytes(runner.device))
        else:
            budget = args.cpu_kv_budget_gb * (1 << 30) * args.mem_fraction_static
        # No point holding more than every request slot filled to the context.
        tokens = min(int(budget // per_token), args.max_running_requests * runner.context_len)
    pages = tokens // args.page_size
    if tp.enabled:  # ranks must agree on the pool size: the smallest fits every rank
        pages = int(tp.all_reduce_min(torch.tensor([pages]))[0])
    # (debug: the server's startup summary line says it, pdserve/server/startup_summary.py)
    logger.debug("KV pool: %d pages x %d tokens (%.1f MiB)", pages, args.page_size,
                pages * args.page_size * per_token / 2**20)
    return pages + 1  # + the padding page


