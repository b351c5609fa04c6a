"""Attention backends by name (``--attention-backend``), each imported only when used.

A backend is a class that declares what it can do as class attributes
(``BackendInfo``); config validation, the model runner and the EAGLE worker ask
those, never the name. Adding a backend is one module holding its class and one
line in ``BACKENDS``.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, cast, overload

from pdserve.lazy import load_target

if TYPE_CHECKING:
    import torch

    from pdserve.model.decode_mirror import DecodeKVMirror
    from pdserve.model.forward_context import ForwardContext, KVStore, RowLayout, TreeMasks

# name -> "module:Class", imported on first use (the flag lists them in this order).
BACKENDS: dict[str, str] = {
    "torch_native": "pdserve.model.attention:TorchNativeAttention",
    "triton": "pdserve.model.triton_backend:TritonAttention",
}
# SGLang's kernel-library backends, accepted so its command lines run as written (the
# first seed passes `--attention-backend fa3`): pdserve ships none of these libraries, so
# each stands for ``auto`` (pdserve's best backend on the device), and the server says so
# at startup (``stand_in_note``). name -> what SGLang means by it.
SGLANG_STAND_INS: dict[str, str] = {
    "fa3": "FlashAttention-3", "fa4": "FlashAttention-4", "flashinfer": "FlashInfer",
    "flashmla": "FlashMLA", "cutlass_mla": "CUTLASS MLA", "trtllm_mha": "TensorRT-LLM MHA",
    "trtllm_mla": "TensorRT-LLM MLA", "aiter": "AITER",
}


class BackendInfo:
    """What a backend class declares (the defaults promise nothing)."""
    name: ClassVar[str] = ""
    # Device types it runs on natively; ``auto`` chooses among the backends that run on
    # the device (and are installed) the one with the highest ``auto_priority``.
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    auto_priority: ClassVar[int] = 0
    # The package it imports, checked at startup (before anything is built).
    requires_package: ClassVar[str | None] = None
    # Its plans read no host values: decode forwards and draft rounds can be captured
    # in CUDA graphs.
    supports_cuda_graphs: ClassVar[bool] = False
    # It runs the EAGLE draft's forwards (``DraftAttentionBackend``).
    supports_draft_tree: ClassVar[bool] = False
    # It serves plain decode steps from a DecodeKVMirror (constructor argument ``mirror``).
    supports_decode_mirror: ClassVar[bool] = False

    @classmethod
    def device_refusal(cls, device_type: str) -> str | None:
        """Why it cannot run on ``device_type`` (None: it can); the text follows the flag."""
        if device_type in cls.devices:
            return None
        return f"{cls.name} runs on {' or '.join(cls.devices)} only, not {device_type}"

    @classmethod
    def installed(cls) -> bool:
        return cls.requires_package is None or importlib.util.find_spec(cls.requires_package) is not None


class AttentionBackend(Protocol):
    """What a model's attention layers call: ``context`` once per forward (planning
    every layer's metadata), ``forward`` once per layer."""
    name: str
    supports_cuda_graphs: bool

    def context(self, req_to_token: torch.Tensor, layout: RowLayout,
                tree_masks: TreeMasks | None = None,
                positions: torch.Tensor | None = None) -> ForwardContext: ...

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor: ...


class DraftAttentionBackend(AttentionBackend, Protocol):
    """What the EAGLE draft also calls (backends with ``supports_draft_tree``)."""

    def draft_extend_context(self, req_to_token: torch.Tensor, layout: RowLayout) -> ForwardContext: ...

    def plan_tree_round(self, req_to_token: torch.Tensor, rows: torch.Tensor, kv_lens: torch.Tensor,
                        longest: int) -> Any: ...

    def tree_step_context(self, tree_round: Any, branch_slots: torch.Tensor,
                          positions: torch.Tensor) -> ForwardContext: ...


