"""Offline engine, shaped like SGLang's `sgl.Engine`.

    from pdserve import Engine
    with Engine(model_path=DIR) as engine:
        out = engine.generate("What is 2 + 3?", {"max_new_tokens": 16, "temperature": 0})

With --tp-size 1 the scheduler runs in this process; with more, one process per
TP rank is started and rank 0 is driven over a pipe.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import uuid
import weakref
from pathlib import Path
from typing import Any, Sequence

from pdserve.config import ConfigError, ServerArgs
from pdserve.model.model_config import ModelConfig
from pdserve.model.parallel import TPGroup
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.req import FinishKind, Req
from pdserve.scheduler.scheduler import Scheduler
from pdserve.scheduler.worker import Command, build_scheduler, free_tcp_port, run_rank
from pdserve.tokenizer import load_tokenizer, trim_at_stop


def resolve_model_dir(args: ServerArgs) -> Path:
    if args.model_path is not None:
        return Path(args.model_path)
    try:
        from pdserve import assets
        return assets.path("demo")
    except (ImportError, FileNotFoundError, ValueError) as exc:
        raise ConfigError(f"--model-path is required: no embedded demo model is available ({exc})") from exc


def check_tp_layout(model_dir: Path, tp_size: int) -> None:
    """Refuse a TP size the model's heads cannot be split over, before any process starts."""
    cfg = ModelConfig.from_dir(model_dir)
    if cfg.num_heads % tp_size:
        raise ConfigError(f"--tp-size {tp_size}: num_attention_heads ({cfg.num_heads}) is not divisible by it")
    kv = cfg.num_kv_heads
    if (kv >= tp_size and kv % tp_size) or (kv < tp_size and tp_size % kv):
        raise ConfigError(f"--tp-size {tp_size}: num_key_value_heads ({kv}) can be neither split "
                          "nor replicated evenly over it")
    if cfg.hidden_size % tp_size or cfg.intermediate_size % tp_size:
        raise ConfigError(f"--tp-size {tp_size}: hidden_size / intermediate_size not divisible by it")


