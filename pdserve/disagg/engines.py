"""The KV transfer engines a server can be started with, by name.

``TRANSFER_ENGINES`` maps each ``--disaggregation-transfer-backend`` name to the engine
class as a ``"module:Class"`` string, imported only when that engine is asked for (an
engine's module may load native libraries; the config validates names without loading
any). A name that is accepted but cannot run yet is listed with its reason instead of a
class: the flag takes it and the server refuses it at startup with that reason.

Each engine class declares, on the class (no engine is built to find out):

- ``capabilities()`` (classmethod) -> ``EngineCapabilities``: whether register/write
  reach device (GPU) memory in this installation, which decides the KV staging mode
  (``staging.staging_for_engine``), and what to say when they do not;
- ``from_settings(settings)`` (classmethod): the engine for ``EngineSettings`` (the
  address peers dial, the RDMA device, the log level); ``make_transfer_engine`` is the
  one place that calls it.

Adding an engine is its class (the ``transfer.TransferEngine`` interface plus those two
classmethods) and one line in ``TRANSFER_ENGINES``; the flag's choices, the startup
staging check and the scheduler's engine construction follow from the registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from pdserve.lazy import load_target

if TYPE_CHECKING:
    from pdserve.disagg.transfer import TransferEngine


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do in this installation (declared by its class)."""
    # register/write work on device (GPU) memory: the KV needs no host staging.
    reaches_device_memory: bool
    # When it does not: why (e.g. which build is installed) and how to get one that does;
    # both end up in the refusal of ``--disaggregation-kv-staging direct``.
    device_memory_why_not: str = ""
    device_memory_remedy: str = ""


@dataclass(frozen=True)
class EngineSettings:
    """What a server gives its engine: the address its peers dial (never a wildcard),
    the RDMA device (--disaggregation-ib-device; "" for none) and --log-level."""
    host: str
    ib_device: str = ""
    log_level: str = "info"


@dataclass(frozen=True)
class EngineEntry:
    """One registered name: the class to import, or why the name cannot run yet."""
    target: str | None = None       # "module:Class"
    unavailable: str | None = None  # the startup refusal of a name that is accepted but not implemented

    def __post_init__(self) -> None:
        if (self.target is None) == (self.unavailable is None):
            raise ValueError("an engine entry names either its class or why it is not available")


# name -> engine. The first is the default of --disaggregation-transfer-backend.
TRANSFER_ENGINES: dict[str, EngineEntry] = {
    "mooncake": EngineEntry("pdserve.disagg.transfer:MooncakeTransfer"),
    "nixl": EngineEntry("pdserve.disagg.nixl_engine:NixlTransfer"),
}
DEFAULT_TRANSFER_ENGINE = "mooncake"


class UnknownTransferEngine(ValueError):
    """A name the registry does not hold; the message lists those it does."""


class TransferEngineUnavailable(ValueError):
    """A registered name that cannot run yet; the message is its reason."""


def transfer_engine_names(registry: Mapping[str, EngineEntry] | None = None) -> tuple[str, ...]:
    """The flag's choices: every registered name, those not available yet included (the
    server refuses them at startup with their reason, rather than argparse with none)."""
    return tuple(TRANSFER_ENGINES if registry is None else registry)


def _entry(name: str, registry: Mapping[str, EngineEntry] | None) -> EngineEntry:
    registry = TRANSFER_ENGINES if registry is None else registry
    try:
        return registry[name]
    except KeyError:
        raise UnknownTransferEngine(f"unknown transfer engine {name!r} (known: {', '.join(registry)})") from None


def unavailable_reason(name: str, registry: Mapping[str, EngineEntry] | None = None) -> str | None:
    """Why the registered engine `name` cannot run yet; None when it can."""
    return _entry(name, registry).unavailable


def transfer_engine_class(name: str, registry: Mapping[str, EngineEntry] | None = None) -> type:
    """The class of engine `name`, imported now. UnknownTransferEngine for a name not
    registered, TransferEngineUnavailable for one that cannot run yet."""
    entry = _entry(name, registry)
    if entry.target is None:
        raise TransferEngineUnavailable(entry.unavailable)
    return load_target(entry.target)


def engine_capabilities(name: str, registry: Mapping[str, EngineEntry] | None = None) -> EngineCapabilities:
    """What engine `name` declares it can do in this installation (nothing is built)."""
    return transfer_engine_class(name, registry).capabilities()


def make_transfer_engine(name: str, *, host: str, ib_device: str = "", log_level: str = "info",
                         registry: Mapping[str, EngineEntry] | None = None) -> "TransferEngine":
    """The engine `name` a server transfers KV with (see ``EngineSettings``)."""
    settings = EngineSettings(host, ib_device or "", log_level)
    return transfer_engine_class(name, registry).from_settings(settings)
