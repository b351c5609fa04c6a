"""`python -m pdserve.router ...`: parse the flags, serve the router with uvicorn."""

from __future__ import annotations

import signal
import sys
from typing import Any, Sequence

import uvicorn

from pdserve.flags import error_lines
from pdserve.logs import announce
from pdserve.router.config import ConfigError, RouterConfig, from_cli


class _Server(uvicorn.Server):
    """uvicorn's server, printing the router's one ready line once it listens.

    SIGTERM and Ctrl-C stop it as uvicorn does (no new connections; the requests in flight
    finish, streams included), quietly (the workers going away meanwhile are expected),
    and the process exits 0 instead of dying of the signal uvicorn re-raises. Started with
    SIGINT ignored (by `pdserve up`, whose Ctrl-C reaches the whole process group), it
    keeps ignoring it: `up` sends SIGTERM, to the router first."""

    def __init__(self, config: uvicorn.Config, cfg: RouterConfig, app: Any) -> None:
        super().__init__(config)
        self.cfg = cfg
        self.app = app
        self.sigint_ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN

    def handle_exit(self, sig: int, frame: Any) -> None:
        if sig == signal.SIGINT and self.sigint_ignored:
            return
        self.app.state.router.registry.shutting_down = True
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting for the streams in flight
        self.should_exit = True  # (not recorded in _captured_signals: no re-raise after serving)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            cfg = self.cfg
            mode = "PD" if cfg.pd_disaggregation else "plain"
            found = [f"{w.role} {w.url}" for w in cfg.all_workers]
            if cfg.service_discovery:
                found.append("workers from Kubernetes pod discovery")
            announce("router", f"pdserve router ({mode} mode) ready on http://{cfg.host}:{cfg.port}: "
                     + ", ".join(found))


def main(argv: Sequence[str] | None = None) -> None:
    try:
        cfg = from_cli(argv)
    except ConfigError as exc:
        sys.stderr.write(error_lines("python -m pdserve.router", exc))
        raise SystemExit(2) from None
    from pdserve.logs import configure, quiet_uvicorn, set_process_title
    from pdserve.router.app import create_app
    from pdserve.server.http_connection import MAX_HEADER_BYTES, protocol_class

    configure(cfg.log_level, "router")
    set_process_title("router")
    # Slow, idle or oversized clients are cut off before they reach the app, as on the servers.
    try:
        app = create_app(cfg)  # --service-discovery: refused here without the kubernetes package
    except ConfigError as exc:
        sys.stderr.write(f"python -m pdserve.router: error: {exc}\n")
        raise SystemExit(2) from None
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                            log_config=None, access_log=False,
                            http=protocol_class(cfg.request_read_timeout, cfg.send_timeout),
                            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                            timeout_keep_alive=min(5.0, cfg.request_read_timeout))
    quiet_uvicorn(cfg.log_level)  # after Config, which sets uvicorn's loggers up
    _Server(config, cfg, app).run()


if __name__ == "__main__":
    main()
