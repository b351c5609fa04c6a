"""Where an EAGLE draft layer runs under tensor parallelism: replicated on every rank
(pdserve's choice) or sharded like the target (SGLang's), measured.

    python -m pdserve.bench.draft_placement --tp 2 --shape demo --shape llama8b

One process per rank (gloo on CPU, NCCL on CUDA). Each times the dense part of one
draft decoder layer (q/k/v and output projections, gate/up and down: what a draft step
runs per token besides attention, whose work splits by heads either way) for a few
token counts (a decode batch times the draft's top-k): replicated, every rank runs the
whole layer with no collective; sharded, each runs 1/tp of it plus the two all-reduces
the row-parallel projections need. Rank 0 prints the median milliseconds per forward.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int


SHAPES = {
    "demo": Shape(256, 512, 8, 4, 32),                 # the embedded demo model's heads
    "llama8b": Shape(4096, 14336, 32, 8, 128),         # an EAGLE/EAGLE3 head of Llama-3.1-8B
}


def _dense_layer(shape: Shape, tp: object, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from pdserve.model.layers import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    class Dense(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            s = shape
            self.qkv = QKVParallelLinear(s.hidden, s.head_dim, s.heads, s.kv_heads, False, tp)  # type: ignore[arg-type]
            self.o_proj = RowParallelLinear(s.heads * s.head_dim, s.hidden, False, tp, "o_proj")  # type: ignore
            self.gate_up = ColumnParallelLinear(s.hidden, {0: s.intermediate, 1: s.intermediate}, False, tp,  # type: ignore
                                                "gate_up_proj")
            self.down = RowParallelLinear(s.intermediate, s.hidden, False, tp, "down_proj")  # type: ignore

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = self.qkv(x)[:, : self.qkv.split_sizes[0]]
            x = x + self.o_proj(q)  # (attention itself omitted: it splits by heads either way)
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return x + self.down(torch.nn.functional.silu(gate) * up)

    layer = Dense().to(device, dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
    return layer


def _time(layer: torch.nn.Module, tokens: int, hidden: int, iters: int, tp: object, dtype: torch.dtype,
          device: torch.device) -> float:
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    samples = []
    with torch.inference_mode():
        for i in range(iters + 3):
            tp.all_reduce(torch.zeros(1, device=device))  # type: ignore[attr-defined]  # start together
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            layer(x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 3:
                samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _rank(rank: int, size: int, init: str, args: argparse.Namespace) -> None:
    from pdserve.model.parallel import TPGroup, bind_device, init_tp_group

    device = bind_device(rank, torch.device(args.device))
    tp = init_tp_group(rank, size, init, device)
    torch.set_num_threads(max(1, args.threads))
    dtype = getattr(torch, args.dtype)
    rows = []
    for name in args.shape:
        shape = SHAPES[name]
        replicated = _dense_layer(shape, TPGroup(), dtype, device)
        sharded = _dense_layer(shape, tp, dtype, device)
        for tokens in args.tokens:
            r = _time(replicated, tokens, shape.hidden, args.iters, tp, dtype, device)
            s = _time(sharded, tokens, shape.hidden, args.iters, tp, dtype, device)
            rows.append((name, tokens, r, s))
    if rank == 0:
        print(f"draft layer (dense part) per forward, TP{size}, {args.device}, {args.dtype}, "
              f"{args.threads} thread(s) per rank, median of {args.iters}")
        print(f"{'shape':>8} {'tokens':>6} {'replicated ms':>14} {'sharded ms':>11} {'sharded/replicated':>19}")
        for name, tokens, r, s in rows:
            print(f"{name:>8} {tokens:>6} {r:>14.3f} {s:>11.3f} {s / r:>19.2f}")
    torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES), help="repeatable (default: demo)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[4, 32, 128])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    args.shape = args.shape or ["demo"]
    from pdserve.scheduler.worker import free_tcp_port

    init = f"tcp://127.0.0.1:{free_tcp_port()}"
    mp.spawn(_rank, args=(args.tp, init, args), nprocs=args.tp, join=True)


if __name__ == "__main__":
    main()
