"""The attention-backend and architecture registries: names resolve to lazily imported
classes, what a class declares is what config validation, the runner and from_hf
follow, and an unknown name gets the listing."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

import pdserve.config as config_module
import pdserve.config_checks as config_checks
from pdserve.config import ConfigError, ServerArgs
from pdserve.model import attention_backends as ab
from pdserve.model import registry
from pdserve.model.attention import TorchNativeAttention
from pdserve.model.attention_backends import BackendInfo
from pdserve.model.model_config import ModelConfig, ModelConfigError
from pdserve.model.transformer import CausalLM

pytestmark = pytest.mark.fast


# ---- attention backends ------------------------------------------------------------------

class FakeBackend(BackendInfo):
    """A backend that runs on CUDA only, needs a package nobody has, and supports nothing."""
    name = "fake"
    devices = ("cuda",)
    auto_priority = 100
    requires_package = "pdserve_no_such_package"

    def __init__(self, kv_pool: Any, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.args = (kv_pool, num_heads, num_kv_heads, head_dim)


class EverywhereBackend(FakeBackend):
    name = "everywhere"
    devices = ("cpu", "cuda")
    requires_package = None


@pytest.fixture
def fake_backends(monkeypatch):
    monkeypatch.setitem(ab.BACKENDS, "fake", f"{__name__}:FakeBackend")
    monkeypatch.setitem(ab.BACKENDS, "everywhere", f"{__name__}:EverywhereBackend")
    monkeypatch.setattr(config_checks, "ATTENTION_BACKENDS", ("auto", *ab.backend_names()))  # validation's


def test_every_registered_backend_is_found_by_name_and_is_a_flag_choice():
    assert ab.backend_names() == ("torch_native", "triton", *ab.SGLANG_STAND_INS)
    assert config_module.ATTENTION_BACKENDS == ("auto", *ab.backend_names())
    for name in ab.BACKENDS:
        cls = ab.backend_class(name)
        assert issubclass(cls, BackendInfo) and cls.name == name
    assert ab.backend_class("torch_native") is TorchNativeAttention


def test_triton_backend_class_imports_no_triton():
    """Validation reads triton's capabilities without importing its kernels (or triton):
    the backend's module imports them only when the backend is built."""
    import ast
    import sys

    cls = ab.backend_class("triton")
    assert cls.supports_cuda_graphs and cls.supports_draft_tree and not cls.supports_decode_mirror
    assert cls.requires_package == "triton" and cls.devices == ("cuda",)
    tree = ast.parse(inspect.getsource(sys.modules[cls.__module__]))
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top for a in n.names] + [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if "triton" in n], names


def test_unknown_backend_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown attention backend 'fa9' \\(choose from torch_native, triton, "
                                         "fa3, fa4, flashinfer"):
        ab.backend_class("fa9")


@pytest.mark.parametrize("name", ["fa3", "flashinfer", "trtllm_mha"])
def test_sglang_kernel_names_run_as_auto_and_say_so(name):
    """SGLang's command lines run as written: its kernel-library names stand for pdserve's
    best backend on the device, never refused, never silently."""
    assert ab.refusal(name, "cpu") is None and ab.refusal(name, "cuda") is None
    assert ab.resolve(name, "cpu") == ab.auto_backend("cpu") == "torch_native"
    assert ServerArgs(attention_backend=name, device="cpu").resolved_attention_backend() == "torch_native"
    note = ab.stand_in_note(name, "cpu")
    assert note is not None and note.startswith(f"--attention-backend {name}: pdserve has no ") and \
        "running torch_native, its best backend on cpu" in note
    assert ab.stand_in_note("torch_native", "cpu") is None and ab.stand_in_note("auto", "cpu") is None
    with pytest.raises(ValueError, match="resolve"):
        ab.backend_class(name)


