"""The transfer engine registry (pdserve/disagg/engines.py): a name resolves to its class,
imported when asked for; an unknown name lists the known ones; a registered name that
cannot run yet is accepted by the flag and refused at startup with its reason;
capabilities (what the startup staging check reads) come from the class, no engine built."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import TRANSFER_BACKENDS, ConfigError, ServerArgs
from pdserve.disagg import engines
from pdserve.disagg.engines import (TRANSFER_ENGINES, EngineCapabilities, EngineEntry, EngineSettings,
                                    TransferEngineUnavailable, UnknownTransferEngine, engine_capabilities,
                                    make_transfer_engine, transfer_engine_class, transfer_engine_names,
                                    unavailable_reason)
from pdserve.disagg.staging import choose_staging, staging_for_engine
from pdserve.disagg.transfer import LocalTransfer, MooncakeTransfer, mooncake_reaches_gpu_memory

pytestmark = pytest.mark.fast

GPU = torch.device("cuda")  # a value only: nothing is allocated on it


class _FakeEngine:
    """An engine declared as a registered class would be (for the registry's own tests)."""
    reaches = False

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.session_id = f"{settings.host}:1"
        self.reaches_device_memory = self.reaches

    @classmethod
    def capabilities(cls) -> EngineCapabilities:
        return EngineCapabilities(cls.reaches, "fake: no GPU build", "build the fake with CUDA")

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> "_FakeEngine":
        return cls(settings)


FAKE = {"fake": EngineEntry(f"{__name__}:_FakeEngine"), "later": EngineEntry(unavailable="later: not yet")}


def test_a_name_resolves_to_its_class():
    assert transfer_engine_class("mooncake") is MooncakeTransfer
    assert transfer_engine_class("fake", FAKE) is _FakeEngine
    assert TRANSFER_ENGINES[engines.DEFAULT_TRANSFER_ENGINE].target is not None


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(UnknownTransferEngine, match="unknown transfer engine 'ucx'") as err:
        transfer_engine_class("ucx")
    assert all(name in str(err.value) for name in TRANSFER_ENGINES)
    with pytest.raises(ValueError, match="fake, later"):
        make_transfer_engine("ucx", host="127.0.0.1", registry=FAKE)


def test_the_flag_choices_come_from_the_registry():
    assert TRANSFER_BACKENDS == transfer_engine_names() == tuple(TRANSFER_ENGINES)
    assert transfer_engine_names(FAKE) == ("fake", "later")
    with pytest.raises(ConfigError, match="--disaggregation-transfer-backend"):
        ServerArgs(disaggregation_transfer_backend="ucx")


def test_a_name_not_available_yet_is_accepted_then_refused_at_startup_with_its_reason(monkeypatch):
    assert unavailable_reason("later", FAKE) == "later: not yet" and unavailable_reason("fake", FAKE) is None
    assert unavailable_reason("mooncake") is None and unavailable_reason("nixl") is None
    with pytest.raises(TransferEngineUnavailable, match="later: not yet"):
        make_transfer_engine("later", host="127.0.0.1", registry=FAKE)
    monkeypatch.setitem(TRANSFER_ENGINES, "later", FAKE["later"])
    monkeypatch.setattr("pdserve.config_checks.TRANSFER_BACKENDS", transfer_engine_names())
    args = ServerArgs(disaggregation_transfer_backend="later")  # colocated: not used
    assert args.disaggregation_transfer_backend == "later"
    with pytest.raises(ConfigError, match="--disaggregation-transfer-backend: later: not yet"):
        ServerArgs(disaggregation_mode="prefill", disaggregation_transfer_backend="later")


def test_nixl_is_available():
    assert transfer_engine_class("nixl").__name__ == "NixlTransfer"  # imports no NIXL library (lazily loaded)
    args = ServerArgs.from_cli(["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "nixl"])
    assert args.disaggregation_transfer_backend == "nixl"


def test_capabilities_are_read_from_the_class_without_building_an_engine(monkeypatch):
    assert engine_capabilities("fake", FAKE) == EngineCapabilities(False, "fake: no GPU build",
                                                                   "build the fake with CUDA")
    for reaches in (True, False):
        monkeypatch.setattr("pdserve.disagg.transfer.mooncake_reaches_gpu_memory", lambda: reaches)
        assert engine_capabilities("mooncake").reaches_device_memory is reaches
    monkeypatch.undo()
    assert MooncakeTransfer.capabilities().reaches_device_memory == mooncake_reaches_gpu_memory()
    assert LocalTransfer.capabilities().reaches_device_memory == LocalTransfer().reaches_device_memory


def test_the_staging_check_follows_the_declared_capability(monkeypatch):
    for name, entry in FAKE.items():  # registered as a new engine would be: one line in the registry
        monkeypatch.setitem(TRANSFER_ENGINES, name, entry)
    monkeypatch.setattr(_FakeEngine, "reaches", False)
    assert staging_for_engine("auto", GPU, "fake") == "host"
    with pytest.raises(ValueError, match=r"cannot reach GPU memory \(fake: no GPU build\); build the fake with "
                                         r"CUDA or use host"):
        staging_for_engine("direct", GPU, "fake")
    with pytest.raises(ValueError, match="fake: no GPU build"):
        choose_staging("direct", GPU, False, "fake")
    monkeypatch.setattr(_FakeEngine, "reaches", True)
    assert staging_for_engine("auto", GPU, "fake") == staging_for_engine("direct", GPU, "fake") == "direct"
    assert staging_for_engine("auto", torch.device("cpu"), "fake") == "direct"


def test_make_transfer_engine_builds_the_named_engine_from_its_settings():
    engine = make_transfer_engine("fake", host="10.0.0.7", ib_device="mlx5_0", log_level="debug", registry=FAKE)
    assert isinstance(engine, _FakeEngine)
    assert engine.settings == EngineSettings("10.0.0.7", "mlx5_0", "debug")
    engine = make_transfer_engine("fake", host="10.0.0.7", ib_device=None, registry=FAKE)  # type: ignore[arg-type]
    assert engine.settings.ib_device == ""


def test_the_registry_imports_an_engine_only_when_it_is_asked_for():
    lazy = {"lazy": EngineEntry("tests.disagg.no_such_module:Engine")}
    assert transfer_engine_names(lazy) == ("lazy",) and unavailable_reason("lazy", lazy) is None
    with pytest.raises(ModuleNotFoundError):
        transfer_engine_class("lazy", lazy)


def test_an_entry_names_a_class_or_a_reason():
    with pytest.raises(ValueError):
        EngineEntry()
    with pytest.raises(ValueError):
        EngineEntry("a:B", unavailable="no")
