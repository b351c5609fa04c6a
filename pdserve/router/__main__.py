"""`python -m pdserve.router ...`: parse the flags, serve the router with uvicorn."""

from __future__ import annotations

import logging
import sys
from typing import Any, Sequence

import uvicorn

from pdserve.flags import error_lines
from pdserve.router.config import ConfigError, RouterConfig, from_cli


class _Server(uvicorn.Server):
    """uvicorn's server, printing the router's one ready line once it listens."""

    def __init__(self, config: uvicorn.Config, cfg: RouterConfig) -> None:
        super().__init__(config)
        self.cfg = cfg

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            cfg = self.cfg
            mode = "PD" if cfg.pd_disaggregation else "plain"
            found = [f"{w.role} {w.url}" for w in cfg.all_workers]
            if cfg.service_discovery:
                found.append("workers from Kubernetes pod discovery")
            print(f"pdserve router ({mode} mode) ready on http://{cfg.host}:{cfg.port}: " + ", ".join(found),
                  flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    try:
        cfg = from_cli(argv)
    except ConfigError as exc:
        sys.stderr.write(error_lines("python -m pdserve.router", exc))
        raise SystemExit(2) from None
    from pdserve.logs import quiet_uvicorn
    from pdserve.router.app import create_app
    from pdserve.server.http_connection import MAX_HEADER_BYTES, protocol_class

    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Slow, idle or oversized clients are cut off before they reach the app, as on the servers.
    try:
        app = create_app(cfg)  # --service-discovery: refused here without the kubernetes package
    except ConfigError as exc:
        sys.stderr.write(f"python -m pdserve.router: error: {exc}\n")
        raise SystemExit(2) from None
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                            access_log=False, http=protocol_class(cfg.request_read_timeout, cfg.send_timeout),
                            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                            timeout_keep_alive=min(5.0, cfg.request_read_timeout))
    quiet_uvicorn(cfg.log_level)  # after Config, which sets uvicorn's loggers up
    _Server(config, cfg).run()


if __name__ == "__main__":
    main()
