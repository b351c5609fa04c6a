"""Server configuration: one frozen dataclass whose fields are SGLang's flag names.

`ServerArgs(**kwargs)` validates on construction; `ServerArgs.from_cli(argv)` is
the argparse front. Every invalid value raises `ConfigError` naming the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import ipaddress
import os
from dataclasses import dataclass, fields
from typing import Any, Sequence

import torch

from pdserve.chat_templates import BUILTIN_CHAT_TEMPLATES
from pdserve.disagg.staging import STAGING_MODES, choose_staging
from pdserve.disagg.transfer import mooncake_reaches_gpu_memory
from pdserve.server.reasoning import REASONING_PARSERS
from pdserve.server.tool_calls import TOOL_CALL_PARSERS


class ConfigError(ValueError):
    """An invalid server option; the message names the flag."""


DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "dummy")
ATTENTION_BACKENDS = ("auto", "torch_native", "triton", "flashinfer")
SCHEDULE_POLICIES = ("fcfs", "lpm")
SPECULATIVE_ALGORITHMS = ("EAGLE", "EAGLE3")
DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("mooncake", "nixl")
# Fields that hold a filesystem path: any os.PathLike is accepted and kept as str.
PATH_FIELDS = ("model_path", "tokenizer_path", "speculative_draft_model_path", "disaggregation_secret_file",
               "chat_template")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class ServerArgs:
    model_path: str | None = None
    tokenizer_path: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    tp_size: int = 1
    mem_fraction_static: float = 0.85
    max_total_tokens: int | None = None
    max_running_requests: int = 256
    max_prefill_tokens: int = 16384
    # -1 disables chunking (SGLang's convention).
    chunked_prefill_size: int = 8192
    page_size: int = 1
    kv_cache_dtype: str = "auto"
    # auto: the checkpoint's weights (safetensors, else pytorch_model.bin); dummy: random
    # weights at the config's shapes (benchmarks without a checkpoint, as SGLang's and
    # vLLM's --load-format dummy).
    load_format: str = "auto"
    # auto: torch_native on CPU, triton on CUDA (see resolved_attention_backend()).
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
    # torch_native decode keeps running requests' KV contiguous (pdserve/model/decode_mirror.py).
    disable_decode_kv_mirror: bool = False
    schedule_policy: str = "fcfs"
    random_seed: int | None = None
    context_length: int | None = None
    trust_remote_code: bool = False
    # Upper bound on `n` (parallel samples) per request.
    max_n: int = 16
    # Bound on the whole CPU KV budget when --max-total-tokens is not given:
    # mem_fraction_static of this many GiB (a CPU has no device memory to measure).
    cpu_kv_budget_gb: float = 4.0
    log_level: str = "info"
    # Speculative decoding (SGLang's flags). The three shape flags are given
    # together or not at all; `speculative_shape()` resolves the defaults.
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
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

    # ---- validation -------------------------------------------------------------
    def _validate(self) -> None:
        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"{flag(name)}: {why}")

        _check_types(self)
        if self.trust_remote_code:
            raise bad("trust_remote_code", "pdserve never runs remote code; "
                      "only the built-in architectures (Llama, Mistral, Qwen2, Qwen3) are supported")
        for name, choices in (("dtype", DTYPES), ("kv_cache_dtype", KV_CACHE_DTYPES),
                              ("device", DEVICES), ("attention_backend", ATTENTION_BACKENDS),
                              ("load_format", LOAD_FORMATS),
                              ("schedule_policy", SCHEDULE_POLICIES),
                              ("reasoning_parser", (None, *REASONING_PARSERS)),
                              ("tool_call_parser", (None, *TOOL_CALL_PARSERS))):
            value = getattr(self, name)
            if value not in choices:
                raise bad(name, f"invalid choice {value!r} (choose from {', '.join(c for c in choices if c)})")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise bad("device", "cuda was requested but no CUDA device is available")
        if self.tp_size < 1:
            raise bad("tp_size", f"must be >= 1, got {self.tp_size}")
        self._validate_device(bad)
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise bad("mem_fraction_static", f"must be in (0, 1), got {self.mem_fraction_static}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise bad("max_total_tokens", f"must be >= 1, got {self.max_total_tokens}")
        if self.max_running_requests < 1:
            raise bad("max_running_requests", f"must be >= 1, got {self.max_running_requests}")
        if self.max_prefill_tokens < 1:
            raise bad("max_prefill_tokens", f"must be >= 1, got {self.max_prefill_tokens}")
        if self.chunked_prefill_size != -1 and self.chunked_prefill_size < 1:
            raise bad("chunked_prefill_size", f"must be -1 (disabled) or >= 1, got {self.chunked_prefill_size}")
        if self.page_size < 1:
            raise bad("page_size", f"must be >= 1, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise bad("max_total_tokens", f"{self.max_total_tokens} is smaller than one page "
                      f"({flag('page_size')} {self.page_size})")
        if self.context_length is not None and self.context_length < 2:
            raise bad("context_length", f"must be >= 2, got {self.context_length}")
        if self.random_seed is not None and not 0 <= self.random_seed < 2**63:
            raise bad("random_seed", f"must be in [0, 2^63), got {self.random_seed}")
        if self.max_n < 1:
            raise bad("max_n", f"must be >= 1, got {self.max_n}")
        if self.cpu_kv_budget_gb <= 0:
            raise bad("cpu_kv_budget_gb", f"must be > 0, got {self.cpu_kv_budget_gb}")
        if not 0 <= self.port <= 65535:
            raise bad("port", f"must be in [0, 65535], got {self.port}")
        if self.max_request_bytes < 1024:
            raise bad("max_request_bytes", f"must be >= 1024, got {self.max_request_bytes}")
        if self.max_prompt_logprob_entries < 0:
            raise bad("max_prompt_logprob_entries", f"must be >= 0, got {self.max_prompt_logprob_entries}")
        if self.request_read_timeout <= 0:
            raise bad("request_read_timeout", f"must be > 0, got {self.request_read_timeout}")
        if not 0 < self.send_timeout < float("inf"):
            raise bad("send_timeout", f"must be > 0 and finite, got {self.send_timeout}")
        if self.graceful_shutdown_timeout < 0:
            raise bad("graceful_shutdown_timeout", f"must be >= 0, got {self.graceful_shutdown_timeout}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise bad("max_queued_requests", f"must be >= 0, got {self.max_queued_requests}")
        if self.grammar_max_bytes < 1:
            raise bad("grammar_max_bytes", f"must be >= 1, got {self.grammar_max_bytes}")
        if self.grammar_max_depth < 1:
            raise bad("grammar_max_depth", f"must be >= 1, got {self.grammar_max_depth}")
        if not 0 < self.grammar_compile_timeout < float("inf"):
            raise bad("grammar_compile_timeout", f"must be > 0 and finite, got {self.grammar_compile_timeout}")
        if self.grammar_cache_bytes < 0:
            raise bad("grammar_cache_bytes", f"must be >= 0 (0: no cache), got {self.grammar_cache_bytes}")
        if self.log_level not in ("debug", "info", "warning", "error", "critical"):
            raise bad("log_level", f"invalid choice {self.log_level!r} (debug, info, warning, error, critical)")
        if self.model_path is not None and not os.path.isdir(self.model_path):
            raise bad("model_path", f"{self.model_path!r} is not a directory")
        if self.tokenizer_path is not None and not os.path.isdir(self.tokenizer_path):
            raise bad("tokenizer_path", f"{self.tokenizer_path!r} is not a directory")
        for name in self.served_model_name:
            if not isinstance(name, str) or not name.strip():
                raise bad("served_model_name", f"names must be non-empty strings, got {name!r}")
        if self.chat_template is not None and self.chat_template not in BUILTIN_CHAT_TEMPLATES \
                and not os.path.isfile(self.chat_template):
            raise bad("chat_template", f"{self.chat_template!r} is neither a file nor a built-in template "
                      f"(built-in: {', '.join(sorted(BUILTIN_CHAT_TEMPLATES))})")
        self._validate_speculative(bad)
        self._validate_disaggregation(bad)

    def _validate_device(self, bad: Any) -> None:
        on_cuda = self.resolved_device().type == "cuda"
        backend = self.attention_backend
        if backend == "flashinfer":
            raise bad("attention_backend", "flashinfer is not wired in yet (its wrappers need a GPU run to "
                      "verify); use triton on CUDA or torch_native")
        if backend == "triton" and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise bad("attention_backend", "triton needs a CUDA device (on a CPU it runs only under "
                      "Triton's interpreter, TRITON_INTERPRET=1, which the tests use); use torch_native")
        if backend == "triton" and importlib.util.find_spec("triton") is None:
            raise bad("attention_backend", "triton is not installed (pip install triton)")
        if on_cuda and self.tp_size > 1:
            raise bad("tp_size", "tensor parallelism on CUDA is refused: pdserve's machines have one GPU, "
                      "so the NCCL path has never run (TP > 1 works on CPU)")
        if self.cuda_graph_max_bs < 1:
            raise bad("cuda_graph_max_bs", f"must be >= 1, got {self.cuda_graph_max_bs}")
        if self.use_cuda_graph() and not on_cuda:
            raise bad("enable_cuda_graph", "CUDA graphs need a CUDA device")
        if self.use_cuda_graph() and self.resolved_attention_backend() != "triton":
            raise bad("enable_cuda_graph", "CUDA graphs need --attention-backend triton")

    def _validate_disaggregation(self, bad: Any) -> None:
        for name, choices in (("disaggregation_mode", DISAGGREGATION_MODES),
                              ("disaggregation_transfer_backend", TRANSFER_BACKENDS),
                              ("disaggregation_kv_staging", STAGING_MODES)):
            value = getattr(self, name)
            if value not in choices:
                raise bad(name, f"invalid choice {value!r} (choose from {', '.join(choices)})")
        if self.disaggregation_mode != "null" and self.disaggregation_transfer_backend == "mooncake":
            try:  # a staging mode the installed transfer engine cannot serve fails here, at startup
                choose_staging(self.disaggregation_kv_staging, torch.device(self.resolved_device()),
                               mooncake_reaches_gpu_memory())
            except ValueError as exc:
                raise bad("disaggregation_kv_staging", str(exc).split(": ", 1)[1]) from None
        if not 0 <= self.disaggregation_bootstrap_port <= 65535:
            raise bad("disaggregation_bootstrap_port", f"must be in [0, 65535], got {self.disaggregation_bootstrap_port}")
        for name in ("disaggregation_bootstrap_timeout", "disaggregation_waiting_timeout",
                     "disaggregation_transfer_timeout", "disaggregation_heartbeat_interval"):
            if getattr(self, name) <= 0:
                raise bad(name, f"must be > 0, got {getattr(self, name)}")
        if self.disaggregation_heartbeat_misses < 1:
            raise bad("disaggregation_heartbeat_misses", f"must be >= 1, got {self.disaggregation_heartbeat_misses}")
        if self.disaggregation_secret is not None and self.disaggregation_secret_file is not None:
            raise bad("disaggregation_secret", f"give it or {flag('disaggregation_secret_file')}, not both")
        if self.disaggregation_secret is not None and len(self.disaggregation_secret) < 16:
            raise bad("disaggregation_secret", "must be at least 16 characters")
        if self.disaggregation_secret_file is not None and not os.path.isfile(self.disaggregation_secret_file):
            raise bad("disaggregation_secret_file", f"{self.disaggregation_secret_file!r} is not a file")
        for entry in self.disaggregation_allowed_prefill:
            host, _, port = entry.rpartition(":") if entry.count(":") == 1 else (entry, "", "")
            if not host or (port and not (port.isdigit() and 0 < int(port) <= 65535)):
                raise bad("disaggregation_allowed_prefill", f"{entry!r} is not HOST or HOST:PORT")
        if self.disaggregation_mode == "null":
            return
        if not is_loopback(self.host) and self.disaggregation_secret is None \
                and self.disaggregation_secret_file is None:
            raise bad("disaggregation_secret", f"a {self.disaggregation_mode} server on {self.host!r} (not a "
                      "loopback address) refuses to start without a shared secret: its control, bootstrap "
                      "and transfer ports would accept anyone on the network (give the same "
                      f"{flag('disaggregation_secret')} or {flag('disaggregation_secret_file')} to every "
                      "server of the deployment)")
        if self.disaggregation_transfer_backend == "nixl":
            raise bad("disaggregation_transfer_backend", "nixl is not supported yet; use mooncake")

    def _validate_speculative(self, bad: Any) -> None:
        shape = (self.speculative_num_steps, self.speculative_eagle_topk, self.speculative_num_draft_tokens)
        if self.speculative_algorithm is None:
            for name in ("speculative_draft_model_path", "speculative_num_steps", "speculative_eagle_topk",
                         "speculative_num_draft_tokens"):
                if getattr(self, name) is not None:
                    raise bad(name, f"needs {flag('speculative_algorithm')}")
            return
        if self.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
            raise bad("speculative_algorithm", f"invalid choice {self.speculative_algorithm!r} "
                      f"(choose from {', '.join(SPECULATIVE_ALGORITHMS)})")
        if self.speculative_draft_model_path is None:
            raise bad("speculative_draft_model_path", f"is required with {flag('speculative_algorithm')} "
                      f"{self.speculative_algorithm}")
        if not os.path.isdir(self.speculative_draft_model_path):
            raise bad("speculative_draft_model_path", f"{self.speculative_draft_model_path!r} is not a directory")
        if any(v is None for v in shape) and any(v is not None for v in shape):
            raise bad("speculative_num_steps", f"give {flag('speculative_num_steps')}, "
                      f"{flag('speculative_eagle_topk')} and {flag('speculative_num_draft_tokens')} together "
                      "(or none of them for the defaults)")
        if shape[0] is not None:
            steps, topk, tokens = shape
            assert steps is not None and topk is not None and tokens is not None
            if steps < 1:
                raise bad("speculative_num_steps", f"must be >= 1, got {steps}")
            if topk < 1:
                raise bad("speculative_eagle_topk", f"must be >= 1, got {topk}")
            if tokens < 2:
                raise bad("speculative_num_draft_tokens", f"must be >= 2, got {tokens}")
            pool = topk + (steps - 1) * topk * topk
            if topk > 1 and tokens - 1 > pool:
                raise bad("speculative_num_draft_tokens", f"{tokens} needs {tokens - 1} draft tokens but "
                          f"{steps} steps of top-{topk} propose at most {pool}")
        if self.tp_size > 1:
            raise bad("speculative_algorithm", "speculative decoding with --tp-size > 1 is not supported yet")

    def speculative_shape(self, architecture: str) -> tuple[int, int, int]:
        """(num_steps, eagle_topk, num_draft_tokens): the flags, or SGLang's per-model
        defaults ((5, 4, 8) for Llama targets, the chain (3, 1, 4) otherwise).
        Top-k 1 is a chain: it forces num_draft_tokens = num_steps + 1."""
        if self.speculative_num_steps is None:
            steps, topk, tokens = (5, 4, 8) if architecture == "LlamaForCausalLM" else (3, 1, 4)
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

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_attention_backend(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        on_cuda = self.resolved_device().type == "cuda"
        return "triton" if on_cuda and importlib.util.find_spec("triton") is not None else "torch_native"

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
    def from_cli(cls, argv: Sequence[str] | None = None) -> "ServerArgs":
        parser = _RaisingParser(prog="pdserve", description="pdserve server options", allow_abbrev=False)
        cls.add_cli_args(parser)
        # Paths may come as os.PathLike (argparse itself only handles str).
        ns = parser.parse_args([os.fspath(a) if isinstance(a, os.PathLike) else a for a in argv]
                               if argv is not None else None)
        return cls.from_namespace(ns)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> "ServerArgs":
        names = {f.name for f in fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in vars(ns).items()
                      if k in names and not (k in _REPEATABLE and v is None)})


def _int_or_none(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def _float_or_none(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


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
_TYPE_CHECKS: dict[str, tuple[type, ...]] = {
    "int": (int,), "float": (int, float), "str": (str,), "bool": (bool,),
    "int | None": (int, type(None)), "float | None": (int, float, type(None)),
    "str | None": (str, type(None)), "tuple[str, ...]": (tuple,),
}


def _check_types(args: ServerArgs) -> None:
    for f in fields(args):
        value = getattr(args, f.name)
        allowed = _TYPE_CHECKS.get(str(f.type))
        if allowed is None:
            continue
        # bool is an int subclass; refuse it where a number is expected.
        if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, allowed):
            raise ConfigError(f"{flag(f.name)}: expected {f.type}, got {type(value).__name__} {value!r}")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _RaisingParser(argparse.ArgumentParser):
    """argparse exits the process on error; callers of from_cli want an exception."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)
