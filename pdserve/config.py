"""Server configuration: one frozen dataclass whose fields are SGLang's flag names.

`ServerArgs(**kwargs)` validates on construction; `ServerArgs.from_cli(argv)` is
the argparse front. Every invalid value raises `ConfigError` naming the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass, fields
from typing import Any, Sequence

import torch

from pdserve.config_checks import (ATTENTION_BACKENDS, DEVICES, DISAGGREGATION_MODES, DTYPES,  # noqa: F401
                                   KV_CACHE_DTYPES, LOAD_FORMATS, PATH_FIELDS, SCHEDULE_POLICIES,
                                   SPECULATIVE_ALGORITHMS, STAGING_MODES, TRANSFER_BACKENDS, ConfigError,
                                   default_draft_model_path, flag, parse_host_port, validate)
from pdserve.flags import FlagParser
from pdserve.model import attention_backends
from pdserve.server.reasoning import REASONING_PARSERS
from pdserve.server.tool_calls import TOOL_CALL_PARSERS


@dataclass(frozen=True)
class ServerArgs:
    model_path: str | None = None
    tokenizer_path: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    tp_size: int = 1
    # Multi-node TP (SGLang's flags): every node runs the same command but its
    # --node-rank; node R runs TP ranks [R * tp/nnodes, (R + 1) * tp/nnodes). The TP group
    # meets at --dist-init-addr HOST:PORT (node 0 listens there). Only node 0 serves HTTP.
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    # Seconds every TP rank waits at startup for the whole group (all nodes) to join; None:
    # 300. Only the rendezvous: collectives keep torch's default deadline, since an idle
    # server's followers sit in one (a short deadline would end an idle group).
    dist_timeout: float | None = None
    mem_fraction_static: float = 0.85
    max_total_tokens: int | None = None
    max_running_requests: int = 256
    max_prefill_tokens: int = 16384
    # -1 disables chunking (SGLang's convention).
    chunked_prefill_size: int = 8192
    # Tokens per KV page. None: PD_PAGE_SIZE on a prefill or decode server, else 1.
    page_size: int | None = None
    kv_cache_dtype: str = "auto"
    # auto: the checkpoint's weights (safetensors, else pytorch_model.bin); dummy: random
    # weights at the config's shapes (benchmarks without a checkpoint, as SGLang's and
    # vLLM's --load-format dummy).
    load_format: str = "auto"
    # auto: torch_native on CPU, triton on CUDA (see resolved_attention_backend()); SGLang's
    # kernel-library names (fa3, flashinfer...) run as auto, with a startup line saying so.
    attention_backend: str = "auto"
    # CUDA graphs for decode. Capture is unverified on a GPU so far: off unless
    # --enable-cuda-graph; --disable-cuda-graph (SGLang's) is accepted and wins.
    enable_cuda_graph: bool = False
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 160
    # pdserve has no overlap scheduler (it needs a GPU measurement first): the flag is
    # accepted for SGLang command lines and changes nothing.
    disable_overlap_schedule: bool = False
    disable_radix_cache: bool = False
    # A decode server serves the prompt prefix it still caches (an earlier turn's prompt +
    # answer) from its own pool and asks prefill only for the rest; this turns that off.
    disable_decode_prefix_reuse: bool = False
    # Where the transfer engine reads and writes KV: auto (the device buffers when the
    # installed Mooncake build can register them, else host copies), direct, host.
    disaggregation_kv_staging: str = "auto"
    # A decode rank's landing area (pdserve/disagg/landing.py), in MiB (0: none; None: 1/32
    # of the rank's KV pool, within [16, 512] MiB): a request whose reserved slots average
    # fewer than --disaggregation-kv-landing-min-run positions per run receives its KV
    # there, packed, in a few large writes, copied into its slots at commit.
    disaggregation_kv_landing_mib: int | None = None
    disaggregation_kv_landing_min_run: int = 64
    # torch_native decode keeps running requests' KV contiguous (pdserve/model/decode_mirror.py).
    disable_decode_kv_mirror: bool = False
    schedule_policy: str = "fcfs"
    random_seed: int | None = None
    context_length: int | None = None
    trust_remote_code: bool = False
    # Upper bound on `n` (parallel samples) per request.
    max_n: int = 16
    # Bound on the whole CPU KV budget when --max-total-tokens is not given:
    # mem_fraction_static of this many GiB (a CPU has no device memory to measure); the
    # pool never exceeds what --max-running-requests requests of the full context hold.
    # The pool is resident memory: 0.5 GiB keeps the demo's scheduler at ~0.8 GB RSS (4.0
    # took 2.5 GB each, README "Quick start") and still holds 110k demo tokens.
    cpu_kv_budget_gb: float = 0.5
    log_level: str = "info"
    # Every this many decode steps the scheduler logs one line: running / queued
    # requests, KV usage, generation throughput, accept length (SGLang's flag and default).
    decode_log_interval: int = 40
    # Speculative decoding (SGLang's flags). The three shape flags are given
    # together or not at all; `speculative_shape()` resolves the defaults.
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    # With --tp-size > 1: every speculative round the ranks compare their draft trees and
    # accepted paths and fail the round's requests if they differ (a bring-up check).
    debug_tp_agreement: bool = False
    # Prefill/decode disaggregation (SGLang's flags; deadlines in seconds)
    disaggregation_mode: str = "null"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_transfer_backend: str = "mooncake"
    disaggregation_ib_device: str | None = None
    disaggregation_bootstrap_timeout: float = 30.0
    disaggregation_waiting_timeout: float = 120.0
    disaggregation_transfer_timeout: float = 60.0
    disaggregation_heartbeat_interval: float = 1.0
    disaggregation_heartbeat_misses: int = 3
    # The shared secret that authenticates PD control messages (HMAC) between this
    # deployment's servers; required when a PD server listens beyond loopback.
    disaggregation_secret: str | None = None
    disaggregation_secret_file: str | None = None
    # Prefill servers (HOST or HOST:BOOTSTRAP_PORT) a decode server may fetch KV from
    # (empty: any that requests name).
    disaggregation_allowed_prefill: tuple[str, ...] = ()
    # HTTP server
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    # Protects the admin routes (/abort_request, /flush_cache, /drain) when given; without
    # it they answer only loopback clients (pdserve/server/http_front.py KeyCheck).
    admin_api_key: str | None = None
    # The admin key read from a file (a mounted secret: not on the command line, where `ps`
    # and `docker inspect` show it); exclusive with --admin-api-key. See admin_key().
    admin_api_key_file: str | None = None
    # The model's names (vLLM's repeatable flag): the first is the one responses and
    # /v1/models report; requests may name any of them, or "default". Empty: the model
    # path (the demo: "pdserve-demo").
    served_model_name: tuple[str, ...] = ()
    # Bodies above this are refused with 413 before they are parsed.
    max_request_bytes: int = 8 << 20
    # Prompt logprobs (/generate logprob_start_len, completions echo + logprobs) a request
    # may ask for, in response entries: prompt tokens x (1 + top logprobs) x samples. A
    # small body could otherwise ask for a response thousands of times its size.
    max_prompt_logprob_entries: int = 1 << 18
    # A client must deliver its request headers and body within this many seconds.
    request_read_timeout: float = 10.0
    # A client that takes none of its response for this many seconds (its connection's
    # buffers full) is dropped and its request aborted, as nginx's send_timeout.
    send_timeout: float = 60.0
    # Drain (SIGTERM or POST /drain): in-flight requests get this many seconds to finish
    # (SGLang's flag name); the rest are then aborted with an error and the process exits 0.
    graceful_shutdown_timeout: float = 30.0
    # Load shedding: at most this many requests (samples) wait beyond the
    # --max-running-requests slots; past it a new request gets 503 with Retry-After
    # (pdserve/server/drain.py). None: unbounded.
    max_queued_requests: int | None = None
    # A request's chat_template_kwargs may carry its own "chat_template" (Jinja run by the server).
    allow_client_chat_template: bool = False
    # The chat template of /v1/chat/completions instead of the tokenizer's: a Jinja file
    # or a built-in name (pdserve/chat_templates.py).
    chat_template: str | None = None
    # Splits a chat answer's thinking (<think>...</think>) into `reasoning_content`
    # (SGLang's names: pdserve/server/reasoning.py). None: the output is all content.
    reasoning_parser: str | None = None
    # Reads tool calls out of a chat answer in the model's own format (SGLang's names:
    # pdserve/server/tool_calls.py), for `tool_choice: auto`. None: auto tool calling is refused.
    tool_call_parser: str | None = None
    # Constrained decoding (issue 39): a json_schema / regex / ebnf above this many bytes,
    # or nested deeper than this (JSON arrays and objects; regex / EBNF parentheses), is a
    # 400 before it is parsed (xgrammar's parse time grows with the cube of the depth).
    grammar_max_bytes: int = 1 << 20
    grammar_max_depth: int = 64
    # Longest a grammar may take to parse (HTTP process) and to compile (scheduler), each;
    # past it the request fails alone, naming this flag, and the compile is stopped.
    grammar_compile_timeout: float = 30.0
    # Bytes of parsed (HTTP process) and of compiled grammars (each scheduler) kept for
    # reuse; least recently used first out; /flush_cache empties them.
    grammar_cache_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        self._normalise()
        self._validate()

    def _normalise(self) -> None:
        """Paths may be given as any os.PathLike (pathlib.Path...) and sequences as lists;
        the frozen config keeps plain str and tuples. A lone served name may be a str."""
        for name in PATH_FIELDS:
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                object.__setattr__(self, name, os.fspath(value))  # bytes paths stay bytes: refused below
        if isinstance(self.served_model_name, str):
            object.__setattr__(self, "served_model_name", (self.served_model_name,))
        for f in fields(self):
            if str(f.type) == "tuple[str, ...]" and isinstance(getattr(self, f.name), list):
                object.__setattr__(self, f.name, tuple(getattr(self, f.name)))
        # The draft when none is given (config_checks.default_draft_model_path: the
        # checkpoint's own MTP layer, the demo model's heads, else a refusal saying why); a model path that is no directory, or an
        # unknown algorithm, is left to validation to name.
        if (self.speculative_algorithm in SPECULATIVE_ALGORITHMS and self.speculative_draft_model_path is None
                and (self.model_path is None
                     or (isinstance(self.model_path, str) and os.path.isdir(self.model_path)))):
            object.__setattr__(self, "speculative_draft_model_path",
                               default_draft_model_path(self.model_path, self.speculative_algorithm))
        if self.page_size is None:
            object.__setattr__(self, "page_size", PD_PAGE_SIZE if self.disaggregation_mode in ("prefill", "decode")
                               else 1)
        # SGLang's NEXTN is EAGLE (its draft, without a path, the checkpoint's NextN layer: above).
        if self.speculative_algorithm == "NEXTN":
            object.__setattr__(self, "speculative_algorithm", "EAGLE")

    # ---- validation (pdserve/config_checks.py) -------------------------------------
    def _validate(self) -> None:
        validate(self)

    def speculative_shape(self, architecture: str) -> tuple[int, int, int]:
        """(num_steps, eagle_topk, num_draft_tokens): the flags, or the per-model default
        the target's architecture class declares (the chain (3, 1, 4) for every built-in
        one: see LlamaForCausalLM for the measurements). Top-k 1 is a chain: it forces
        num_draft_tokens = num_steps + 1."""
        if self.speculative_num_steps is None:
            from pdserve.model.registry import architecture_class
            steps, topk, tokens = architecture_class(architecture).speculative_defaults
        else:
            steps, topk, tokens = (self.speculative_num_steps, self.speculative_eagle_topk,  # type: ignore
                                   self.speculative_num_draft_tokens)
        if topk == 1:
            tokens = steps + 1
        return steps, topk, tokens

    # ---- derived values -------------------------------------------------------
    def control_secret(self) -> bytes | None:
        """The PD control plane's shared secret (None: unauthenticated, loopback only)."""
        if self.disaggregation_secret_file is not None:
            with open(self.disaggregation_secret_file, "rb") as fh:
                secret = fh.read().strip()
            if len(secret) < 16:
                raise ConfigError(f"{flag('disaggregation_secret_file')}: the secret must be at least 16 bytes")
            return secret
        return self.disaggregation_secret.encode() if self.disaggregation_secret is not None else None

    def admin_key(self) -> str | None:
        """The admin key: --admin-api-key, else the content of --admin-api-key-file
        (surrounding whitespace stripped, as a mounted secret's trailing newline)."""
        if self.admin_api_key_file is not None:
            with open(self.admin_api_key_file, encoding="utf-8") as fh:
                key = fh.read().strip()
            if not key:
                raise ConfigError(f"{flag('admin_api_key_file')}: {self.admin_api_key_file!r} is empty")
            return key
        return self.admin_api_key

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_attention_backend(self) -> str:
        return attention_backends.resolve(self.attention_backend, self.resolved_device().type)

    def _attention_backend_supports(self, capability: str) -> bool:
        return bool(getattr(attention_backends.backend_class(self.resolved_attention_backend()), capability))

    def node_tp_ranks(self) -> range:
        """The TP ranks this node runs (all of them on a single node)."""
        per_node = self.tp_size // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    def dist_init_host_port(self) -> tuple[str, int] | None:
        """--dist-init-addr as (host, port), IPv6 brackets stripped; None when not given."""
        return parse_host_port(self.dist_init_addr) if self.dist_init_addr is not None else None

    def rendezvous_timeout(self) -> float:
        return self.dist_timeout if self.dist_timeout is not None else 300.0

    def use_cuda_graph(self) -> bool:
        return self.enable_cuda_graph and not self.disable_cuda_graph

    def served_names(self) -> tuple[str, ...]:
        """The model's names, the reported one first: --served-model-name, else the model
        path (the embedded demo model: "pdserve-demo")."""
        if self.served_model_name:
            return self.served_model_name
        return (self.model_path,) if self.model_path is not None else ("pdserve-demo",)

    def replace(self, **changes: Any) -> "ServerArgs":
        return dataclasses.replace(self, **changes)

    # ---- construction ---------------------------------------------------------
    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "ServerArgs":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown option(s): {', '.join(flag(u) for u in unknown)}")
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            if f.type in ("bool", bool):
                parser.add_argument(flag(f.name), action="store_true", default=default)
                continue
            if f.name in _REPEATABLE:  # `--flag a b` and `--flag a --flag b` both give (a, b)
                parser.add_argument(flag(f.name), nargs="+", action="extend", default=None, metavar="VALUE")
                continue
            if str(f.type) == "tuple[str, ...]":
                parser.add_argument(flag(f.name), nargs="*", default=default, metavar="VALUE")
                continue
            kind = _FIELD_PARSERS.get(str(f.type), str)
            kwargs: dict[str, Any] = {"type": kind, "default": default}
            choices = _FIELD_CHOICES.get(f.name)
            if choices:
                kwargs["choices"] = choices
            parser.add_argument(flag(f.name), **kwargs)

    @classmethod
    def cli_parser(cls, prog: str = "pdserve serve", description: str | None = "Start a pdserve server.",
                   **kwargs: Any) -> FlagParser:
        """The server flags' parser: unique prefixes accepted (as SGLang's parser), every bad
        flag and value reported together as one ConfigError (pdserve/flags.py)."""
        parser = FlagParser(prog=prog, description=description, error_class=ConfigError, **kwargs)
        cls.add_cli_args(parser)
        return parser

    @classmethod
    def from_cli(cls, argv: Sequence[str] | None = None) -> "ServerArgs":
        argv = sys.argv[1:] if argv is None else argv
        # Paths may come as os.PathLike (argparse itself only handles str).
        ns = cls.cli_parser().parse_or_raise([os.fspath(a) if isinstance(a, os.PathLike) else a for a in argv])
        return cls.from_namespace(ns)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> "ServerArgs":
        names = {f.name for f in fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in vars(ns).items()
                      if k in names and not (k in _REPEATABLE and v is None)})


