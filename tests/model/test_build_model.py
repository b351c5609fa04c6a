"""`build_model`: models are constructed without storage, materialised on the device in
their dtype and filled from the checkpoint one tensor at a time. The result equals the
old path (fp32 on the host, loaded, then moved and cast) bit for bit; nothing is ever
allocated in fp32 for a bf16 model; shards stream; the strict checks are unchanged.
Also the TP group's device / host collectives and the per-rank `set_device`."""

from __future__ import annotations

import json
import shutil
import weakref
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import pdserve.model.loader as loader_mod
from pdserve.config import ServerArgs
from pdserve.model.layers import LMHead, WeightShapeError
from pdserve.model.loader import WeightLoadError, build_model, load_weights, materialize
from pdserve.model.model_config import ModelConfig
from pdserve.model.parallel import TPGroup, bind_device
from pdserve.model.registry import model_class
from pdserve.model.runner import ModelRunner
from pdserve.speculative.draft_model import DraftConfig, EagleDraftModel
from pdserve.testing import build_random_draft

pytestmark = pytest.mark.fast

CPU = torch.device("cpu")
ARCHS = ["llama_gqa", "llama_tied", "qwen2", "qwen3"]


def factory(model_dir: Path, tp: TPGroup = TPGroup()) -> Callable[[], nn.Module]:
    cfg = ModelConfig.from_dir(model_dir)
    return lambda: model_class(cfg)(cfg, tp)


def old_path(model_dir: Path, dtype: torch.dtype) -> nn.Module:
    """What ModelRunner did before: fp32 on the host, loaded, then moved and cast."""
    model = factory(model_dir)()
    load_weights(model, model_dir)
    return model.to(device=CPU, dtype=dtype)


def assert_same_params(got: nn.Module, want: nn.Module) -> None:
    g, w = dict(got.named_parameters()), dict(want.named_parameters())
    assert g.keys() == w.keys()
    for name, p in g.items():
        assert p.dtype == w[name].dtype and p.device == w[name].device, name
        assert torch.equal(p, w[name]), name


