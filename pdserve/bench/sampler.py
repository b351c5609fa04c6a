"""Time of the sampler per step: building its inputs from the requests, sampling, and
reading the ids back, against the implementation it replaced.

    python -m pdserve.bench.sampler --batch 64 --vocab 32000 --iters 20 --device cpu
    python -m pdserve.bench.sampler --device cuda          # 256 x 128256

Cases: greedy; temperature + top_p; temperature + top_k 50; temperature with
repetition / frequency / presence penalties. Every request starts with
``--prompt-len`` prompt and ``--output-len`` output tokens and each timed step
appends the drawn token (so incremental penalty state is measured in its steady
state). ``legacy`` below is a copy of the previous code, kept only as the
reference of this comparison.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from typing import Callable

import torch

from pdserve.model import device_io
from pdserve.model.sampler import Penalties, apply_penalties, sample
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.batch import Sampler
from pdserve.scheduler.req import Req


# ---- legacy: the sampler before the device rewrite (reference for this benchmark only) ----------
class legacy:  # noqa: N801 - a namespace
    MASK32 = 0xFFFFFFFF
    MULT = 0x45D9F3B

    @dataclass
    class SamplingInfo:
        temperatures: torch.Tensor
        top_ps: torch.Tensor
        top_ks: torch.Tensor
        min_ps: torch.Tensor
        seeds: torch.Tensor
        steps: torch.Tensor
        all_greedy: bool
        need_filter: bool
        penalties: Penalties | None = None
        banned: torch.Tensor | None = None

    @staticmethod
    def mix32(x: torch.Tensor) -> torch.Tensor:
        x = ((x >> 16) ^ x) * legacy.MULT & legacy.MASK32
        x = ((x >> 16) ^ x) * legacy.MULT & legacy.MASK32
        return (x >> 16) ^ x

    @staticmethod
    def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
        m = legacy.mix32
        token = torch.arange(vocab, device=seeds.device, dtype=torch.int64).unsqueeze(0)
        lo = (seeds & legacy.MASK32).unsqueeze(1)
        hi = ((seeds >> 32) & legacy.MASK32).unsqueeze(1)
        h = m(token ^ m(steps.unsqueeze(1) & legacy.MASK32))
        h = m(h ^ lo)
        h = m(h ^ hi ^ 0x9E3779B9)
        u = (h.double() + 0.5) / 4294967296.0
        return (-torch.log(-torch.log(u))).float()

    @staticmethod
    def filter_probs(probs: torch.Tensor, info: "legacy.SamplingInfo") -> torch.Tensor:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
        drop = rank >= info.top_ks.unsqueeze(1)
        cum_before = sorted_p.cumsum(-1) - sorted_p
        drop |= cum_before > info.top_ps.unsqueeze(1)
        drop |= sorted_p < info.min_ps.unsqueeze(1) * sorted_p[:, :1]
        drop[:, 0] = False
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        return torch.zeros_like(probs).scatter_(1, order, sorted_p)

    @staticmethod
    def sample(logits: torch.Tensor, info: "legacy.SamplingInfo") -> torch.Tensor:
        work = logits
        if info.penalties is not None:
            work = apply_penalties(work, info.penalties)
        if info.banned is not None:
            work = work.masked_fill(info.banned, float("-inf"))
        greedy_ids = work.argmax(dim=-1)
        if info.all_greedy:
            return greedy_ids
        temps = info.temperatures.clamp(min=1e-5).unsqueeze(1)
        probs = torch.softmax(work / temps, dim=-1)
        if info.need_filter:
            probs = legacy.filter_probs(probs, info)
        scores = torch.log(probs) + legacy.gumbel_noise(info.seeds, info.steps, probs.shape[-1])
        return torch.where(info.temperatures == 0, greedy_ids, scores.argmax(dim=-1))

    @staticmethod
    def build_sampling_info(reqs: list[Req], vocab_size: int, device: torch.device) -> "legacy.SamplingInfo":
        ps = [r.params for r in reqs]
        temps = torch.tensor([p.temperature for p in ps], dtype=torch.float32)
        all_greedy = bool((temps == 0).all()) or all(p.greedy for p in ps)
        top_ks = torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in ps], dtype=torch.int64)
        top_ps = torch.tensor([p.top_p for p in ps], dtype=torch.float32)
        min_ps = torch.tensor([p.min_p for p in ps], dtype=torch.float32)
        temps = torch.where(top_ks == 1, torch.zeros_like(temps), temps)
        need_filter = bool((top_ks < vocab_size).any() | (top_ps < 1).any() | (min_ps > 0).any())
        info = legacy.SamplingInfo(
            temperatures=temps.to(device), top_ps=top_ps.to(device), top_ks=top_ks.to(device),
            min_ps=min_ps.to(device),
            seeds=torch.tensor([r.seed for r in reqs], dtype=torch.int64, device=device),
            steps=torch.tensor([r.num_output_tokens for r in reqs], dtype=torch.int64, device=device),
            all_greedy=all_greedy, need_filter=need_filter)
        if any(p.needs_penalties for p in ps):
            info.penalties = legacy.penalties(reqs, vocab_size, device)
        return info

    @staticmethod
    def penalties(reqs: list[Req], vocab_size: int, device: torch.device) -> Penalties:
        n = len(reqs)
        counts = torch.zeros(n, vocab_size, dtype=torch.float32)
        seen = torch.zeros(n, vocab_size, dtype=torch.bool)
        for i, r in enumerate(reqs):
            if r.output_ids:
                out = torch.tensor(r.output_ids, dtype=torch.int64)
                counts[i].index_add_(0, out, torch.ones(len(out)))
            seen[i, torch.tensor(r.fill_ids, dtype=torch.int64)] = True

        def col(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

        return Penalties(repetition=col([r.params.repetition_penalty for r in reqs]),
                         frequency=col([r.params.frequency_penalty for r in reqs]),
                         presence=col([r.params.presence_penalty for r in reqs]),
                         output_counts=counts.to(device), seen=seen.to(device))


# ---- the benchmark -------------------------------------------------------------------------------
CASES: dict[str, dict] = {
    "greedy": {"temperature": 0.0},
    "temperature + top_p 0.95": {"temperature": 0.8, "top_p": 0.95},
    "temperature + top_k 50": {"temperature": 0.8, "top_k": 50},
    "penalties (rep/freq/pres)": {"temperature": 0.7, "repetition_penalty": 1.1, "frequency_penalty": 0.3,
                                  "presence_penalty": 0.2},
}


def make_reqs(params: dict, args: argparse.Namespace, rng: random.Random) -> list[Req]:
    p = SamplingParams(**params)
    reqs = []
    for i in range(args.batch):
        r = Req(rid=f"r{i}", prompt_ids=[rng.randrange(args.vocab) for _ in range(args.prompt_len)],
                params=p, seed=rng.randrange(2**63))
        r.output_ids = [rng.randrange(args.vocab) for _ in range(args.output_len)]
        reqs.append(r)
    return reqs


def new_step(sampler: Sampler) -> Callable[[torch.Tensor, list[Req]], list[int]]:
    """A step of the new sampler; one ``sampler`` across steps, as a scheduler keeps
    one (its penalty state is incremental)."""
    def step(logits: torch.Tensor, reqs: list[Req]) -> list[int]:
        return device_io.fetch(sample(logits, sampler.sampling_info(reqs), False, 0).next_ids)
    return step


def legacy_step(logits: torch.Tensor, reqs: list[Req]) -> list[int]:
    return legacy.sample(logits, legacy.build_sampling_info(reqs, logits.shape[-1], logits.device)).tolist()


def time_steps(logits: torch.Tensor, params: dict, args: argparse.Namespace) -> dict[str, tuple[float, list]]:
    """Median ms of one step of each implementation (after two warm-up steps),
    alternating them so that machine noise hits both; each step appends its tokens."""
    runs = {"legacy": (legacy_step, make_reqs(params, args, random.Random(args.seed)), []),
            "new": (new_step(Sampler(logits.shape[-1], (), logits.device)),
                    make_reqs(params, args, random.Random(args.seed)), [])}
    ids: dict[str, list[int]] = {}
    for i in range(args.iters + 2):
        for name, (step, reqs, times) in runs.items():
            t0 = time.perf_counter()
            ids[name] = step(logits, reqs)
            if i >= 2:
                times.append(time.perf_counter() - t0)
            for r, t in zip(reqs, ids[name]):
                r.output_ids.append(t)
    return {name: (sorted(times)[len(times) // 2] * 1e3, ids[name]) for name, (_, _, times) in runs.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    logits = torch.randn(args.batch, args.vocab, generator=gen, device=device) * 3
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"sampler step (build inputs + sample + read ids), batch {args.batch}, vocab {args.vocab}, "
          f"prompt {args.prompt_len} + output {args.output_len} tokens, median of {args.iters}; {name}")
    print(f"{'case':28s} {'legacy ms':>10s} {'new ms':>10s} {'speed-up':>9s}")
    for case, params in CASES.items():
        (legacy_ms, legacy_ids), (new_ms, new_ids) = time_steps(logits, params, args).values()
        note = "  (same ids)" if case == "greedy" and new_ids == legacy_ids else ""
        print(f"{case:28s} {legacy_ms:10.2f} {new_ms:10.2f} {legacy_ms / new_ms:8.2f}x{note}")


if __name__ == "__main__":
    main()
