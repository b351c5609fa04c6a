"""GLM-4.5 in pdserve: what a round of MTP drafting costs, and what an FP8 checkpoint
weighs on disk and in memory (CPU, one run).

    python -m pdserve.bench.glm_mtp --batch-sizes 1 8 --shapes 2,1,3 3,2,6

(a) MTP round vs plain decode step, on a tiny random GLM-4.5 (`build_random_model(dir,
    "glm4_moe")`: layer 0 dense, MoE layers after, one NextN layer). The draft is the
    checkpoint's own NextN layer (``--speculative-algorithm EAGLE``, no draft path). A
    step's (round's) time is (time to generate NEW+1 tokens - time to generate 1) / the
    decode steps (verify rounds: ``spec_verify_ct``, the most any request of the batch
    took) for the same prompts, so prefill cancels out, as in decode_step.py; the median
    of ``--repeats``, which alternate between the configurations' engines (machine noise
    hits all alike). The NextN layer is random, so its acceptance here means nothing: the
    number to read is the cost ratio. A round costing X plain steps pays off once it
    emits more than X tokens per round (accepted drafts + the bonus token).

(b) FP8 checkpoint memory. Measured on the tiny GLM-4.5 written as a block-fp8 checkpoint
    (`build_fp8_checkpoint`, 128x128 blocks): fp8 bytes (weights + scales) stored vs the
    parameter bytes resident once an engine (target + MTP draft) has loaded it on CPU.
    Computed at GLM-4.5-Air's published shape (`GLM45_AIR`): the checkpoint at bf16 and
    at block fp8, and what pdserve holds: on CPU every fp8 weight dequantised (fp32 by
    default on CPU, bf16 with ``--dtype bfloat16``); on CUDA (compute capability >= 8.9)
    the attention, dense-MLP and shared-expert linears and the routed experts kept in fp8
    with per-row scales (model/layers.py ``Linear.keep_fp8``, model/moe.py
    ``ExpertStack.keep_fp8``) but the embeddings, LM head and the whole NextN draft layer
    dequantised to bf16.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

GIB = 1 << 30
BLOCK = 128  # the fp8 checkpoints' weight blocks (128x128), and the FP8 GEMM's column group


# ---------------------------------------------------------------------- (b) computed

@dataclass(frozen=True)
class GlmShape:
    """The config.json values a GLM-4.5 checkpoint's weight bytes depend on."""

    hidden: int
    layers: int             # num_hidden_layers (the NextN layers come after these)
    dense_layers: int       # first_k_dense_replace
    intermediate: int       # the dense layers' MLP
    experts: int            # n_routed_experts
    moe_intermediate: int
    shared_experts: int     # n_shared_experts (one MLP moe_intermediate * n wide)
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    nextn_layers: int       # num_nextn_predict_layers
    tie_word_embeddings: bool = False
    attention_bias: bool = True
    qk_norm: bool = False   # use_qk_norm

    def __post_init__(self) -> None:
        if not 0 <= self.dense_layers <= self.layers:
            raise ValueError(f"dense_layers (first_k_dense_replace) {self.dense_layers} must be within "
                             f"0..layers ({self.layers})")


# zai-org/GLM-4.5-Air config.json.
GLM45_AIR = GlmShape(hidden=4096, layers=46, dense_layers=1, intermediate=10944, experts=128, moe_intermediate=1408,
                     shared_experts=1, heads=96, kv_heads=8, head_dim=128, vocab=151552, nextn_layers=1)


