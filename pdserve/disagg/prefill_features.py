"""The target features a prefill server publishes for a speculative decode server whose
draft reads them (the feature path: decode runs its own draft over the prompt). A
speculative prefill offers its draft's own feature pool when the layers match; a plain
prefill allocates one at the first such decode's handshake and then captures it in
every forward. One set of layers per server: the first speculative decode's."""

from __future__ import annotations

import threading

import torch

from pdserve.disagg.handoff import feature_elements
from pdserve.disagg.gather import SourceRows
from pdserve.disagg.layout import BufferSpec, HandshakeError
from pdserve.disagg.staging import HostStaging, StagingMemoryError
from pdserve.scheduler.memory_budget import MIN_HEADROOM_BYTES, device_free_bytes
from pdserve.scheduler.scheduler import Scheduler


class _FeatureRows:
    """The target features a plain prefill server captures for a speculative decode
    peer, moving with the KV slots (a forked sample's copy of a partial last page)."""

    def __init__(self, pool: torch.Tensor) -> None:
        self.pool = pool

    def copy_slots(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.pool[dst] = self.pool[src]


class FeatureProvider:
    """Publishes the prefill server's feature pool to decode peers (its ``provide`` is
    called at a handshake, on the transfer manager's thread)."""

    def __init__(self, core: Scheduler, engine: object, staging: HostStaging | None,
                 sources: SourceRows | None = None) -> None:
        """``sources``: where the pool it publishes is recorded (the gather buffer reads it)."""
        self.core = core
        self.engine = engine
        self.staging = staging
        self.sources = sources
        self._lock = threading.Lock()
        self._registered = False

    def provide(self, layers: tuple[int, ...], slot_bytes: int) -> BufferSpec:
        """The feature pool a decode peer's draft reads (called at its handshake, on the
        transfer manager's thread). A speculative prefill offers its own when the layers
        match; a plain prefill allocates one on first demand and then captures it in
        every forward."""
        cfg = self.core.runner.config
        with self._lock:
            if self.core.spec is not None:
                mine = self.core.spec.capture_layers
                if tuple(layers) != tuple(mine):
                    raise HandshakeError(f"decode's draft reads target features {list(layers) or 'final'}, this "
                                         f"prefill server's draft captures {list(mine) or 'final'}")
                pool = self.core.spec.features
            elif self.core.feature_sink is not None:
                if tuple(layers) != self.core.feature_sink[0]:
                    raise HandshakeError(f"this prefill server already captures target features "
                                         f"{list(self.core.feature_sink[0]) or 'final'} for another decode server; "
                                         f"{list(layers) or 'final'} asked")
                pool = self.core.feature_sink[1]
            else:
                if any(not 1 <= i < cfg.num_layers for i in layers):
                    raise HandshakeError(f"decode asks for target layers {list(layers)} of a "
                                         f"{cfg.num_layers}-layer model")
                width = cfg.hidden_size * max(1, len(layers))
                pool = self._pool(width)
                self.core.feature_sink = (tuple(layers), pool)
                self.core.kv.followers.append(_FeatureRows(pool))  # a fork's copied page keeps its features
            if self.staging is not None:
                try:
                    pool = self.staging.twin("features", pool)
                except StagingMemoryError as exc:
                    raise HandshakeError(f"decode's draft needs target features: {exc}") from None
            if not self._registered:  # Mooncake writes only from registered memory
                self.engine.register(pool.data_ptr(), pool.numel() * pool.element_size())  # type: ignore
                self._registered = True
                if self.sources is not None:
                    self.sources.add(pool)
            row = pool[0].numel() * pool.element_size()
            if row != slot_bytes:
                raise HandshakeError(f"features: prefill rows are {row} bytes, decode's {slot_bytes}")
            return BufferSpec("features", pool.data_ptr(), pool.shape[0], row, feature_elements(pool))

    def _pool(self, width: int) -> torch.Tensor:
        """A plain prefill server's feature pool, made at the first speculative decode's
        handshake: outside the memory budget sized at startup, so it must fit beside it
        (else the handshake is refused with the fix, rather than the server running out
        of device memory mid-step)."""
        need = self.core.kv.num_slots * width * torch.empty(0, dtype=self.core.runner.dtype).element_size()
        free = device_free_bytes(self.core.device)
        if free is not None and need > free - MIN_HEADROOM_BYTES:
            raise HandshakeError(
                f"decode's draft needs target features, {need / 2**30:.2f} GiB on this plain prefill server, "
                f"and only {free / 2**30:.2f} GiB of device memory are free; start the prefill server with "
                "--speculative-algorithm / --speculative-draft-model-path (its memory budget then holds the "
                "features) or a lower --mem-fraction-static")
        try:
            return torch.zeros(self.core.kv.num_slots, width, dtype=self.core.runner.dtype, device=self.core.device)
        except torch.OutOfMemoryError:
            raise HandshakeError(f"decode's draft needs target features, {need / 2**30:.2f} GiB that this "
                                 "prefill server's device cannot hold; start it with --speculative-algorithm / "
                                 "--speculative-draft-model-path or a lower --mem-fraction-static") from None
