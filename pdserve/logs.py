"""What pdserve's processes print, in one format, and what they are called.

Every line a pdserve process writes (its log records, uvicorn's access log, its ready
line) reads

    [2026-12-06 09:56:10 decode TP0] Decode batch. #running-req: 3, ...
    [2026-12-06 09:56:10 router] WARNING: decode worker http://... is out of rotation: ...

the label saying which process wrote it: ``router``, ``prefill``, ``decode`` or
``server`` (a colocated one), with ``TPn`` on a scheduler's lines; warnings and errors
carry their level. ``pdserve up`` runs several processes on one console, so its access
and drain lines say which server wrote them; with several servers of a kind it names
each (``prefill-1``) through PDSERVE_LOG_LABEL in the server's environment.

At the default (`info`) a process prints one ready line of its own, then what happens
(uvicorn's access log on the servers, pdserve's events); uvicorn's own lifecycle lines
("Started server process", "Waiting for application startup", ...), httpx's line per
request and Mooncake's (see `pdserve.disagg.transfer`) come only with `--log-level debug`.

Processes are named as SGLang names its own (``pdserve::scheduler TP0``,
``pdserve::detokenizer``, ``pdserve::router``): ``ps`` and ``top`` show what each is.
Light to import: the router uses it.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import TextIO


# Loggers whose INFO lines are a library's own chatter: uvicorn's lifecycle ("Started
# server process", ...) and httpx's line per request (the router's health probes, one per
# worker per second).
CHATTY_LOGGERS = ("uvicorn.error", "httpx", "httpcore")
# Set by `pdserve up` for a server whose role alone would not tell it apart (two prefill
# servers): the label its lines and process names carry instead of the role.
LABEL_ENV = "PDSERVE_LOG_LABEL"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


def server_label(disaggregation_mode: str) -> str:
    """A server's label: its role (``prefill``, ``decode``, ``server`` when colocated),
    unless PDSERVE_LOG_LABEL names it."""
    named = os.environ.get(LABEL_ENV, "").strip()
    if named:
        return named
    return "server" if disaggregation_mode == "null" else disaggregation_mode


def tp_label(label: str, tp_rank: int) -> str:
    return f"{label} TP{tp_rank}"


def format_line(label: str, message: str, created: float | None = None, level: int = logging.INFO) -> str:
    """One line in pdserve's format (the level is written only from WARNING on)."""
    stamp = time.strftime(DATE_FORMAT, time.localtime(time.time() if created is None else created))
    severity = f"{logging.getLevelName(level)}: " if level >= logging.WARNING else ""
    return f"[{stamp} {label}] {severity}{message}"


class LabelFormatter(logging.Formatter):
    """Formats every record as `format_line` does (a traceback, if any, follows it)."""

    def __init__(self, label: str) -> None:
        super().__init__()
        self.label = label

    def format(self, record: logging.LogRecord) -> str:
        line = format_line(self.label, record.getMessage(), record.created, record.levelno)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure(log_level: str, label: str, stream: TextIO | None = None) -> None:
    """This process's logging: every record (uvicorn's too, when uvicorn is given
    ``log_config=None``) through one handler in pdserve's format, at ``log_level``. Call
    at the start of each process (spawned children do not inherit the parent's)."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(LabelFormatter(label))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(log_level.upper())


def announce(label: str, message: str) -> None:
    """A line every --log-level shows (a ready line), on stdout, in the same format."""
    print(format_line(label, message), flush=True)


def quiet_uvicorn(log_level: str) -> None:
    """Keep the libraries' INFO lines out of the output below `debug`; their warnings
    and errors still show. Call after `uvicorn.Config(...)`, which sets uvicorn's loggers
    to the configured level."""
    if log_level != "debug":
        for name in CHATTY_LOGGERS:
            logger = logging.getLogger(name)
            logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))


def set_process_title(what: str, label: str | None = None) -> None:
    """Name this process ``pdserve::WHAT`` (``pdserve::scheduler TP0 (decode)`` on a PD
    server), in ps's command line and top's name, as SGLang's ``sglang::scheduler``."""
    import setproctitle

    title = f"pdserve::{what}" + (f" ({label})" if label and label != "server" else "")
    setproctitle.setproctitle(title)