def backend_names() -> tuple[str, ...]:
    """Every name ``--attention-backend`` accepts besides ``auto``."""
    return (*BACKENDS, *SGLANG_STAND_INS)


def resolve(name: str, device_type: str) -> str:
    """The backend ``--attention-backend name`` runs: ``auto`` and SGLang's kernel
    libraries choose for the device (``auto_backend``), pdserve's own names are themselves."""
    return auto_backend(device_type) if name == "auto" or name in SGLANG_STAND_INS else name


def stand_in_note(name: str, device_type: str) -> str | None:
    """The startup line for a stand-in name (None for pdserve's own names and ``auto``)."""
    if name not in SGLANG_STAND_INS:
        return None
    return (f"--attention-backend {name}: pdserve has no {SGLANG_STAND_INS[name]} kernels; running "
            f"{auto_backend(device_type)}, its best backend on {device_type} (as --attention-backend auto)")


def backend_class(name: str) -> type[BackendInfo]:
    """The backend class called ``name``, imported now. ValueError for a stand-in name
    (``resolve`` it first) or an unknown one (the message lists the known ones)."""
    if name in SGLANG_STAND_INS:
        raise ValueError(f"{name} stands for pdserve's best backend on the device: resolve() it first")
    path = BACKENDS.get(name)
    if path is None:
        raise ValueError(f"unknown attention backend {name!r} (choose from {', '.join(backend_names())})")
    cls = load_target(path)
    assert cls.name == name, f"{path} is registered as {name!r} but calls itself {cls.name!r}"
    return cast("type[BackendInfo]", cls)


def refusal(name: str, device_type: str) -> str | None:
    """Why ``--attention-backend name`` cannot serve on ``device_type`` (None: it can)."""
    if name in SGLANG_STAND_INS:
        return None  # it runs as auto
    cls = backend_class(name)
    why = cls.device_refusal(device_type)
    if why is not None:
        return why
    if not cls.installed():
        return f"{name} is not installed (pip install {cls.requires_package})"
    return None


def auto_backend(device_type: str) -> str:
    """``auto``: of the installed backends that run on the device, the preferred one."""
    usable = [c for c in map(backend_class, BACKENDS) if device_type in c.devices and c.installed()]
    if not usable:
        raise ValueError(f"no attention backend runs on {device_type}")
    return max(usable, key=lambda c: c.auto_priority).name


def backends_supporting(capability: str) -> tuple[str, ...]:
    """The registered backends whose class attribute ``capability`` is true."""
    return tuple(name for name in BACKENDS if getattr(backend_class(name), capability))


@overload
def create_backend(name: str, kv_pool: KVStore, num_heads: int, num_kv_heads: int, head_dim: int, *,
                   mirror: DecodeKVMirror | None = None, draft: Literal[False] = False) -> AttentionBackend: ...


@overload
def create_backend(name: str, kv_pool: KVStore, num_heads: int, num_kv_heads: int, head_dim: int, *,
                   mirror: None = None, draft: Literal[True]) -> DraftAttentionBackend: ...


def create_backend(name: str, kv_pool: KVStore, num_heads: int, num_kv_heads: int, head_dim: int, *,
                   mirror: DecodeKVMirror | None = None, draft: bool = False) -> AttentionBackend:
    """Backend ``name`` over ``kv_pool``: the target's (with its decode ``mirror``, if
    any) or, with ``draft``, the EAGLE draft's."""
    cls = backend_class(name)
    if draft and not cls.supports_draft_tree:
        raise ValueError(f"--attention-backend {name} cannot run the EAGLE draft (use "
                         f"{' or '.join(backends_supporting('supports_draft_tree'))})")
    if mirror is not None and not cls.supports_decode_mirror:
        raise ValueError(f"--attention-backend {name} cannot serve decode from a KV mirror")
    extra = {"mirror": mirror} if mirror is not None else {}
    return cast("AttentionBackend", cast(Any, cls)(kv_pool, num_heads, num_kv_heads, head_dim, **extra))
