"""What pdserve's processes print at each --log-level.

At the default (`info`) a process prints one ready line of its own, then what happens
(uvicorn's access log on the servers, pdserve's events); uvicorn's own lifecycle lines
("Started server process", "Waiting for application startup", ...), httpx's line per
request and Mooncake's (see `pdserve.disagg.transfer`) come only with `--log-level debug`. Light to import:
the router uses it.
"""

from __future__ import annotations

import logging


# Loggers whose INFO lines are a library's own chatter: uvicorn's lifecycle ("Started
# server process", ...) and httpx's line per request (the router's health probes, one per
# worker per second).
CHATTY_LOGGERS = ("uvicorn.error", "httpx", "httpcore")


def quiet_uvicorn(log_level: str) -> None:
    """Keep the libraries' INFO lines out of the output below `debug`; their warnings
    and errors still show. Call after `uvicorn.Config(...)`, which sets uvicorn's loggers
    to the configured level."""
    if log_level != "debug":
        for name in CHATTY_LOGGERS:
            logger = logging.getLogger(name)
            logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))
