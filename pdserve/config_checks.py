"""Validating a ``ServerArgs`` (``pdserve/config.py``): what each flag accepts, and the
combinations refused at startup, each with a ``ConfigError`` naming the flag. Kept
apart from the dataclass so the list of fields reads on its own; the choices come
from the registries (attention backends, transfer engines, parsers)."""

from __future__ import annotations

import ipaddress
import json
import os
from dataclasses import fields
from typing import TYPE_CHECKING, Any

import torch

from pdserve.chat_templates import BUILTIN_CHAT_TEMPLATES
from pdserve.disagg.engines import transfer_engine_names, unavailable_reason
from pdserve.disagg.staging import STAGING_MODES, staging_for_engine
from pdserve.model import attention_backends
from pdserve.server.reasoning import REASONING_PARSERS
from pdserve.server.tool_calls import TOOL_CALL_PARSERS

if TYPE_CHECKING:
    from pdserve.config import ServerArgs


class ConfigError(ValueError):
    """An invalid server option; the message names the flag."""


DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2")  # fp8: model/kv_quant.py
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "dummy")
ATTENTION_BACKENDS = ("auto", *attention_backends.backend_names())  # the registry's (model/attention_backends.py)
SCHEDULE_POLICIES = ("fcfs", "lpm")
# NEXTN is SGLang's name for EAGLE with a checkpoint's own MTP layer: an alias of EAGLE
# (ServerArgs turns it into EAGLE, as SGLang's server args do).
SPECULATIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN")
DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = transfer_engine_names()  # the registry's (pdserve/disagg/engines.py)
# Fields that hold a filesystem path: any os.PathLike is accepted and kept as str.
PATH_FIELDS = ("model_path", "tokenizer_path", "speculative_draft_model_path", "disaggregation_secret_file",
               "admin_api_key_file", "chat_template")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")



