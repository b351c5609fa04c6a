"""`python -m pdserve.router ...`: parse the flags, serve the router with uvicorn."""

from __future__ import annotations

import logging
import sys
from typing import Sequence

from pdserve.router.config import ConfigError, from_cli


def main(argv: Sequence[str] | None = None) -> None:
    try:
        cfg = from_cli(argv)
    except ConfigError as exc:
        sys.stderr.write(f"python -m pdserve.router: error: {exc}\n")
        raise SystemExit(2) from None
    import uvicorn

    from pdserve.router.app import create_app

    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    mode = "PD" if cfg.pd_disaggregation else "plain"
    logging.getLogger("pdserve.router").warning(
        "router (%s mode) on http://%s:%d: %s", mode, cfg.host, cfg.port,
        ", ".join(f"{w.role} {w.url}" for w in cfg.all_workers))
    from pdserve.server.http_front import MAX_HEADER_BYTES, protocol_class

    # Slow, idle or oversized clients are cut off before they reach the app, as on the servers.
    uvicorn.run(create_app(cfg), host=cfg.host, port=cfg.port, log_level=cfg.log_level, access_log=False,
                http=protocol_class(cfg.request_read_timeout), h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                timeout_keep_alive=min(5.0, cfg.request_read_timeout))


if __name__ == "__main__":
    main()
