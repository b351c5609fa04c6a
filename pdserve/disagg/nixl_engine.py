"""NIXL as a KV transfer engine (``--disaggregation-transfer-backend nixl``): NVIDIA's
transfer library (what vLLM's disaggregated prefill, Dynamo and SGLang use), here over
its UCX backend.

Peers and their metadata. A NIXL agent writes into a peer's memory only once it loaded
the peer's *agent metadata* (its name, its UCX worker address, the keys of the memory
it registered). NIXL can exchange that itself, through a listener thread of its own
that takes a port but no address (it would listen on every interface, unauthenticated):
pdserve does not start it. The metadata travels in pdserve's own handshake instead
(``Handshake.engine_metadata``, base64), signed with --disaggregation-secret when one is
set, like the rest of the handshake; the prefill rank loads it (``add_peer``) before it
accepts the handshake. Writes are one-sided (prefill -> decode), so only decode's
metadata is needed, and only a holder of the secret can make a prefill rank load one.

Confined to the operator's interface. UCX's TCP transport listens on every interface
that has an address unless told which devices to use. Each engine names the interface
that holds the server's address (``--host``; loopback by default) as UCX's only network
device and UCX's TCP transport as its only transport (``ucx_environment``), so every
socket it listens on is on that interface. With --disaggregation-ib-device the RDMA
device is the only one and UCX picks its transports. UCX_NET_DEVICES, UCX_TLS or
UCX_MODULES set by the user win (the confinement is then theirs). UCX reads them when
the backend is created: they are set for that moment only.

Exit. The nixl-cu12 wheel bundles libibverbs and libnl; UCX's InfiniBand modules load
them, and on a host that also has Debian's libibverbs1 (Mooncake needs it) a second
copy of libnl comes in through the system's verbs providers: the process then crashes
in libnl-route's destructor after Python has finished (exit status -11). On TCP the
InfiniBand modules are not loaded (UCX_MODULES=^ib), which avoids it. With an IB device
they must load; if a process crashes at exit there, the fix belongs to the wheel.

Completion and failure. ``write`` posts one transfer per ``WriteBatch`` and waits for
it (a bounded time, ``WRITE_TIMEOUT_S``); any NIXL error, an ERR state or the timeout is
a ``TransferError`` naming the peer, which fails the room as Mooncake's errors do.

The progress thread. A write into an agent's memory over UCX's TCP transport completes
only while that agent's worker is progressed, so each agent runs NIXL's progress thread.
NIXL's Python API starts it with no pause between its polls (``pthrDelay = 0``): a
busy loop of a whole core per agent, idle or not. pdserve's agents pause
``PROGRESS_DELAY_US`` between polls (``agent_config``), which takes the idle thread to
about 2% of a core; the throughput this costs or gains is in docs/benchmarks.md.

Host memory only: pdserve registers DRAM, so on a GPU the KV is staged through host
copies (``reaches_device_memory`` is False; --disaggregation-kv-staging direct is
refused with the reason).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import ipaddress
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Iterator, Mapping

from pdserve.disagg.engines import EngineCapabilities, EngineSettings
from pdserve.disagg.transfer import TransferError, WriteBatch, split_entries

logger = logging.getLogger(__name__)

# The wheels a NIXL install provides, in the order tried (the `nixl` meta package
# installs both CUDA builds; pdserve's `nixl` extra installs the CUDA 12 one).
NIXL_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")
# UCX settings pdserve derives (and leaves alone when the user set them).
UCX_VARIABLES = ("UCX_NET_DEVICES", "UCX_TLS", "UCX_MODULES")
# How long one batch may take before the write is given up (the room fails). A write
# of a whole long prompt's KV over TCP takes well under this; a peer that died is
# normally reported by UCX at once.
WRITE_TIMEOUT_S = 60.0
# The progress thread's pause between polls, in microseconds (NIXL's Python API sets 0: a
# busy loop). See the module docstring.
PROGRESS_DELAY_US = 100
_AGENT_CONFIG_LOCK = threading.Lock()


@contextlib.contextmanager
def agent_config(nixl: Any, progress_delay_us: int) -> Iterator[None]:
    """While it lasts, an agent built by ``nixl.nixl_agent`` pauses ``progress_delay_us``
    between its progress thread's polls. NIXL's Python API hard-codes 0 into the agent
    configuration it builds; the C++ configuration it builds from is swapped for one
    that keeps this value instead (nothing else changes). When the API is not built
    that way (another NIXL release), a warning says the thread stays a busy loop."""
    import sys

    api = sys.modules.get(getattr(nixl.nixl_agent, "__module__", ""))
    bind = getattr(api, "nixlBind", None)
    base = getattr(bind, "nixlAgentConfig", None)
    if base is None:
        logger.warning("NIXL's Python API has no nixlBind.nixlAgentConfig: its progress thread keeps polling "
                       "without a pause (a core per agent)")
        yield
        return

    class DelayedConfig(base):  # type: ignore[misc, valid-type]
        def __setattr__(self, name: str, value: Any) -> None:
            base.__setattr__(self, name, progress_delay_us if name == "pthrDelay" else value)

    with _AGENT_CONFIG_LOCK:
        bind.nixlAgentConfig = DelayedConfig
        try:
            yield
        finally:
            bind.nixlAgentConfig = base


def load_nixl() -> Any:
    """The installed NIXL Python package (a TransferError naming the install otherwise)."""
    import importlib

    errors = []
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise TransferError("--disaggregation-transfer-backend nixl needs NIXL: pip install 'pdserve[nixl]' (the "
                        "nixl-cu12 wheel); " + "; ".join(errors))


def interface_of(host: str, interfaces: Mapping[str, list[Any]] | None = None) -> str:
    """The network interface holding ``host``'s address (a name or an IP; not a wildcard),
    from ``interfaces`` (default: psutil.net_if_addrs()). TransferError when none does."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError as exc:
        raise TransferError(f"--host {host!r}: cannot resolve it to an address ({exc})") from None
    wanted = {ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos}
    if any(ip.is_unspecified for ip in wanted):
        raise TransferError(f"--host {host!r}: a wildcard address names no one interface")
    if interfaces is None:
        try:
            import psutil
        except ImportError:
            raise TransferError("--disaggregation-transfer-backend nixl needs psutil (pip install "
                                "'pdserve[nixl]') to find the interface of --host") from None
        interfaces = psutil.net_if_addrs()
    for name, addrs in interfaces.items():
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                if ipaddress.ip_address(str(a.address).split("%")[0]) in wanted:
                    return name
            except ValueError:
                continue
    raise TransferError(f"--host {host!r} ({', '.join(sorted(map(str, wanted)))}) is not an address of any "
                        f"interface of this machine ({', '.join(interfaces)}); name one of them, or set "
                        "UCX_NET_DEVICES yourself")