def validate(args: "ServerArgs") -> None:
    """Raise ConfigError naming the flag of the first invalid value."""
    def bad(name: str, why: str) -> ConfigError:
        return ConfigError(f"{flag(name)}: {why}")

    _check_types(args)
    if args.trust_remote_code:
        from pdserve.model.registry import supported_architectures
        raise bad("trust_remote_code", "pdserve never runs remote code; only the built-in architectures "
                  f"({', '.join(supported_architectures())}) are supported")
    for name, choices in (("dtype", DTYPES), ("kv_cache_dtype", KV_CACHE_DTYPES),
                          ("device", DEVICES), ("attention_backend", ATTENTION_BACKENDS),
                          ("load_format", LOAD_FORMATS),
                          ("schedule_policy", SCHEDULE_POLICIES),
                          ("reasoning_parser", (None, *REASONING_PARSERS)),
                          ("tool_call_parser", (None, *TOOL_CALL_PARSERS))):
        value = getattr(args, name)
        if value not in choices:
            raise bad(name, f"invalid choice {value!r} (choose from {', '.join(c for c in choices if c)})")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise bad("device", "cuda was requested but no CUDA device is available")
    if args.tp_size < 1:
        raise bad("tp_size", f"must be >= 1, got {args.tp_size}")
    _check_device(args, bad)
    _check_nodes(args, bad)
    if not 0.0 < args.mem_fraction_static < 1.0:
        raise bad("mem_fraction_static", f"must be in (0, 1), got {args.mem_fraction_static}")
    if args.max_total_tokens is not None and args.max_total_tokens < 1:
        raise bad("max_total_tokens", f"must be >= 1, got {args.max_total_tokens}")
    if args.max_running_requests < 1:
        raise bad("max_running_requests", f"must be >= 1, got {args.max_running_requests}")
    if args.max_prefill_tokens < 1:
        raise bad("max_prefill_tokens", f"must be >= 1, got {args.max_prefill_tokens}")
    if args.chunked_prefill_size != -1 and args.chunked_prefill_size < 1:
        raise bad("chunked_prefill_size", f"must be -1 (disabled) or >= 1, got {args.chunked_prefill_size}")
    if args.page_size < 1:
        raise bad("page_size", f"must be >= 1, got {args.page_size}")
    if args.max_total_tokens is not None and args.max_total_tokens < args.page_size:
        raise bad("max_total_tokens", f"{args.max_total_tokens} is smaller than one page "
                  f"({flag('page_size')} {args.page_size})")
    if args.context_length is not None and args.context_length < 2:
        raise bad("context_length", f"must be >= 2, got {args.context_length}")
    if args.random_seed is not None and not 0 <= args.random_seed < 2**63:
        raise bad("random_seed", f"must be in [0, 2^63), got {args.random_seed}")
    if args.max_n < 1:
        raise bad("max_n", f"must be >= 1, got {args.max_n}")
    if args.cpu_kv_budget_gb <= 0:
        raise bad("cpu_kv_budget_gb", f"must be > 0, got {args.cpu_kv_budget_gb}")
    if args.decode_log_interval < 1:
        raise bad("decode_log_interval", f"must be >= 1 (decode steps between two log lines), "
                  f"got {args.decode_log_interval}")
    if not 0 <= args.port <= 65535:
        raise bad("port", f"must be in [0, 65535], got {args.port}")
    if args.max_request_bytes < 1024:
        raise bad("max_request_bytes", f"must be >= 1024, got {args.max_request_bytes}")
    if args.max_prompt_logprob_entries < 0:
        raise bad("max_prompt_logprob_entries", f"must be >= 0, got {args.max_prompt_logprob_entries}")
    if args.request_read_timeout <= 0:
        raise bad("request_read_timeout", f"must be > 0, got {args.request_read_timeout}")
    if not 0 < args.send_timeout < float("inf"):
        raise bad("send_timeout", f"must be > 0 and finite, got {args.send_timeout}")
    if args.graceful_shutdown_timeout < 0:
        raise bad("graceful_shutdown_timeout", f"must be >= 0, got {args.graceful_shutdown_timeout}")
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        raise bad("max_queued_requests", f"must be >= 0, got {args.max_queued_requests}")
    if args.grammar_max_bytes < 1:
        raise bad("grammar_max_bytes", f"must be >= 1, got {args.grammar_max_bytes}")
    if args.grammar_max_depth < 1:
        raise bad("grammar_max_depth", f"must be >= 1, got {args.grammar_max_depth}")
    if not 0 < args.grammar_compile_timeout < float("inf"):
        raise bad("grammar_compile_timeout", f"must be > 0 and finite, got {args.grammar_compile_timeout}")
    if args.grammar_cache_bytes < 0:
        raise bad("grammar_cache_bytes", f"must be >= 0 (0: no cache), got {args.grammar_cache_bytes}")
    if args.log_level not in ("debug", "info", "warning", "error", "critical"):
        raise bad("log_level", f"invalid choice {args.log_level!r} (debug, info, warning, error, critical)")
    if args.model_path is not None and not os.path.isdir(args.model_path):
        raise bad("model_path", f"{args.model_path!r} is not a directory")
    if args.tokenizer_path is not None and not os.path.isdir(args.tokenizer_path):
        raise bad("tokenizer_path", f"{args.tokenizer_path!r} is not a directory")
    for name in args.served_model_name:
        if not isinstance(name, str) or not name.strip():
            raise bad("served_model_name", f"names must be non-empty strings, got {name!r}")
    if args.chat_template is not None and args.chat_template not in BUILTIN_CHAT_TEMPLATES \
            and not os.path.isfile(args.chat_template):
        raise bad("chat_template", f"{args.chat_template!r} is neither a file nor a built-in template "
                  f"(built-in: {', '.join(sorted(BUILTIN_CHAT_TEMPLATES))})")
    _check_speculative(args, bad)
    _check_disaggregation(args, bad)