def test_capabilities_choose_and_refuse():
    assert ab.backends_supporting("supports_cuda_graphs") == ("triton",)
    assert ab.backends_supporting("supports_decode_mirror") == ("torch_native",)
    assert ab.backends_supporting("supports_draft_tree") == ("torch_native", "triton")
    assert ab.auto_backend("cpu") == "torch_native"
    with pytest.raises(ValueError, match="cannot serve decode from a KV mirror"):
        ab.create_backend("triton", None, 4, 2, 16, mirror=object())  # type: ignore[arg-type]
    native = ab.create_backend("torch_native", None, 4, 2, 16, draft=True)  # type: ignore[arg-type]
    assert isinstance(native, TorchNativeAttention) and native.group == 2


def test_a_new_backend_is_one_registry_line(fake_backends, monkeypatch):
    assert ab.backend_names() == ("torch_native", "triton", "fake", "everywhere", *ab.SGLANG_STAND_INS)
    # Its declarations, not its name, decide: device, package, capabilities.
    assert ab.refusal("fake", "cpu") == "fake runs on cuda only, not cpu"
    assert ab.refusal("fake", "cuda") == "fake is not installed (pip install pdserve_no_such_package)"
    assert ab.refusal("everywhere", "cpu") is None
    with pytest.raises(ConfigError, match="--attention-backend: fake runs on cuda only, not cpu"):
        ServerArgs(attention_backend="fake", device="cpu")
    assert ab.auto_backend("cpu") == "everywhere"  # the highest auto_priority that runs there
    monkeypatch.setattr(EverywhereBackend, "auto_priority", -1)
    assert ab.auto_backend("cpu") == "torch_native"
    with pytest.raises(ValueError, match="--attention-backend everywhere cannot run the EAGLE draft "
                                         "\\(use torch_native or triton\\)"):
        ab.create_backend("everywhere", None, 4, 2, 16, draft=True)  # type: ignore[arg-type]
    built = ab.create_backend("everywhere", "pool", 4, 2, 16)  # type: ignore[arg-type]
    assert isinstance(built, EverywhereBackend) and built.args == ("pool", 4, 2, 16)


def test_config_asks_the_backend_not_its_name(fake_backends, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match="--enable-cuda-graph: CUDA graphs need --attention-backend triton"):
        ServerArgs(attention_backend="everywhere", device="cuda", enable_cuda_graph=True)
    monkeypatch.setattr(EverywhereBackend, "supports_cuda_graphs", True)
    assert ServerArgs(attention_backend="everywhere", device="cuda", enable_cuda_graph=True).use_cuda_graph()
    with pytest.raises(ConfigError, match="--attention-backend: everywhere cannot run the EAGLE draft; use "
                                          "torch_native or triton"):
        ServerArgs(attention_backend="everywhere", device="cuda", speculative_algorithm="EAGLE",
                   speculative_draft_model_path=str(tmp_path))
    for source in (config_checks._check_device, ServerArgs.resolved_attention_backend):
        assert '"triton"' not in inspect.getsource(source)


# ---- architectures -----------------------------------------------------------------------

class FakeForCausalLM(CausalLM):
    """Declares every quirk from_hf reads."""
    reads_attention_bias = True
    qkv_bias = True
    o_proj_follows_attention_bias = False
    qk_norm = True
    sliding_window_switch = "use_window"
    speculative_defaults = (2, 2, 3)


class FakeMoeForCausalLM(CausalLM):
    reads_attention_bias = False
    is_moe = True

    @classmethod
    def moe_layout(cls, raw, num_layers, fail):
        if raw.get("experts") is None:
            raise fail("no experts")
        return raw["experts"], raw.get("expert_size"), False, (num_layers - 1,)