def ucx_environment(host: str, ib_device: str, environ: Mapping[str, str],
                    interfaces: Mapping[str, list[Any]] | None = None) -> dict[str, str]:
    """The UCX variables to set while the engine's UCX backend is created: its network
    device (the interface of ``host``, or the RDMA device ``ib_device``), its transports
    (TCP only without an RDMA device) and its modules (no InfiniBand modules without an
    RDMA device: see the module's Exit). Variables in ``environ`` are left as they are."""
    if ib_device:
        # UCX names an RDMA device with its port; Mooncake's flag takes the bare name.
        want = {"UCX_NET_DEVICES": ib_device if ":" in ib_device else f"{ib_device}:1"}
    else:
        want = {"UCX_NET_DEVICES": "" if "UCX_NET_DEVICES" in environ else interface_of(host, interfaces),
                "UCX_TLS": "tcp", "UCX_MODULES": "^ib"}
    return {k: v for k, v in want.items() if k not in environ}


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in os.environ for the block only: left there, they would pass for the
    user's in the processes this one starts (and in the next engine's check)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class NixlTransfer:
    """A NIXL agent with a UCX backend; ``session_id`` is its (unique) agent name.
    ``device``: an RDMA device (--disaggregation-ib-device), "" for TCP on ``host``'s
    interface. ``log_level``: the server's --log-level (NIXL's own INFO lines only at debug)."""

    WRITE_TIMEOUT_S = WRITE_TIMEOUT_S
    PROGRESS_DELAY_US = PROGRESS_DELAY_US
    # Entries are not cut (None): UCX's TCP transport moves one large entry at a loopback
    # socket's speed or above, unlike Mooncake's (`python -m pdserve.bench.kv_transfer`).
    max_entry_bytes: int | None = None

    @classmethod
    def capabilities(cls) -> EngineCapabilities:
        return EngineCapabilities(
            reaches_device_memory=False,
            device_memory_why_not="for NIXL: pdserve registers host memory with it")

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> "NixlTransfer":
        return cls(settings.host, settings.ib_device, log_level=settings.log_level)

    def __init__(self, host: str, device: str = "", log_level: str = "info",
                 write_timeout_s: float | None = None) -> None:
        nixl = load_nixl()
        if "NIXL_LOG_LEVEL" not in os.environ:
            # Its Python logger says INFO for every normal start ("Backend UCX was instantiated").
            logging.getLogger("nixl").setLevel(logging.DEBUG if log_level == "debug" else logging.WARNING)
        self.session_id = f"pdserve-{uuid.uuid4().hex[:16]}"
        self.reaches_device_memory = self.capabilities().reaches_device_memory
        self.write_timeout_s = self.WRITE_TIMEOUT_S if write_timeout_s is None else write_timeout_s
        env = ucx_environment(host, device, os.environ)
        sync = nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT  # the I/O and transfer threads both call it
        config = nixl.nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False, backends=[],
                                        sync_mode=sync)
        try:
            with agent_config(nixl, self.PROGRESS_DELAY_US):
                agent = nixl.nixl_agent(self.session_id, config)
            with _environment(env):
                agent.create_backend("UCX", {})
        except Exception as exc:  # NIXL raises its own exception types (nixlBackendError, ...)
            raise TransferError(f"NIXL could not start its UCX backend on {device or host!r} "
                                f"({', '.join(f'{k}={v}' for k, v in env.items()) or 'user UCX settings'}): "
                                f"{type(exc).__name__}: {exc}") from None
        self._agent = agent
        self.ucx_settings = env
        self._registered: dict[tuple[int, int], Any] = {}   # (ptr, length) -> its registration list
        self._peers: set[str] = set()
        # Writes running per peer: a peer removed meanwhile is unloaded when they end
        # (its metadata is not pulled from under a transfer that uses it).
        self._writing: dict[str, int] = {}
        self._removed: set[str] = set()
        self._lock = threading.Lock()
        self._closed = False

    # ---- memory and peers ---------------------------------------------------------------
    def register(self, ptr: int, length: int) -> None:
        with self._lock:
            if (ptr, length) in self._registered:
                return
            try:
                descs = self._agent.register_memory([(ptr, length, 0, "")], "DRAM")
            except Exception as exc:
                raise TransferError(f"NIXL register_memory({ptr:#x}, {length}) failed: {type(exc).__name__}: "
                                    f"{exc}") from None
            self._registered[(ptr, length)] = descs

    def metadata(self) -> str:
        """This agent's metadata (base64): what a peer loads to write into the memory
        registered so far. Taken when the handshake is sent (after registration)."""
        return base64.b64encode(self._agent.get_agent_metadata()).decode("ascii")

    def add_peer(self, session_id: str, metadata: str) -> None:
        """Load the metadata a peer sent in its handshake (TransferError if it is not the
        metadata of agent ``session_id``). Loaded again when the peer handshakes again."""
        if not metadata:
            raise TransferError(f"peer {session_id} sent no NIXL metadata (is it running the mooncake backend?)")
        try:
            raw = base64.b64decode(metadata, validate=True)
        except (binascii.Error, ValueError):
            raise TransferError(f"the NIXL metadata of peer {session_id} is not base64") from None
        with self._lock:
            if session_id in self._peers:
                if self._writing.get(session_id):
                    raise TransferError(f"peer {session_id} handshook again while a write to it is running")
                self._forget(session_id)
            try:
                name = self._agent.add_remote_agent(raw)
            except Exception as exc:
                raise TransferError(f"NIXL refused the metadata of peer {session_id}: {type(exc).__name__}: "
                                    f"{exc}") from None
            name = name.decode() if isinstance(name, bytes) else str(name)
            if name != session_id:
                if name not in self._peers:  # else it is a peer's own (re)loaded metadata: keep it
                    self._agent.remove_remote_agent(name)
                raise TransferError(f"the NIXL metadata sent for peer {session_id} is that of agent {name!r}")
            self._peers.add(session_id)

    def remove_peer(self, session_id: str) -> None:
        """Unload a peer that went away (once the writes to it that are running ended)."""
        with self._lock:
            if self._writing.get(session_id):
                self._removed.add(session_id)
            elif session_id in self._peers:
                self._forget(session_id)

    def _forget(self, session_id: str) -> None:
        """Drop a loaded peer (caller holds the lock)."""
        self._peers.discard(session_id)
        self._removed.discard(session_id)
        try:
            self._agent.remove_remote_agent(session_id)
        except Exception as exc:  # nothing more to undo: it is gone from our side either way
            logger.debug("NIXL remove_remote_agent(%s): %s", session_id, exc)

    # ---- writes -------------------------------------------------------------------------
    def write(self, peer_session: str, batch: WriteBatch) -> None:
        """One NIXL transfer for the whole batch, waited for (bounded)."""
        if not batch.src:
            return
        with self._lock:
            if peer_session not in self._peers or peer_session in self._removed:
                raise TransferError(f"NIXL write to {peer_session}: no metadata of that peer is loaded (it has not "
                                    "handshaken, or it went away)")
            self._writing[peer_session] = self._writing.get(peer_session, 0) + 1
        try:
            self._write(peer_session, batch)
        finally:
            with self._lock:
                self._writing[peer_session] -= 1
                if not self._writing[peer_session]:
                    del self._writing[peer_session]
                    if peer_session in self._removed:
                        self._forget(peer_session)

    def _write(self, peer_session: str, batch: WriteBatch) -> None:
        import numpy as np

        batch = split_entries(batch, self.max_entry_bytes)
        n = len(batch.src)
        local = np.zeros((n, 3), dtype=np.uint64)
        remote = np.zeros((n, 3), dtype=np.uint64)
        local[:, 0], remote[:, 0] = batch.src, batch.dst
        local[:, 1] = remote[:, 1] = batch.lengths
        what = f"NIXL write of {n} entries ({batch.nbytes} bytes) to {peer_session}"
        try:
            handle = self._agent.initialize_xfer("WRITE", self._agent.get_xfer_descs(local, "DRAM"),
                                                 self._agent.get_xfer_descs(remote, "DRAM"), peer_session)
        except Exception as exc:
            raise TransferError(f"{what} could not be prepared: {type(exc).__name__}: {exc}") from None
        try:
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + self.write_timeout_s
            pause = 0.0
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferError(f"{what} did not complete within {self.write_timeout_s:g} s")
                if pause:
                    time.sleep(pause)
                pause = min(0.002, pause * 2 or 0.00005)
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"{what} failed (NIXL state {state}; the peer may have gone away)")
        except TransferError:
            raise
        except Exception as exc:
            raise TransferError(f"{what} failed: {type(exc).__name__}: {exc}") from None
        finally:
            try:
                handle.release()
            except Exception as exc:  # an unfinished transfer NIXL could not cancel: keep the error above
                logger.debug("NIXL release of a transfer to %s: %s", peer_session, exc)

    def close(self) -> None:
        """Forget the peers and deregister the memory (idempotent). The agent itself goes
        with this object."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for peer in list(self._peers):
                self._forget(peer)
            for descs in self._registered.values():
                try:
                    self._agent.deregister_memory(descs)
                except Exception as exc:
                    logger.debug("NIXL deregister_memory: %s", exc)
            self._registered.clear()