def sample_seed(base: int, index: int) -> int:
    """Seed of sample `index` of a request whose first sample uses `base`."""
    if index == 0:
        return base
    return random.Random(f"{base}:{index}").getrandbits(63)


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        self.args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        self.model_dir = resolve_model_dir(self.args)
        self.tokenizer_dir = Path(self.args.tokenizer_path) if self.args.tokenizer_path else self.model_dir
        self.tokenizer = load_tokenizer(self.tokenizer_dir)
        self._rng = random.Random(self.args.random_seed)
        self._scheduler: Scheduler | None = None
        self._procs: list[mp.process.BaseProcess] = []
        self._conn: Any = None
        # The list is filled in place, so the finalizer sees the processes started later.
        self._conn_box: list[Any] = []
        self._finalizer = weakref.finalize(self, Engine._stop_procs, self._procs, self._conn_box)
        if self.args.tp_size == 1:
            self._scheduler = build_scheduler(self.args, self.model_dir, self.tokenizer_dir, TPGroup())
            self.context_len = self._scheduler.context_len
            self.vocab_size = self._scheduler.vocab_size
        else:
            self._start_tp_workers()

    # ---- lifecycle --------------------------------------------------------------
    def _start_tp_workers(self) -> None:
        ctx = mp.get_context("spawn")
        init = f"tcp://127.0.0.1:{free_tcp_port()}"
        check_tp_layout(self.model_dir, self.args.tp_size)
        parent_conn, child_conn = ctx.Pipe()
        self._conn = parent_conn
        self._conn_box.append(parent_conn)
        for rank in range(self.args.tp_size):
            proc = ctx.Process(target=run_rank, daemon=True, name=f"pdserve-tp{rank}",
                               args=(self.args, self.model_dir, self.tokenizer_dir, rank, init,
                                     child_conn if rank == 0 else None))
            proc.start()
            self._procs.append(proc)
        kind, info = self._recv()
        if kind != "ready":
            self.shutdown()
            raise RuntimeError(f"TP worker failed to start:\n{info}")
        self.context_len = info["context_len"]
        self.vocab_size = ModelConfig.from_dir(self.model_dir).vocab_size

    def _recv(self) -> tuple[str, Any]:
        # Wait for rank 0, but notice at once when any rank has died.
        while not self._conn.poll(0.2):
            dead = [p for p in self._procs if not p.is_alive()]
            if dead:
                raise RuntimeError(f"TP scheduler process {dead[0].name} exited "
                                   f"(exit code {dead[0].exitcode})")
        kind, payload = self._conn.recv()
        if kind == "error":
            raise RuntimeError(f"TP scheduler failed:\n{payload}")
        return kind, payload

    @staticmethod
    def _stop_procs(procs: list[mp.process.BaseProcess], conn_box: list[Any]) -> None:
        for conn in conn_box:
            try:
                conn.send(Command(shutdown=True))
            except (BrokenPipeError, OSError):
                pass
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def shutdown(self) -> None:
        self._finalizer()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- generation ---------------------------------------------------------------
    def generate(self, prompt: str | Sequence[str] | None = None,
                 sampling_params: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
                 input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 return_logprob: bool = False, top_logprobs_num: int = 0
                 ) -> dict[str, Any] | list[dict[str, Any]]:
        prompts, single = self._normalize_inputs(prompt, input_ids)
        params = self._normalize_params(sampling_params, len(prompts))
        if not isinstance(return_logprob, bool):
            raise ValueError("return_logprob: must be a boolean")
        if not isinstance(top_logprobs_num, int) or isinstance(top_logprobs_num, bool) \
                or not 0 <= top_logprobs_num <= 20:
            raise ValueError(f"top_logprobs_num: must be an integer in [0, 20], got {top_logprobs_num!r}")
        groups: list[list[Req]] = []
        for ids, p in zip(prompts, params):
            self._check_lengths(ids, p)
            rid = uuid.uuid4().hex
            base = p.seed if p.seed is not None else self._rng.getrandbits(63)
            samples = [Req(rid=rid, prompt_ids=list(ids), params=p, seed=sample_seed(base, j),
                           return_logprob=return_logprob or top_logprobs_num > 0,
                           top_logprobs_num=top_logprobs_num, sample_index=j) for j in range(p.n)]
            samples[0].pending_forks = samples[1:]
            groups.append(samples)
        finished = self._run([g[0] for g in groups], sum(len(g) for g in groups))
        results = []
        for g in groups:
            for req in g:
                results.append(self._result(finished[(req.rid, req.sample_index)]))
        if single:
            return results[0] if len(results) == 1 else results
        return results

    def _run(self, heads: list[Req], total: int) -> dict[tuple[str, int], Req]:
        done: dict[tuple[str, int], Req] = {}
        if self._scheduler is not None:
            for req in heads:
                self._scheduler.add(req)
            while len(done) < total:
                out = self._scheduler.step()
                for r in out.finished:
                    done[(r.rid, r.sample_index)] = r
                if not self._scheduler.has_work and len(done) < total:
                    raise RuntimeError("scheduler went idle with requests unfinished")
            return done
        self._conn.send(Command(add=tuple(heads)))
        while len(done) < total:
            kind, payload = self._recv()
            if kind == "finished":
                for r in payload:
                    done[(r.rid, r.sample_index)] = r
        return done

    def _result(self, req: Req) -> dict[str, Any]:
        assert req.finish is not None
        p = req.params
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=p.skip_special_tokens)
        matched = req.finish.matched if isinstance(req.finish.matched, str) else None
        text = trim_at_stop(text, matched, p.no_stop_trim)
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "finish_reason": req.finish.to_dict(),
            "retractions": req.retractions,
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(req.output_logprobs, req.output_ids)]
            if req.top_logprobs_num:
                meta["output_top_logprobs"] = [[(lp, t, None) for lp, t in step]
                                               for step in req.output_top_logprobs]
        if req.finish.kind is FinishKind.LENGTH:
            meta["finish_reason"]["length"] = len(req.output_ids)
        return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}

    # ---- validation -----------------------------------------------------------------
    def _normalize_inputs(self, prompt: Any, input_ids: Any) -> tuple[list[list[int]], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("exactly one of prompt and input_ids must be given")
        if prompt is not None:
            single = isinstance(prompt, str)
            texts = [prompt] if single else list(prompt)
            if not texts or not all(isinstance(t, str) for t in texts):
                raise ValueError("prompt: must be a string or a non-empty list of strings")
            ids = [self.tokenizer(t)["input_ids"] for t in texts]
        else:
            if not isinstance(input_ids, (list, tuple)) or not input_ids:
                raise ValueError("input_ids: must be a non-empty list of token ids or of lists")
            single = not isinstance(input_ids[0], (list, tuple))
            ids = [list(input_ids)] if single else [list(x) for x in input_ids]
            for seq in ids:
                if not all(isinstance(t, int) and not isinstance(t, bool) for t in seq):
                    raise ValueError("input_ids: token ids must be integers")
                bad = [t for t in seq if not 0 <= t < self.vocab_size]
                if bad:
                    raise ValueError(f"input_ids: token id {bad[0]} is outside the vocabulary "
                                     f"[0, {self.vocab_size})")
        for seq in ids:
            if not seq:
                raise ValueError("prompt: is empty (no tokens)")
        return ids, single

    def _normalize_params(self, sampling_params: Any, n_prompts: int) -> list[SamplingParams]:
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != n_prompts:
                raise ValueError(f"sampling_params: {len(sampling_params)} given for {n_prompts} prompts")
            params = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            params = [SamplingParams.from_dict(sampling_params)] * n_prompts
        for p in params:
            if p.n > self.args.max_n:
                raise ValueError(f"n: {p.n} is above the limit {self.args.max_n} (--max-n)")
        return params

    def _check_lengths(self, ids: list[int], p: SamplingParams) -> None:
        if len(ids) >= self.context_len:
            raise ValueError(f"prompt: {len(ids)} tokens do not fit the context length {self.context_len}")
        if len(ids) + p.max_new_tokens > self.context_len:
            raise ValueError(f"max_new_tokens: prompt ({len(ids)} tokens) + max_new_tokens "
                             f"({p.max_new_tokens}) exceeds the context length {self.context_len}")

    # ---- inspection -------------------------------------------------------------------
    def flush_cache(self) -> bool:
        if self._scheduler is not None:
            return self._scheduler.flush_cache()
        self._conn.send(Command(flush_cache=True))
        kind, payload = self._recv()
        return bool(payload)

    def memory_state(self) -> dict[str, int]:
        if self._scheduler is not None:
            return self._scheduler.memory_state()
        self._conn.send(Command(memory_state=True))
        kind, payload = self._recv()
        return payload