def _raw(arch: str, **extra: Any) -> dict[str, Any]:
    return {"architectures": ["SomethingElse", arch], "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, **extra}


@pytest.fixture
def fake_architectures(monkeypatch):
    monkeypatch.setitem(registry.ARCHITECTURES, "FakeForCausalLM", f"{__name__}:FakeForCausalLM")
    monkeypatch.setitem(registry.ARCHITECTURES, "FakeMoeForCausalLM", f"{__name__}:FakeMoeForCausalLM")


def test_every_registered_architecture_is_found_by_name():
    from pdserve.testing import model_types

    for name in registry.ARCHITECTURES:
        cls = registry.architecture_class(name)
        assert issubclass(cls, CausalLM) and cls.__name__ == name
    # The test builder covers every registered architecture (by its transformers model type).
    assert sorted(model_types().values()) == sorted(registry.supported_architectures())


def test_unknown_architecture_lists_the_registry(fake_architectures):
    listing = ", ".join(registry.ARCHITECTURES)
    assert "FakeForCausalLM" in listing
    with pytest.raises(ModelConfigError) as info:
        ModelConfig.from_hf(_raw("GPT2LMHeadModel"))
    assert str(info.value) == f"unsupported architecture ['SomethingElse', 'GPT2LMHeadModel']; supported: {listing}"
    with pytest.raises(ModelConfigError, match=f"unsupported architecture 'Nope'; supported: {listing}"):
        registry.architecture_class("Nope")
    with pytest.raises(ConfigError, match="--trust-remote-code: .*FakeForCausalLM, FakeMoeForCausalLM"):
        ServerArgs(trust_remote_code=True)


def test_from_hf_follows_what_the_architecture_declares(fake_architectures):
    cfg = ModelConfig.from_hf(_raw("FakeForCausalLM", attention_bias=True, mlp_bias=True, sliding_window=64))
    assert cfg.architecture == "FakeForCausalLM"
    assert cfg.attention_bias and not cfg.o_proj_bias and cfg.qk_norm and cfg.mlp_bias
    assert cfg.sliding_window is None  # use_window is not set
    assert ModelConfig.from_hf(_raw("FakeForCausalLM", sliding_window=64, use_window=True)).sliding_window == 64
    assert ModelConfig.from_hf(_raw("FakeForCausalLM")).attention_bias  # qkv_bias: always
    assert registry.model_class(cfg) is FakeForCausalLM
    assert ServerArgs().speculative_shape("FakeForCausalLM") == (2, 2, 3)

    moe = ModelConfig.from_hf(_raw("FakeMoeForCausalLM", attention_bias=True, mlp_bias=True, experts=4,
                                   expert_size=32, num_experts_per_tok=2))
    assert not moe.attention_bias and not moe.mlp_bias
    assert moe.moe is not None and (moe.moe.num_experts, moe.moe.intermediate_size) == (4, 32)
    assert moe.moe.sparse_layers == (1,) and not moe.moe.norm_topk_prob
    with pytest.raises(ModelConfigError, match="^FakeMoeForCausalLM: no experts$"):
        ModelConfig.from_hf(_raw("FakeMoeForCausalLM"))
    # The checks every MoE architecture shares run first.
    with pytest.raises(ModelConfigError, match="^FakeMoeForCausalLM: n_shared_experts=1 is not supported"):
        ModelConfig.from_hf(_raw("FakeMoeForCausalLM", n_shared_experts=1, experts=4))


def test_from_hf_tests_no_architecture_name():
    source = inspect.getsource(ModelConfig.from_hf)
    assert "ForCausalLM" not in source and "Qwen" not in source and "startswith" not in source


@pytest.mark.parametrize("arch,expected", [
    # (attention_bias, o_proj_bias, qk_norm, sliding_window, moe) with attention_bias and a window set
    ("LlamaForCausalLM", (True, True, False, 64, False)),
    ("MistralForCausalLM", (True, True, False, 64, False)),
    ("Qwen2ForCausalLM", (True, False, False, None, False)),
    ("Qwen3ForCausalLM", (True, True, True, None, False)),
    ("Qwen3MoeForCausalLM", (True, True, True, None, True)),
    ("MixtralForCausalLM", (False, False, False, 64, True)),
])
def test_builtin_quirks_are_unchanged(arch, expected):
    moe = {"num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    cfg = ModelConfig.from_hf(_raw(arch, attention_bias=True, sliding_window=64, **moe))
    assert (cfg.attention_bias, cfg.o_proj_bias, cfg.qk_norm, cfg.sliding_window, cfg.moe is not None) == expected
    assert ModelConfig.from_hf(_raw(arch, **moe)).attention_bias == (arch == "Qwen2ForCausalLM")