def _check_device(args: "ServerArgs", bad: Any) -> None:
    device_type = args.resolved_device().type
    on_cuda = device_type == "cuda"
    if args.attention_backend != "auto":  # what the backend's class declares (devices, package)
        why = attention_backends.refusal(args.attention_backend, device_type)
        if why is not None:
            raise bad("attention_backend", why)
    if on_cuda and args.tp_size > 1:
        raise bad("tp_size", "tensor parallelism on CUDA is refused: pdserve's machines have one GPU, "
                  "so the NCCL path has never run (TP > 1 works on CPU)")
    if args.cuda_graph_max_bs < 1:
        raise bad("cuda_graph_max_bs", f"must be >= 1, got {args.cuda_graph_max_bs}")
    if args.use_cuda_graph() and not on_cuda:
        raise bad("enable_cuda_graph", "CUDA graphs need a CUDA device")
    if args.use_cuda_graph() and not args._attention_backend_supports("supports_cuda_graphs"):
        raise bad("enable_cuda_graph", "CUDA graphs need --attention-backend "
                  + " or ".join(attention_backends.backends_supporting("supports_cuda_graphs")))

def _check_nodes(args: "ServerArgs", bad: Any) -> None:
    """--nnodes / --node-rank / --dist-init-addr / --dist-timeout (multi-node TP)."""
    if args.nnodes < 1:
        raise bad("nnodes", f"must be >= 1, got {args.nnodes}")
    if args.tp_size % args.nnodes:
        raise bad("nnodes", f"{args.nnodes} does not divide {flag('tp_size')} {args.tp_size} "
                  "(every node runs the same number of TP ranks)")
    if not 0 <= args.node_rank < args.nnodes:
        raise bad("node_rank", f"must be in [0, {args.nnodes}) for {flag('nnodes')} {args.nnodes}, "
                  f"got {args.node_rank}")
    if args.dist_timeout is not None and not 0 < args.dist_timeout < float("inf"):
        raise bad("dist_timeout", f"must be > 0 and finite, got {args.dist_timeout}")
    if args.dist_init_addr is None:
        if args.nnodes > 1:
            raise bad("dist_init_addr", f"is required with {flag('nnodes')} {args.nnodes}: the HOST:PORT of "
                      "node 0 where the TP group meets (the same on every node)")
        return
    try:
        host, _ = parse_host_port(args.dist_init_addr)
    except ValueError as exc:
        raise bad("dist_init_addr", str(exc)) from None
    if args.nnodes > 1 and args.disaggregation_mode != "null" and is_loopback(args.host) \
            and not is_loopback(host):
        # The bootstrap server and every rank's transfer endpoint listen on --host: a
        # loopback one cannot be reached from the other nodes.
        raise bad("host", f"{args.host!r} is a loopback address, but this {args.disaggregation_mode} "
                  f"instance spans nodes ({flag('dist_init_addr')} {args.dist_init_addr}): give an "
                  "address the other nodes and the peer servers can reach")


def parse_host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPv6]:PORT`` as (host, port); ValueError saying what is wrong."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{text!r}: write an IPv6 address in brackets ([::1]:PORT)")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{text!r} is not HOST:PORT (a port in [1, 65535])")
    if any(c.isspace() or c in "/@?#" for c in host):
        raise ValueError(f"{text!r}: {host!r} is not a hostname or an IP address")
    return host, int(port)


