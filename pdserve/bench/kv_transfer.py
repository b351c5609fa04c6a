"""KV transfer throughput: the Mooncake engine through pdserve's transfer plan vs a raw
loopback TCP socket moving the same bytes, between two processes.

    python -m pdserve.bench.kv_transfer --tokens 4096 16384 --ttft-tokens 512 2000

Part 2, TTFT split: a prefill and a decode scheduler (each with its own Mooncake
engine over loopback TCP, in one process) serve one long prompt at a time; the
time to the first token on decode is split into prefill (room setup + compute,
KV of chunk i written while chunk i+1 computes), the transfer tail (the writes
still running when the first token is drawn, plus the handoff record) and decode
commit (admitting the request with its first token); the colocated scheduler's
TTFT on the same prompt is the reference.

For each model shape and prompt length, the receiver registers a per-layer K/V layout
like a decode server's; the sender writes the prompt's KV (a) as contiguous slots (one
coalesced entry per buffer), (b) as scattered slots (page size 1, shuffled: one entry
per token per buffer, batches capped at 1024), and the raw socket sends the same bytes
from one contiguous buffer.  Each figure is the best of --repeats runs.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.disagg.layout import BufferSpec, KVLayout, plan_transfer


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int

    def buffers(self, slots: int) -> dict[str, torch.Tensor]:
        return {f"target.L{i}.{kind}": torch.zeros(slots, self.kv_heads, self.head_dim)
                for i in range(self.layers) for kind in ("K", "V")}


SHAPES = {"demo": Shape("demo (4 layers, 4x32 KV)", 4, 4, 32),
          "wide": Shape("wide (16 layers, 8x128 KV)", 16, 8, 128)}


def layout_of(bufs: dict[str, torch.Tensor]) -> KVLayout:
    return KVLayout(1, tuple(BufferSpec(n, t.data_ptr(), t.shape[0], t[0].numel() * t.element_size())
                             for n, t in bufs.items()))


def _receiver(shape: Shape, slots: int, conn) -> None:
    from pdserve.disagg.transfer import MooncakeTransfer

    engine = MooncakeTransfer("127.0.0.1")
    bufs = shape.buffers(slots)
    for t in bufs.values():
        engine.register(t.data_ptr(), t.numel() * t.element_size())
    server = socket.create_server(("127.0.0.1", 0))
    conn.send((engine.session_id, layout_of(bufs), server.getsockname()[1]))
    sink = bytearray(sum(t.numel() * t.element_size() for t in bufs.values()))
    view = memoryview(sink)
    while True:
        cmd = conn.recv()
        if cmd is None:
            break
        peer, _ = server.accept()
        with peer:
            got = 0
            while got < cmd:
                n = peer.recv_into(view[got:cmd])
                if n == 0:
                    break
                got += n
            peer.sendall(b"k")
        conn.send(got)
    engine.close()


def measure(shape: Shape, tokens: int, repeats: int) -> dict[str, float]:
    from pdserve.disagg.transfer import MooncakeTransfer

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(shape, tokens, child), daemon=True)
    proc.start()
    session, dst_layout, port = parent.recv()
    engine = MooncakeTransfer("127.0.0.1")
    bufs = shape.buffers(tokens)
    for t in bufs.values():
        t.normal_()
        engine.register(t.data_ptr(), t.numel() * t.element_size())
    plan = plan_transfer(layout_of(bufs), dst_layout, list(bufs))
    nbytes = sum(t.numel() * t.element_size() for t in bufs.values())
    contiguous = plan.writes(list(range(tokens)), list(range(tokens)))
    shuffled = list(range(tokens))
    random.Random(0).shuffle(shuffled)
    scattered = plan.writes(list(range(tokens)), shuffled)
    src = torch.cat([t.flatten() for t in bufs.values()]).numpy().tobytes()
    out: dict[str, float] = {"bytes": nbytes, "entries_contiguous": len(contiguous.src),
                             "entries_scattered": len(scattered.src)}
    for name, batch in (("mooncake_contiguous", contiguous), ("mooncake_scattered", scattered)):
        engine.write(session, batch)  # first write to a peer includes its handshake
        best = min(_timed(lambda: engine.write(session, batch)) for _ in range(repeats))
        out[name] = nbytes / best / 1e9

    def raw() -> None:
        parent.send(nbytes)
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(src)
            s.recv(1)
        assert parent.recv() == nbytes
    out["raw_tcp"] = nbytes / min(_timed(raw) for _ in range(repeats)) / 1e9
    parent.send(None)
    proc.join(30)
    engine.close()
    return out


def ttft_split(model_dir: str, tokens: int, repeats: int, chunk: int, page_size: int) -> dict[str, float]:
    """Median phase times (seconds) of ``repeats`` single-request handoffs."""
    import statistics

    from pdserve.config import ServerArgs
    from pdserve.disagg.rooms import RoomState
    from pdserve.disagg.transfer import MooncakeTransfer
    from pdserve.model.parallel import TPGroup
    from pdserve.model.runner import ModelRunner
    from pdserve.requests import RequestBuilder
    from pdserve.sampling_params import SamplingParams
    from pdserve.disagg.decode_side import decode_scheduler
    from pdserve.disagg.handoff import Phase
    from pdserve.disagg.prefill_side import prefill_scheduler
    from pdserve.scheduler.req import samples_from_message
    from pdserve.scheduler.scheduler import Scheduler

    args = ServerArgs(model_path=model_dir, chunked_prefill_size=chunk, page_size=page_size,
                      max_total_tokens=4 * tokens + 4096, disable_radix_cache=True)

    def runner() -> ModelRunner:
        return ModelRunner(args, Path(model_dir), TPGroup())
    text = str
    colo = Scheduler(args, runner(), text)  # type: ignore[arg-type]
    p = prefill_scheduler(args, runner(), text, MooncakeTransfer("127.0.0.1"))  # type: ignore[arg-type]
    d = decode_scheduler(args, runner(), text, MooncakeTransfer("127.0.0.1"),  # type: ignore[arg-type]
                        fetch_ranks=lambda url: [p.mode.manager.rank_info(1, "127.0.0.1")])
    builder = RequestBuilder(None, 10**6, 10**6, 1, 0)
    params = SamplingParams.from_dict({"max_new_tokens": 2, "temperature": 0, "ignore_eos": True})
    rng = random.Random(tokens)
    vocab = colo.vocab_size
    phases: dict[str, list[float]] = {k: [] for k in ("colocated", "prefill", "transfer", "commit", "total")}
    try:
        for i in range(repeats + 1):  # the first round connects the pair and warms up
            prompt = [rng.randrange(3, vocab) for _ in range(tokens)]
            c = samples_from_message(builder.group(prompt, params, False, 0))[0]
            t0 = time.perf_counter()
            colo.add(c)
            while not c.output_ids:
                colo.step()
            colocated = time.perf_counter() - t0
            while colo.has_work:
                colo.step()
            rp, rd = (samples_from_message(builder.group(prompt, params, False, 0))[0] for _ in range(2))
            for r in (rp, rd):
                r.bootstrap_host, r.bootstrap_port, r.bootstrap_room = "127.0.0.1", 1, 1000 + i
            t0 = time.perf_counter()
            p.add(rp)
            d.add(rd)
            while not p.mode.handoffs.count(Phase.INFLIGHT):
                p.step()
                d.step()  # decode connects, reserves and asks for the KV
            t_handoff = time.perf_counter()
            while d.mode.manager.poll(1000 + i)[0] is not RoomState.SUCCESS:
                time.sleep(0.0002)
            t_arrived = time.perf_counter()
            while not rd.output_ids:
                d.step()
            t_first = time.perf_counter()
            while p.has_work or d.has_work:
                p.step()
                d.step()
            if i == 0:
                continue
            phases["colocated"].append(colocated)
            phases["prefill"].append(t_handoff - t0)
            phases["transfer"].append(t_arrived - t_handoff)
            phases["commit"].append(t_first - t_arrived)
            phases["total"].append(t_first - t0)
    finally:
        p.close()
        d.close()
    out = {k: statistics.median(v) for k, v in phases.items()}
    out["bytes"] = p.mode.manager.bytes_sent / (repeats + 1)
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--shapes", nargs="+", default=["demo", "wide"], choices=sorted(SHAPES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-bytes", type=float, default=2.5e9, help="skip combinations larger than this")
    ap.add_argument("--ttft-tokens", type=int, nargs="*", default=[512, 2000],
                    help="prompt lengths of the TTFT split (none: skip it)")
    ap.add_argument("--ttft-model", default=None, help="model of the TTFT split (default: the demo model)")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk size of the TTFT split")
    ap.add_argument("--page-size", type=int, default=16, help="page size of the TTFT split")
    args = ap.parse_args(argv)
    print("| model | tokens | MiB | Mooncake contiguous GB/s (entries) | Mooncake scattered GB/s (entries) "
          "| raw TCP GB/s | Mooncake / raw |")
    print("|---|---|---|---|---|---|---|")
    for key in args.shapes:
        shape = SHAPES[key]
        for tokens in args.tokens:
            per_token = shape.layers * 2 * shape.kv_heads * shape.head_dim * 4
            if per_token * tokens > args.max_bytes:
                continue
            r = measure(shape, tokens, args.repeats)
            print(f"| {shape.name} | {tokens} | {r['bytes'] / 2**20:.0f} | {r['mooncake_contiguous']:.2f} "
                  f"({int(r['entries_contiguous'])}) | {r['mooncake_scattered']:.2f} ({int(r['entries_scattered'])}) "
                  f"| {r['raw_tcp']:.2f} | {r['mooncake_contiguous'] / r['raw_tcp']:.2f}x |", flush=True)
    if not args.ttft_tokens:
        return
    from pdserve import assets

    model = args.ttft_model or str(assets.path("demo"))
    print(f"\nTTFT split, {model}, chunk {args.chunk}, page size {args.page_size}, median of {args.repeats} "
          "(ms)\n")
    print("| prompt tokens | KV MiB | colocated TTFT | PD TTFT | prefill (setup + compute) | transfer tail "
          "| decode commit | PD / colocated |")
    print("|---|---|---|---|---|---|---|---|")
    for tokens in args.ttft_tokens:
        r = ttft_split(model, tokens, args.repeats, args.chunk, args.page_size)
        ms = {k: v * 1e3 for k, v in r.items() if k != "bytes"}
        print(f"| {tokens} | {r['bytes'] / 2**20:.1f} | {ms['colocated']:.1f} | {ms['total']:.1f} | "
              f"{ms['prefill']:.1f} | {ms['transfer']:.1f} | {ms['commit']:.1f} | "
              f"{r['total'] / r['colocated']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
