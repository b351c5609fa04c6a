"""Offline engine, shaped like SGLang's `sgl.Engine`.

    from pdserve import Engine
    with Engine(model_path=DIR) as engine:
        out = engine.generate("What is 2 + 3?", {"max_new_tokens": 16, "temperature": 0})

With --tp-size 1 the scheduler runs in this process; with more, one process per
TP rank is started and rank 0 is driven over a pipe.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import weakref
from pathlib import Path
from typing import Any, Sequence

import torch

from pdserve.config import ConfigError, ServerArgs
from pdserve.model.model_config import ModelConfig
from pdserve.model.parallel import TPGroup, bind_device
from pdserve.requests import RequestBuilder
from pdserve.scheduler.messages import Command, NewRequest
from pdserve.scheduler.req import Req, samples_from_message
from pdserve.scheduler.scheduler import Scheduler
from pdserve.scheduler.worker import PipeIO, build_scheduler, run_rank, tp_init_method
from pdserve.server.results import SampleOutput, native_result
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
    if cfg.moe is not None and cfg.moe.intermediate_size % tp_size:
        raise ConfigError(f"--tp-size {tp_size}: the experts' intermediate size ({cfg.moe.intermediate_size}) "
                          "is not divisible by it")


class Engine:
    def __init__(self, model_path: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        self.args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        if self.args.nnodes > 1:  # its TP ranks are this process's children; nothing runs elsewhere
            raise ConfigError(f"--nnodes: the offline Engine runs on one node, got {self.args.nnodes} "
                              "(serve a multi-node instance with `python -m pdserve.launch_server`)")
        self.model_dir = resolve_model_dir(self.args)
        self.tokenizer_dir = Path(self.args.tokenizer_path) if self.args.tokenizer_path else self.model_dir
        self.tokenizer = load_tokenizer(self.tokenizer_dir)
        self._scheduler: Scheduler | None = None
        self._closed = False
        self._procs: list[mp.process.BaseProcess] = []
        self._conn: Any = None
        # The list is filled in place, so the finalizer sees the processes started later.
        self._conn_box: list[Any] = []
        self._finalizer = weakref.finalize(self, Engine._stop_procs, self._procs, self._conn_box)
        if self.args.tp_size == 1:
            bind_device(0, self.args.resolved_device())
            self._scheduler = build_scheduler(self.args, self.model_dir, self.tokenizer_dir, TPGroup())
            self.context_len = self._scheduler.context_len
            self.vocab_size = self._scheduler.vocab_size
        else:
            self._start_tp_workers()
        self.builder = RequestBuilder(self.tokenizer, self.context_len, self.vocab_size, self.args.max_n,
                                      self.args.random_seed)

    # ---- lifecycle --------------------------------------------------------------
    def _start_tp_workers(self) -> None:
        ctx = mp.get_context("spawn")
        init = tp_init_method(self.args)
        check_tp_layout(self.model_dir, self.args.tp_size)
        parent_conn, child_conn = ctx.Pipe()
        self._conn = parent_conn
        self._conn_box.append(parent_conn)
        for rank in range(self.args.tp_size):
            make_io = functools.partial(PipeIO, child_conn) if rank == 0 else None
            proc = ctx.Process(target=run_rank, daemon=True, name=f"pdserve-tp{rank}",
                               args=(self.args, self.model_dir, self.tokenizer_dir, rank, init, make_io))
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
        """Stop the TP processes, or free the in-process scheduler's device memory
        (weights, KV pools, CUDA graphs) now, not at some later garbage collection, so
        another engine in this process can size its KV pool. Idempotent; the engine
        refuses work afterwards."""
        self._closed = True
        self._finalizer()
        sched, self._scheduler = self._scheduler, None
        if sched is not None:
            device = sched.device
            sched.release()
            del sched  # the last reference: the pools and weights go here
            if device.type == "cuda":
                # Hand the freed blocks back to the driver: other processes on this GPU (and
                # mem_get_info) see them again.
                torch.cuda.empty_cache()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Engine has been shut down")

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- generation ---------------------------------------------------------------
    def generate(self, prompt: str | Sequence[str] | None = None,
                 sampling_params: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
                 input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 return_logprob: bool = False, top_logprobs_num: int = 0, logprob_start_len: int = -1
                 ) -> dict[str, Any] | list[dict[str, Any]]:
        self._check_open()
        b = self.builder
        prompts, single = b.token_ids(prompt, input_ids)
        params = b.sampling_params(sampling_params, len(prompts))
        requests = b.build(prompts, params, return_logprob, top_logprobs_num, logprob_start_len=logprob_start_len)
        finished = self._run(requests)
        results = [self._result(finished[(m.rid, j)]) for m in requests for j in range(m.params.n)]
        if single:
            return results[0] if len(results) == 1 else results
        return results

    def _run(self, requests: list[NewRequest]) -> dict[tuple[str, int], Req]:
        """Every sample of `requests`, finished, by (rid, sample index)."""
        total = sum(m.params.n for m in requests)
        done: dict[tuple[str, int], Req] = {}
        if self._scheduler is not None:
            for m in requests:
                self._scheduler.add(samples_from_message(m)[0])
            while len(done) < total:
                out = self._scheduler.step()
                for r in out.finished:
                    done[(r.rid, r.sample_index)] = r
                if not self._scheduler.has_work and len(done) < total:
                    raise RuntimeError("scheduler went idle with requests unfinished")
            return done
        self._conn.send(Command(add=tuple(requests)))
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
        return native_result(SampleOutput.of_req(req, trim_at_stop(text, matched, p.no_stop_trim)))

    # ---- inspection -------------------------------------------------------------------
    def flush_cache(self) -> bool:
        self._check_open()
        if self._scheduler is not None:
            return self._scheduler.flush_cache()
        self._conn.send(Command(flush_cache=True))
        kind, payload = self._recv()
        return bool(payload)

    def memory_state(self) -> dict[str, int]:
        self._check_open()
        if self._scheduler is not None:
            return self._scheduler.memory_state()
        self._conn.send(Command(get_state=True))
        kind, payload = self._recv()
        return payload["memory"]