def _check_disaggregation(args: "ServerArgs", bad: Any) -> None:
    for name, choices in (("disaggregation_mode", DISAGGREGATION_MODES),
                          ("disaggregation_transfer_backend", TRANSFER_BACKENDS),
                          ("disaggregation_kv_staging", STAGING_MODES)):
        value = getattr(args, name)
        if value not in choices:
            raise bad(name, f"invalid choice {value!r} (choose from {', '.join(choices)})")
    backend_refused = unavailable_reason(args.disaggregation_transfer_backend)
    if args.disaggregation_mode != "null" and backend_refused is None:
        try:  # a staging mode the installed transfer engine cannot serve fails here, at startup
            staging_for_engine(args.disaggregation_kv_staging, torch.device(args.resolved_device()),
                               args.disaggregation_transfer_backend)
        except ValueError as exc:
            raise bad("disaggregation_kv_staging", str(exc).split(": ", 1)[1]) from None
    if not 0 <= args.disaggregation_bootstrap_port <= 65535:
        raise bad("disaggregation_bootstrap_port", f"must be in [0, 65535], got {args.disaggregation_bootstrap_port}")
    for name in ("disaggregation_bootstrap_timeout", "disaggregation_waiting_timeout",
                 "disaggregation_transfer_timeout", "disaggregation_heartbeat_interval"):
        if getattr(args, name) <= 0:
            raise bad(name, f"must be > 0, got {getattr(args, name)}")
    if args.disaggregation_kv_landing_mib is not None and args.disaggregation_kv_landing_mib < 0:
        raise bad("disaggregation_kv_landing_mib", f"must be >= 0 (0: no landing area), got "
                  f"{args.disaggregation_kv_landing_mib}")
    if args.disaggregation_kv_landing_min_run < 1:
        raise bad("disaggregation_kv_landing_min_run", f"must be >= 1, got {args.disaggregation_kv_landing_min_run}")
    if args.disaggregation_heartbeat_misses < 1:
        raise bad("disaggregation_heartbeat_misses", f"must be >= 1, got {args.disaggregation_heartbeat_misses}")
    if args.disaggregation_secret is not None and args.disaggregation_secret_file is not None:
        raise bad("disaggregation_secret", f"give it or {flag('disaggregation_secret_file')}, not both")
    if args.disaggregation_secret is not None and len(args.disaggregation_secret) < 16:
        raise bad("disaggregation_secret", "must be at least 16 characters")
    if args.disaggregation_secret_file is not None and not os.path.isfile(args.disaggregation_secret_file):
        raise bad("disaggregation_secret_file", f"{args.disaggregation_secret_file!r} is not a file")
    if args.admin_api_key is not None and args.admin_api_key_file is not None:
        raise bad("admin_api_key", f"give it or {flag('admin_api_key_file')}, not both")
    if args.admin_api_key_file is not None and not os.path.isfile(args.admin_api_key_file):
        raise bad("admin_api_key_file", f"{args.admin_api_key_file!r} is not a file")
    for entry in args.disaggregation_allowed_prefill:
        host, _, port = entry.rpartition(":") if entry.count(":") == 1 else (entry, "", "")
        if not host or (port and not (port.isdigit() and 0 < int(port) <= 65535)):
            raise bad("disaggregation_allowed_prefill", f"{entry!r} is not HOST or HOST:PORT")
    if args.disaggregation_mode == "null":
        return
    if not is_loopback(args.host) and args.disaggregation_secret is None \
            and args.disaggregation_secret_file is None:
        raise bad("disaggregation_secret", f"a {args.disaggregation_mode} server on {args.host!r} (not a "
                  "loopback address) refuses to start without a shared secret: its control, bootstrap "
                  "and transfer ports would accept anyone on the network (give the same "
                  f"{flag('disaggregation_secret')} or {flag('disaggregation_secret_file')} to every "
                  "server of the deployment)")
    if backend_refused is not None:  # registered, not available yet
        raise bad("disaggregation_transfer_backend", backend_refused)

def _check_speculative(args: "ServerArgs", bad: Any) -> None:
    shape = (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens)
    if args.speculative_algorithm is None:
        for name in ("speculative_draft_model_path", "speculative_num_steps", "speculative_eagle_topk",
                     "speculative_num_draft_tokens"):
            if getattr(args, name) is not None:
                raise bad(name, f"needs {flag('speculative_algorithm')}")
        return
    if args.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
        raise bad("speculative_algorithm", f"invalid choice {args.speculative_algorithm!r} "
                  f"(choose from {', '.join(SPECULATIVE_ALGORITHMS)})")
    if args.speculative_draft_model_path is None:  # default_draft_model_path found none: say why
        default_draft_model_path(args.model_path, args.speculative_algorithm)
    if not os.path.isdir(args.speculative_draft_model_path):
        raise bad("speculative_draft_model_path", f"{args.speculative_draft_model_path!r} is not a directory")
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
    if not args._attention_backend_supports("supports_draft_tree"):
        raise bad("attention_backend", f"{args.resolved_attention_backend()} cannot run the "
                  f"{args.speculative_algorithm} draft; use "
                  + " or ".join(attention_backends.backends_supporting("supports_draft_tree")))