def _int_or_none(text: str) -> int | None:
    try:
        return None if text.lower() == "none" else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r} (an integer, or none)") from None


def _float_or_none(text: str) -> float | None:
    try:
        return None if text.lower() == "none" else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r} (a number, or none)") from None


# The page size of a PD server unless --page-size is given: a transfer writes one entry per
# run of slots consecutive on both sides, and pages bound how scattered a prompt's KV can
# be. On a pool that has been serving (decode steps interleave the requests' pages), with a
# real model's KV row size (4 KiB per token and buffer), 64-token pages kept the writes at
# 0.78-1.36x the speed of a contiguous write, 16-token pages at 0.49-1.05x, page size 1 at
# 0.08-0.43x (both engines; docs/benchmarks.md, "KV transfer on both engines").
PD_PAGE_SIZE = 64

_FIELD_PARSERS = {
    "int": int, "float": float, "str": str,
    "int | None": _int_or_none, "float | None": _float_or_none, "str | None": str,
}
# Flags that may be repeated (or take several values), as vLLM's --served-model-name.
_REPEATABLE = frozenset({"served_model_name"})
_FIELD_CHOICES = {
    "dtype": DTYPES, "kv_cache_dtype": KV_CACHE_DTYPES, "device": DEVICES, "load_format": LOAD_FORMATS,
    "attention_backend": ATTENTION_BACKENDS, "schedule_policy": SCHEDULE_POLICIES,
    "speculative_algorithm": SPECULATIVE_ALGORITHMS,
    "disaggregation_mode": DISAGGREGATION_MODES, "disaggregation_transfer_backend": TRANSFER_BACKENDS,
    "disaggregation_kv_staging": STAGING_MODES,
    "reasoning_parser": tuple(REASONING_PARSERS),
    "tool_call_parser": tuple(TOOL_CALL_PARSERS),
}
