"""`python -m pdserve.launch_server --model-path DIR ...` (also `pdserve serve ...`; `pdserve up`
starts a whole local deployment, see pdserve/up.py)."""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Callable


def _exit_quietly(signum: int, frame: object) -> None:
    os._exit(130)  # nothing started yet: no cleanup to run, no traceback to print


def main(argv: list[str] | None = None) -> int:
    # A Ctrl-C while the modules load (torch takes seconds) ends the launcher at once and
    # quietly, as a shell expects: not a KeyboardInterrupt traceback (which a library's
    # bare `except:` mid-import could even swallow). The server and `up` install their
    # own handlers when they start; an ignored SIGINT (a background job) stays ignored.
    quiet = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if quiet:
        signal.signal(signal.SIGINT, _exit_quietly)
    try:
        run = _prepare(list(sys.argv[1:] if argv is None else argv))
    finally:
        if quiet:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    return run()


def _prepare(argv: list[str]) -> Callable[[], int]:
    """What the command line asks for, with everything it needs imported."""
    if argv and argv[0] == "up":  # `pdserve up ...`: a whole local deployment
        from pdserve.up import main as up

        return lambda: up(argv[1:])
    from pdserve.config import ConfigError, ServerArgs
    from pdserve.flags import error_lines

    if argv and argv[0] == "serve":  # the `pdserve serve ...` console script
        argv = argv[1:]
    # Unique prefixes are accepted, as SGLang's launcher does (its users type
    # `--speculative-algo EAGLE`); every bad flag is reported at once, without the usage.
    try:
        args = ServerArgs.from_namespace(ServerArgs.cli_parser("pdserve serve").parse_or_raise(argv))
    except ConfigError as exc:
        sys.stderr.write(error_lines("pdserve serve", exc))
        return lambda: 2
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s %(name)s] %(message)s")
    from pdserve.server.launch import launch

    def serve() -> int:
        try:
            return launch(args)
        except (ConfigError, ValueError) as exc:
            print(f"pdserve: {exc}", file=sys.stderr)
            return 2
    return serve


if __name__ == "__main__":
    sys.exit(main())