# The draft heads shipped with the embedded demo model (pdserve/assets), by algorithm.
DEMO_DRAFTS = {"EAGLE": "demo-eagle", "EAGLE3": "demo-eagle3"}


def default_draft_model_path(model_path: str | None, algorithm: str) -> str:
    """The draft of ``--speculative-algorithm ALGORITHM`` without --speculative-draft-model-path.
    One rule for every entry point (``ServerArgs`` applies it: `pdserve serve`, `pdserve up`,
    `pdserve.generate` and ``Engine`` agree):

    1. the checkpoint's own multi-token-prediction layer (``num_nextn_predict_layers`` in
       its config), as SGLang drafts for GLM-4.5: the model path itself is the draft
       (speculative/draft_config.py reads it as the "mtp" layout), for an architecture
       pdserve drafts with NextN layers for (Glm4MoeForCausalLM), with EAGLE; refused,
       saying why, for another architecture or EAGLE3;
    2. else a draft shipped with the model: the embedded demo model's EAGLE / EAGLE3 heads;
    3. else a ConfigError naming --speculative-draft-model-path.
    """
    def refuse(why: str) -> ConfigError:
        return ConfigError(f"{flag('speculative_draft_model_path')}: is required with "
                           f"{flag('speculative_algorithm')} {algorithm}: {why}")

    nextn = _nextn_layers(model_path)
    if nextn:
        assert model_path is not None
        from pdserve.speculative.draft_config import mtp_architectures

        archs = _config(model_path).get("architectures") or []
        mtp = mtp_architectures()
        if not any(a in mtp for a in archs):
            raise refuse(f"{model_path} has multi-token-prediction (NextN) layers (num_nextn_predict_layers = "
                         f"{nextn}), but pdserve drafts with them only for {', '.join(mtp)}, not {archs} "
                         "(DeepSeek-V3 is not a supported architecture); give an EAGLE or EAGLE3 head")
        if algorithm not in ("EAGLE", "NEXTN"):
            raise refuse(f"the checkpoint's multi-token-prediction (NextN) layers (num_nextn_predict_layers = "
                         f"{nextn}) draft with --speculative-algorithm EAGLE (or NEXTN), not {algorithm}; "
                         "give an EAGLE3 head")
        return model_path
    if algorithm == "NEXTN":
        raise refuse(f"NEXTN drafts with the checkpoint's own multi-token-prediction layers, and "
                     f"{model_path or 'the model'} has none (num_nextn_predict_layers)")
    demo = _demo_asset("demo")
    if demo is not None and (model_path is None or os.path.realpath(model_path) == os.path.realpath(demo)):
        head = _demo_asset(DEMO_DRAFTS[algorithm])
        if head is not None:
            return head
    raise refuse(f"{model_path or 'the model'} ships no draft head (only the embedded demo model does) and has no "
                 "multi-token-prediction layers (num_nextn_predict_layers); give an EAGLE or EAGLE3 head")


def _nextn_layers(model_path: str | None) -> int:
    """The checkpoint's ``num_nextn_predict_layers`` (0 when absent or unreadable: the
    model's own checks refuse an unreadable config)."""
    if model_path is None:
        return 0
    config = _config(model_path)
    value = config.get("num_nextn_predict_layers", (config.get("text_config") or {}).get("num_nextn_predict_layers"))
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _config(model_path: str) -> dict[str, Any]:
    """The checkpoint's config.json ({} when unreadable: the model's own checks say why)."""
    try:
        with open(os.path.join(model_path, "config.json")) as fh:
            config = json.load(fh)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _demo_asset(name: str) -> str | None:
    try:
        from pdserve import assets
        return str(assets.path(name))
    except (ImportError, FileNotFoundError):
        return None


_TYPE_CHECKS: dict[str, tuple[type, ...]] = {
    "int": (int,), "float": (int, float), "str": (str,), "bool": (bool,),
    "int | None": (int, type(None)), "float | None": (int, float, type(None)),
    "str | None": (str, type(None)), "tuple[str, ...]": (tuple,),
}


def _check_types(args: "ServerArgs") -> None:
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