def converted(src: Path, dst: Path, dtype: torch.dtype) -> Path:
    """A copy of the checkpoint `src` with its tensors stored in `dtype`."""
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    save_file({k: v.to(dtype) for k, v in state.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def edited(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    edit(state)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def sharded(src: Path, dst: Path) -> Path:
    """`src` as a 2-shard checkpoint, tensors interleaved (fused groups span both shards)."""
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    names = sorted(state)
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {}
    for fname, part in zip(files, (names[0::2], names[1::2])):
        save_file({n: state[n] for n in part}, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


class Allocations(TorchDispatchMode):
    """Every tensor an aten op returns (factories included): (op, device type, dtype, numel)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str, torch.dtype, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.seen.append((str(func), t.device.type, t.dtype, t.numel()))
        return out

    def fp32_on_host(self) -> list[tuple[str, str, torch.dtype, int]]:
        return [s for s in self.seen if s[1] != "meta" and s[2] == torch.float32]


# ---- equality with the old path and the checkpoint ---------------------------------------------
@pytest.mark.parametrize("name", ARCHS)
def test_fp32_bit_identical_to_old_path(model_dirs, name):
    d = model_dirs(name)
    model = build_model(factory(d), d, CPU, torch.float32)
    assert_same_params(model, old_path(d, torch.float32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ARCHS)
def test_half_dtypes_equal_checkpoint_cast(model_dirs, name, dtype):
    d = model_dirs(name)
    model = build_model(factory(d), d, CPU, dtype)
    for pname, p in model.named_parameters():
        assert p.dtype == dtype and p.device == CPU and not p.is_meta, pname
    assert_same_params(model, old_path(d, dtype))
    # and against the checkpoint itself, fused tensors included
    ckpt = load_file(str(d / "model.safetensors"))
    assert torch.equal(model.model.embed_tokens.weight, ckpt["model.embed_tokens.weight"].to(dtype))
    attn = "model.layers.1.self_attn."
    qkv = torch.cat([ckpt[attn + f"{x}_proj.weight"] for x in "qkv"]).to(dtype)
    assert torch.equal(model.model.layers[1].self_attn.qkv_proj.weight, qkv)
    head = ckpt["model.embed_tokens.weight" if name == "llama_tied" else "lm_head.weight"]
    assert torch.equal(model.lm_head.weight, head.to(dtype))


def test_weight_loaders_survive_materialisation(model_dirs):
    """Each parameter keeps its object and its weight_loader, whose closure writes into it
    (plain to_empty would leave loaders writing into the meta tensors: a silent no-op)."""
    d = model_dirs("llama_gqa")
    with torch.device("meta"):
        model = factory(d)()
    before = {n: p for n, p in model.named_parameters()}
    materialize(model, CPU, torch.bfloat16)
    for n, p in model.named_parameters():
        assert p is before[n] and hasattr(p, "weight_loader") and p.device == CPU and p.dtype == torch.bfloat16
    norm = model.model.norm.weight
    norm.weight_loader(torch.full(tuple(norm.shape), 3.0), None)
    assert bool((norm == 3).all())


def test_materialize_refuses_buffers_and_materialised_params():
    class WithBuffer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("table", torch.arange(4.0), persistent=False)
    with torch.device("meta"):
        m = WithBuffer()
    with pytest.raises(TypeError, match="table"):
        materialize(m, CPU, torch.float32)
    with pytest.raises(TypeError, match="meta"):
        materialize(nn.Linear(2, 2), CPU, torch.float32)


# ---- memory: nothing in fp32, construction allocates nothing, shards stream ----------------------
def test_bf16_build_allocates_no_fp32_and_constructs_on_meta(model_dirs, tmp_path):
    d = converted(model_dirs("qwen2"), tmp_path / "bf16", torch.bfloat16)
    make = factory(d)
    during_construction: list[tuple[str, str, torch.dtype, int]] = []
    rec = Allocations()

    def checked_factory() -> nn.Module:
        n = len(rec.seen)
        model = make()
        during_construction.extend(rec.seen[n:])
        assert all(p.is_meta for p in model.parameters())
        return model

    with rec:
        model = build_model(checked_factory, d, CPU, torch.bfloat16)
    assert during_construction, "the recorder sees construction"
    assert {dev for _, dev, _, _ in during_construction} == {"meta"}, "construction allocated storage"
    assert rec.fp32_on_host() == []
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    # The recorder does catch the old path's fp32 host model.
    with Allocations() as old:
        factory(d)()
    biggest = max(p.numel() for p in model.parameters())
    assert any(n == biggest for _, _, _, n in old.fp32_on_host())


def test_sharded_checkpoint_streams_one_tensor_at_a_time(model_dirs, tmp_path, monkeypatch):
    base = model_dirs("llama_gqa")
    d = sharded(base, tmp_path / "sharded")
    real_open = loader_mod.safe_open
    events: list[str] = []
    alive: list[weakref.ref] = []
    fetched: list[str] = []

    class Counting:
        def __init__(self, path: str, **kw: Any) -> None:
            self.path, self.inner = path, real_open(path, **kw)

        def __enter__(self) -> "Counting":
            events.append("open")
            self.f = self.inner.__enter__()
            return self

        def __exit__(self, *exc: Any) -> Any:
            events.append("close")
            return self.inner.__exit__(*exc)

        def keys(self) -> list[str]:
            return list(self.f.keys())

        def get_tensor(self, name: str) -> torch.Tensor:
            assert [r for r in alive if r() is not None] == [], "an earlier checkpoint tensor is still alive"
            t = self.f.get_tensor(name)
            alive.append(weakref.ref(t))
            fetched.append(name)
            return t

    monkeypatch.setattr(loader_mod, "safe_open", Counting)
    model = build_model(factory(d), d, CPU, torch.bfloat16)
    assert events == ["open", "close", "open", "close"]  # one shard open at a time
    assert sorted(fetched) == sorted(load_file(str(base / "model.safetensors")))  # each read once
    monkeypatch.setattr(loader_mod, "safe_open", real_open)
    assert_same_params(model, build_model(factory(base), base, CPU, torch.bfloat16))


# ---- strict checks ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_missing_tensor_raises(model_dirs, tmp_path, dtype):
    name = "model.layers.1.self_attn.k_proj.weight"  # one shard of the fused qkv: never left uninitialised
    d = edited(model_dirs("llama_gqa"), tmp_path / "m", lambda sd: sd.pop(name))
    with pytest.raises(WeightLoadError, match="missing") as exc:
        build_model(factory(d), d, CPU, dtype)
    assert name in str(exc.value)


def test_unexpected_tensor_raises(model_dirs, tmp_path):
    name = "model.layers.0.self_attn.q_proj.bias"  # llama has none
    d = edited(model_dirs("llama_gqa"), tmp_path / "m", lambda sd: sd.__setitem__(name, torch.zeros(64)))
    with pytest.raises(WeightLoadError, match="unexpected") as exc:
        build_model(factory(d), d, CPU, torch.bfloat16)
    assert name in str(exc.value)


def test_wrong_shape_raises(model_dirs, tmp_path):
    name = "model.layers.0.mlp.down_proj.weight"
    d = edited(model_dirs("llama_gqa"), tmp_path / "m", lambda sd: sd.__setitem__(name, torch.zeros(64, 129)))
    with pytest.raises(WeightShapeError, match=r"down_proj.*\(64, 129\)"):
        build_model(factory(d), d, CPU, torch.bfloat16)


def test_tied_embeddings(model_dirs):
    d = model_dirs("llama_tied")
    assert "lm_head.weight" not in load_file(str(d / "model.safetensors"))
    model = build_model(factory(d), d, CPU, torch.bfloat16)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def poisoned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh parameters hold NaN (ints: -7) instead of whatever empty memory held."""
    real = loader_mod.materialize

    def poison(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        real(model, device, dtype)
        for p in model.parameters():
            p.data.fill_(float("nan") if p.is_floating_point() else -7)
    monkeypatch.setattr(loader_mod, "materialize", poison)


@pytest.mark.parametrize("name", ["llama_gqa", "llama_tied", "qwen2"])
def test_every_value_is_written(model_dirs, monkeypatch, name):
    """Whatever the fresh device memory holds, the built model holds only checkpoint values."""
    d = model_dirs(name)
    poisoned(monkeypatch)
    model = build_model(factory(d), d, CPU, torch.bfloat16)
    assert not any(bool(p.isnan().any()) for p in model.parameters())
    assert_same_params(model, old_path(d, torch.bfloat16))


class HeadOnly(nn.Module):
    """The LMHead of one TP rank, alone (loaded with a rename that keeps only lm_head)."""

    stacked_params = ()
    ignored_suffixes = ()

    def __init__(self, vocab: int, hidden: int, tp: TPGroup) -> None:
        super().__init__()
        self.config = None
        self.lm_head = LMHead(vocab, hidden, tp)


def test_lm_head_vocab_padding_is_zero(model_dirs, monkeypatch):
    """TP pads the vocabulary to a multiple of the ranks: the padding rows (no checkpoint
    tensor covers them) are zeros, not uninitialised memory."""
    d = model_dirs("llama_gqa")
    cfg = ModelConfig.from_dir(d)
    size = next(s for s in (4, 8, 16) if cfg.vocab_size % s)
    tp = TPGroup(rank=size - 1, size=size)  # the last rank holds the padding
    poisoned(monkeypatch)
    model = build_model(lambda: HeadOnly(cfg.vocab_size, cfg.hidden_size, tp), d, CPU, torch.float32,
                        rename=lambda n: n if n == "lm_head.weight" else None)
    head = model.lm_head
    rows = head.hi - head.lo
    assert rows < head.weight.shape[0]
    assert bool((head.weight[rows:] == 0).all())
    full = load_file(str(d / "model.safetensors"))["lm_head.weight"]
    assert torch.equal(head.weight[:rows], full[head.lo:head.hi])


# ---- the runner and the draft heads ----------------------------------------------------------------
def test_runner_builds_in_its_dtype(model_dirs):
    d = model_dirs("qwen3")
    runner = ModelRunner(ServerArgs(model_path=str(d), max_total_tokens=256, dtype="bfloat16"), d, TPGroup())
    assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}
    assert_same_params(runner.model, old_path(d, torch.bfloat16))
    assert runner.rotary.cos.dtype == torch.float32  # the rotary table stays fp32 (outside the model)


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
@pytest.mark.parametrize("name", ["llama_tied", "qwen3_moe"])
def test_runner_weights_are_frozen(model_dirs, name, load_format):
    """No parameter requires grad, whether loaded or random (--load-format dummy): a
    forward outside inference mode (a CUDA graph's capture) would otherwise record
    autograd state in its outputs."""
    d = model_dirs(name)
    runner = ModelRunner(ServerArgs(model_path=str(d), max_total_tokens=256, load_format=load_format), d, TPGroup())
    params = dict(runner.model.named_parameters())
    assert params and [n for n, p in params.items() if p.requires_grad] == []


def _old_draft(draft_dir: Path, cfg: DraftConfig, target: nn.Module, dtype: torch.dtype) -> EagleDraftModel:
    model = EagleDraftModel(cfg, target.model.embed_tokens, target.lm_head)
    load_weights(model, draft_dir, rename=EagleDraftModel.checkpoint_name)
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_draft_heads_load(model_dirs, tmp_path, monkeypatch, algo, dtype):
    target_dir = model_dirs("llama_gqa")
    target = build_model(factory(target_dir), target_dir, CPU, dtype)
    embed_ptr, head_ptr = target.model.embed_tokens.weight.data_ptr(), target.lm_head.weight.data_ptr()
    draft_dir = build_random_draft(target_dir, tmp_path / algo, algo, draft_vocab_size=40)
    cfg = DraftConfig.from_dir(draft_dir, algo, ModelConfig.from_dir(target_dir))
    poisoned(monkeypatch)  # every draft value comes from its checkpoint
    draft = EagleDraftModel.load(draft_dir, cfg, target.model.embed_tokens, target.lm_head, CPU, dtype)
    # shared with the target by reference, untouched
    assert draft._shared[0] is target.model.embed_tokens and draft._shared[1] is target.lm_head
    assert target.model.embed_tokens.weight.data_ptr() == embed_ptr
    assert target.lm_head.weight.data_ptr() == head_ptr
    assert_same_params(draft, _old_draft(draft_dir, cfg, target, dtype))
    for name, p in draft.named_parameters():
        assert p.dtype == (torch.int64 if name == "d2t" else dtype), name
    if algo == "EAGLE3":
        ckpt = load_file(str(draft_dir / "model.safetensors"))
        assert torch.equal(draft.d2t, ckpt["d2t"].to(torch.int64))
        assert draft.draft_to_target is not None and int(draft.draft_to_target.max()) < cfg.layer.vocab_size


# ---- TP: collectives by where the tensor lives, set_device per rank ------------------------------------
def test_tp_group_routes_host_and_device_collectives(monkeypatch):
    import pdserve.model.parallel as par

    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(par.dist, "all_reduce", lambda x, op=None, group=None: calls.append(("all_reduce", group)))
    monkeypatch.setattr(par.dist, "broadcast", lambda x, src=0, group=None: calls.append(("broadcast", group)))
    monkeypatch.setattr(par.dist, "all_gather", lambda parts, x, group=None: calls.append(("all_gather", group)))
    monkeypatch.setattr(par.dist, "broadcast_object_list",
                        lambda box, src=0, group=None: calls.append(("objects", group)))
    tp = TPGroup(rank=0, size=2, device_group="nccl", host_group="gloo")
    host, dev = torch.zeros(2, dtype=torch.int64), torch.zeros(2, device="meta")  # meta: stands for cuda
    tp.all_reduce_min(host)                      # KV pool size, PD readiness codes
    tp.all_reduce(dev)
    tp.all_reduce_min(dev)
    tp.broadcast(dev)                            # sampled ids
    tp.all_gather_last_dim(dev)
    tp.broadcast_object("cmd")
    assert calls == [("all_reduce", "gloo"), ("all_reduce", "nccl"), ("all_reduce", "nccl"),
                     ("broadcast", "nccl"), ("all_gather", "nccl"), ("objects", "gloo")]
    # TP 1: a plain frozen dataclass, no collectives, equal whatever groups it names
    assert TPGroup() == TPGroup(0, 1) and not TPGroup().enabled
    assert TPGroup(0, 2, device_group="a") == TPGroup(0, 2)
    with pytest.raises(AttributeError):
        TPGroup().rank = 1  # type: ignore[misc]


def test_each_rank_sets_its_cuda_device_before_building(monkeypatch):
    import pdserve.model.parallel as par
    import pdserve.scheduler.worker as worker

    set_to: list[int] = []
    monkeypatch.setattr(par.torch.cuda, "set_device", lambda i: set_to.append(i))
    assert bind_device(1, torch.device("cuda")) == torch.device("cuda", 1) and set_to == [1]
    assert bind_device(0, torch.device("cuda")) == torch.device("cuda", 0) and set_to == [1, 0]
    assert bind_device(1, CPU) == CPU and set_to == [1, 0]  # nothing on CPU

    order: list[str] = []

    class Stop(Exception):
        pass

    def fake_init(rank: int, size: int, init: str, device: torch.device, timeout_s: float = 300.0) -> TPGroup:
        order.append(f"init {device}")
        return TPGroup()

    def fake_build(*a: Any) -> Any:
        order.append("build")
        raise Stop

    monkeypatch.setattr(worker, "bind_device", lambda rank, dev: order.append(f"bind {rank}") or
                        torch.device("cuda", rank))
    monkeypatch.setattr(worker, "init_tp_group", fake_init)
    monkeypatch.setattr(worker, "build_scheduler", fake_build)
    with pytest.raises(Stop):
        worker.run_rank(ServerArgs(device="cpu"), Path("x"), Path("x"), 0, "tcp://x", None)
    assert order == ["bind 0", "init cuda:0", "build"]
    # Across nodes (--nnodes 2, TP 4) a rank binds its index on its own node: rank 3 -> GPU 1.
    order.clear()
    node1 = ServerArgs(device="cpu", tp_size=4, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:29500")
    monkeypatch.setattr(worker, "check_same_command", lambda args, tp: None)
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))  # keep this process's threads
    with pytest.raises(Stop):
        worker.run_rank(node1, Path("x"), Path("x"), 3, "tcp://x", None)
    assert order == ["bind 1", "init cuda:1", "build"]