@dataclass(frozen=True)
class Tensors:
    """Same-shaped weights of one role: ``count`` of them, each [rows, cols] (a vector: cols 0)."""

    role: str
    count: int
    rows: int
    cols: int = 0
    nextn: bool = False       # part of the NextN (MTP) layer: pdserve's draft loads it
    fp8: bool = False         # stored in fp8 in a block-fp8 checkpoint (a linear's weight)
    kept_fp8_on_cuda: bool = False  # a target linear or expert matrix: keep_fp8 holds it in fp8 with row scales
    fp32: bool = False        # stored and held in fp32 whatever the dtype (the routing bias)

    @property
    def numel(self) -> int:
        return self.count * self.rows * max(self.cols, 1)

    @property
    def block_scales(self) -> int:
        """fp32 scales of the checkpoint: one per 128x128 block."""
        return self.count * -(-self.rows // BLOCK) * -(-self.cols // BLOCK) if self.fp8 else 0

    @property
    def row_scales(self) -> int:
        """fp32 scales pdserve holds for a kept fp8 weight: one per row and 128 input columns
        (model/fp8.py gemm_scale)."""
        return self.count * self.rows * -(-self.cols // BLOCK) if self.kept_fp8_on_cuda else 0


def decoder_layer(s: GlmShape, count: int, moe: bool, nextn: bool) -> list[Tensors]:
    """The tensors of ``count`` decoder layers (GLM-4.5's layout: q/k/v with biases, MoE
    with a sigmoid router and its correction bias, shared experts)."""
    target = not nextn  # the draft's layers are dequantised even on CUDA (its loader renames)
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    lin = dict(nextn=nextn, fp8=True, kept_fp8_on_cuda=target)
    out = [Tensors("attention q/k/v/o", count, q, s.hidden, **lin), Tensors("attention q/k/v/o", count * 2, kv,
                                                                            s.hidden, **lin),
           Tensors("attention q/k/v/o", count, s.hidden, q, **lin),
           Tensors("norms", count * 2, s.hidden, nextn=nextn)]
    if s.attention_bias:
        out += [Tensors("attention biases", count, q, nextn=nextn), Tensors("attention biases", count * 2, kv,
                                                                            nextn=nextn)]
    if s.qk_norm:
        out.append(Tensors("norms", count * 2, s.head_dim, nextn=nextn))
    if not moe:
        return out + [Tensors("dense MLP", count * 2, s.intermediate, s.hidden, **lin),
                      Tensors("dense MLP", count, s.hidden, s.intermediate, **lin)]
    e, i = s.experts, s.moe_intermediate
    out += [Tensors("router", count, e, s.hidden, nextn=nextn),
            Tensors("router", count, e, nextn=nextn, fp32=True),
            Tensors("routed experts", count * e * 2, i, s.hidden, **lin),
            Tensors("routed experts", count * e, s.hidden, i, **lin)]
    if s.shared_experts:
        si = i * s.shared_experts
        out += [Tensors("shared experts", count * 2, si, s.hidden, **lin),
                Tensors("shared experts", count, s.hidden, si, **lin)]
    return out


def checkpoint_tensors(s: GlmShape) -> list[Tensors]:
    """Every weight pdserve loads from a GLM-4.5 checkpoint (target and NextN layers).
    Not counted: the NextN layers' own ``embed_tokens`` / ``shared_head.head``, copies of
    the target's that pdserve does not read (it shares the target's)."""
    out = [Tensors("embeddings + LM head", 1 if s.tie_word_embeddings else 2, s.vocab, s.hidden),
           Tensors("norms", 1, s.hidden)]
    out += decoder_layer(s, s.dense_layers, moe=False, nextn=False)
    out += decoder_layer(s, s.layers - s.dense_layers, moe=True, nextn=False)
    if s.nextn_layers:
        n = s.nextn_layers
        out += [Tensors("eh_proj", n, s.hidden, 2 * s.hidden, nextn=True, fp8=True),
                Tensors("norms", n * 3, s.hidden, nextn=True)]  # enorm, hnorm, shared_head.norm
        out += decoder_layer(s, n, moe=True, nextn=True)  # GLM-4.5's NextN layer is a MoE layer
    return out


@dataclass(frozen=True)
class MemoryRow:
    label: str
    bytes: int
    note: str


def memory_table(s: GlmShape) -> list[MemoryRow]:
    """Weight bytes of the checkpoint at bf16 and at block fp8, and what pdserve holds."""
    ts = checkpoint_tensors(s)
    numel = sum(t.numel for t in ts)
    fp32 = sum(t.numel for t in ts if t.fp32)

    def held(float_bytes: int) -> int:
        return (numel - fp32) * float_bytes + fp32 * 4

    fp8 = sum(t.numel for t in ts if t.fp8)
    scales = sum(t.block_scales for t in ts)
    kept = sum(t.numel for t in ts if t.kept_fp8_on_cuda)
    row_scales = sum(t.row_scales for t in ts)
    nextn = sum(t.numel for t in ts if t.nextn)
    return [
        MemoryRow("checkpoint, bf16", held(2), f"{numel / 1e9:.2f}B parameters ({nextn / 1e9:.2f}B in the NextN "
                                                "layer)"),
        MemoryRow("checkpoint, block fp8", fp8 + scales * 4 + held(2) - fp8 * 2,
                  f"{fp8 / 1e9:.2f}B fp8 weights + {scales * 4 / 2**20:.1f} MiB fp32 128x128-block scales; "
                  "embeddings, LM head, norms, routers, biases bf16"),
        MemoryRow("pdserve CPU, default dtype (fp32)", held(4), "every fp8 weight dequantised at load"),
        MemoryRow("pdserve CPU, --dtype bfloat16", held(2), "every fp8 weight dequantised at load"),
        MemoryRow("pdserve CUDA cc>=8.9 (bf16), FP8 GEMM", kept + row_scales * 4 + held(2) - kept * 2,
                  f"{kept / 1e9:.2f}B attention / dense-MLP / shared- and routed-expert weights kept in fp8 (+ "
                  f"{row_scales * 4 / 2**20:.0f} MiB per-row fp32 scales); embeddings, LM head and the NextN "
                  "draft layer dequantised to bf16 (untested on a GPU)"),
    ]


def print_memory_table(title: str, rows: list[MemoryRow]) -> None:
    print(f"\n{title}\n")
    print("| weights | GB (1e9 bytes) | GiB | what |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r.label} | {r.bytes / 1e9:.1f} | {r.bytes / GIB:.1f} | {r.note} |")


def print_role_table(s: GlmShape) -> None:
    """The same bytes by role: where fp8 is kept and where it is not."""
    roles: dict[str, list[Tensors]] = {}
    for t in checkpoint_tensors(s):
        roles.setdefault(("NextN: " if t.nextn else "") + t.role, []).append(t)
    print("\n| role | parameters (B) | bf16 checkpoint GB | fp8 checkpoint GB | pdserve CUDA GB |")
    print("|---|---|---|---|---|")
    for role, ts in roles.items():
        n = sum(t.numel for t in ts)
        bf16 = sum(t.numel * (4 if t.fp32 else 2) for t in ts)
        fp8 = sum(t.numel + t.block_scales * 4 if t.fp8 else t.numel * (4 if t.fp32 else 2) for t in ts)
        cuda = sum(t.numel + t.row_scales * 4 if t.kept_fp8_on_cuda else t.numel * (4 if t.fp32 else 2) for t in ts)
        print(f"| {role} | {n / 1e9:.3f} | {bf16 / 1e9:.2f} | {fp8 / 1e9:.2f} | {cuda / 1e9:.2f} |")


# ---------------------------------------------------------------------- (b) measured

class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def stored_fp8_bytes(model_dir: Path) -> tuple[int, int]:
    """(bytes of fp8 weights + their scales, bytes of every tensor) in model_dir's safetensors."""
    from safetensors import safe_open

    fp8 = total = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                t = st.get_tensor(name)
                total += t.nbytes
                if t.dtype == torch.float8_e4m3fn or name.endswith((".weight_scale_inv", ".weight_scale")):
                    fp8 += t.nbytes
    return fp8, total


def resident_bytes(model_dir: Path, dtype: str) -> tuple[int, list[str]]:
    """Parameter bytes of an engine's target + MTP draft (shared tensors once), and the
    loader's FP8 log lines."""
    from pdserve import Engine

    log = logging.getLogger("pdserve.model.loader")
    handler, level = _Lines(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with Engine(model_path=str(model_dir), dtype=dtype, speculative_algorithm="EAGLE",
                    max_total_tokens=1024) as engine:
            sched = engine._scheduler
            assert sched is not None and sched.spec is not None, "tp_size 1: the engine runs in-process"
            params = {p.data_ptr(): p for m in (sched.runner.model, sched.spec.draft) for p in m.parameters()}
            nbytes = sum(p.nbytes for p in params.values())
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return nbytes, [line for line in handler.lines if "FP8 checkpoint" in line]


# ---------------------------------------------------------------------- (a) round cost

@dataclass(frozen=True)
class RoundRow:
    config: str
    batch: int
    ms: list[float]            # per decode step (plain) or verify round (MTP), one per repeat
    ratios: list[float]        # ms / the plain step's ms of the same repeat
    tokens_per_round: float    # output tokens per step / round and request
    same_as_plain: bool


GREEDY = {"temperature": 0.0, "ignore_eos": True}


class _Timed:
    """One engine and batch: generations of 1 token (prefill + the first token) and of
    NEW+1 tokens, a pair per `repeat`; a step's (round's) time is the full generation's
    less the fastest 1-token one seen (`ms`)."""

    def __init__(self, engine: Any, prompts: list[list[int]], new: int) -> None:
        self.engine, self.prompts, self.new = engine, prompts, new
        engine.generate(input_ids=prompts, sampling_params=dict(GREEDY, max_new_tokens=4))  # warm-up
        self.one = float("inf")
        self.runs: list[tuple[float, int]] = []  # (seconds, steps or rounds) of each full generation
        self.tokens_per_round = 1.0
        self.outputs: list[list[int]] = []

    def _generate(self, tokens: int) -> tuple[float, list[dict[str, Any]]]:
        t0 = time.perf_counter()
        outs = self.engine.generate(input_ids=self.prompts, sampling_params=dict(GREEDY, max_new_tokens=tokens))
        return time.perf_counter() - t0, outs

    def repeat(self) -> None:
        # The fastest prefill of all: one slowed by a neighbour would otherwise exceed a
        # full run's and make the step time negative.
        self.one = min(self.one, self._generate(1)[0])
        full, outs = self._generate(self.new + 1)
        verify = [o["meta_info"].get("spec_verify_ct", 0) for o in outs]
        # Plain decoding: one step per token after the first; MTP: the batch ran as many
        # rounds as its longest-running request.
        self.runs.append((full, max(verify) or self.new))
        if max(verify):
            self.tokens_per_round = self.new / (sum(verify) / len(verify))
        self.outputs = [o["output_ids"] for o in outs]

    @property
    def ms(self) -> list[float]:
        return [(full - self.one) / rounds * 1e3 for full, rounds in self.runs]


def round_costs(model_dir: Path, batch_sizes: list[int], shapes: list[tuple[int, int, int]], new: int,
                repeats: int, prompt_len: int, seed: int) -> list[RoundRow]:
    """Every configuration's engine stays open and the repeats alternate between them, so
    machine noise hits the plain step and the rounds alike (the ratio is per repeat)."""
    from pdserve import Engine

    rng = random.Random(seed)
    # Ids >= 6 skip the character tokenizer's special tokens.
    prompts = [[rng.randrange(6, 90) for _ in range(prompt_len)] for _ in range(max(batch_sizes))]
    configs: list[tuple[str, dict[str, Any]]] = [("plain", {})]
    for s, k, n in shapes:
        configs.append((f"MTP ({s},{k},{n})", dict(speculative_algorithm="EAGLE", speculative_num_steps=s,
                                                   speculative_eagle_topk=k, speculative_num_draft_tokens=n)))
    rows: list[RoundRow] = []
    with contextlib.ExitStack() as stack:
        engines = [stack.enter_context(Engine(model_path=str(model_dir), disable_radix_cache=True,
                                              max_total_tokens=8192, **kw)) for _, kw in configs]
        for b in batch_sizes:
            timed = [_Timed(engine, prompts[:b], new) for engine in engines]
            for _ in range(repeats):
                for t in timed:
                    t.repeat()
            for (name, _), t in zip(configs, timed):
                ratios = [x / p for x, p in zip(t.ms, timed[0].ms)]
                rows.append(RoundRow(name, b, t.ms, ratios, t.tokens_per_round, t.outputs == timed[0].outputs))
    return rows


def print_round_table(rows: list[RoundRow]) -> None:
    print("| config | batch | ms per step / round (median) | repeats (ms) | round / plain step (median of the "
          "repeats' ratios) | tokens per round (random draft) | outputs equal plain |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.config} | {r.batch} | {statistics.median(r.ms):.2f} | {' / '.join(f'{x:.2f}' for x in r.ms)} | "
              f"{statistics.median(r.ratios):.2f} | {r.tokens_per_round:.2f} | {'yes' if r.same_as_plain else 'NO'} |")
    print("\nAcceptance on random weights is meaningless (the NextN layer is random): read the cost ratio. "
          "A round costing X plain steps pays off when it emits more than X tokens per round:")
    for r in rows:
        if r.config != "plain":
            print(f"  {r.config} at batch {r.batch}: a round costs {statistics.median(r.ratios):.2f} plain steps")


# ---------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> None:
    from pdserve.testing import build_fp8_checkpoint, build_random_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--shapes", nargs="+", default=["2,1,3", "3,2,6"],
                    help="speculative (num_steps,eagle_topk,num_draft_tokens) settings")
    ap.add_argument("--layers", type=int, default=3, help="decoder layers of the tiny GLM-4.5 (layer 0 dense)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--new", type=int, default=32, help="tokens timed per generation after the first")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-rounds", action="store_true", help="only the memory tables")
    args = ap.parse_args(argv)
    shapes = []
    for shape in args.shapes:
        try:
            s, k, n = (int(x) for x in shape.split(","))
        except ValueError:
            ap.error(f"--shapes: {shape!r} is not num_steps,eagle_topk,num_draft_tokens")
        shapes.append((s, k, n))
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        glm = build_random_model(Path(tmp) / "glm", "glm4_moe", num_layers=args.layers, hidden_size=args.hidden)
        if not args.skip_rounds:
            print(f"(a) tiny GLM-4.5 ({args.layers} layers, hidden {args.hidden}, one NextN layer), "
                  f"{torch.get_num_threads()} torch threads; prompts of {args.prompt_len} tokens, "
                  f"{args.new} greedy tokens timed after the first, median of {args.repeats}\n")
            print_round_table(round_costs(glm, args.batch_sizes, shapes, args.new, args.repeats, args.prompt_len,
                                          args.seed))
        fp8 = build_fp8_checkpoint(glm, Path(tmp) / "fp8", "fp8", block=(BLOCK, BLOCK))
        stored, total = stored_fp8_bytes(fp8)
        print(f"\n(b) measured: the tiny GLM-4.5 as a block-fp8 checkpoint ({BLOCK}x{BLOCK}): {stored / 1024:.1f} KiB "
              f"of fp8 weights + scales, {total / 1024:.1f} KiB of tensors in all (the rest fp32)")
        for dtype in ("auto", "bfloat16"):
            resident, lines = resident_bytes(fp8, dtype)
            print(f"  --dtype {dtype}: target + MTP draft parameters resident {resident / 1024:.1f} KiB "
                  f"({resident / total:.2f}x the checkpoint's tensors)")
            for line in lines:
                print(f"    loader: {line}")
    s = GLM45_AIR
    print_memory_table(f"(b) computed at GLM-4.5-Air's shape (hidden {s.hidden}; {s.layers} layers: {s.dense_layers} "
                       f"dense, {s.layers - s.dense_layers} MoE of {s.experts} experts x {s.moe_intermediate} + "
                       f"{s.shared_experts} shared; {s.heads} heads, {s.kv_heads} KV heads x {s.head_dim}; vocab "
                       f"{s.vocab}; {s.nextn_layers} NextN layer); weights only, TP 1, no KV cache",
                       memory_table(s))
    print_role_table(s)


if __name__ == "__main__":
    main()
