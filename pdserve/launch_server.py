"""`python -m pdserve.launch_server --model-path DIR ...` (also `pdserve serve ...`; `pdserve up`
starts a whole local deployment, see pdserve/up.py)."""

from __future__ import annotations

import logging
import sys

from pdserve.config import ConfigError, ServerArgs
from pdserve.flags import error_lines


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "up":  # `pdserve up ...`: a whole local deployment
        from pdserve.up import main as up

        return up(argv[1:])
    if argv and argv[0] == "serve":  # the `pdserve serve ...` console script
        argv = argv[1:]
    # Unique prefixes are accepted, as SGLang's launcher does (its users type
    # `--speculative-algo EAGLE`); every bad flag is reported at once, without the usage.
    try:
        args = ServerArgs.from_namespace(ServerArgs.cli_parser("pdserve serve").parse_or_raise(argv))
    except ConfigError as exc:
        sys.stderr.write(error_lines("pdserve serve", exc))
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s %(name)s] %(message)s")
    from pdserve.server.launch import launch

    try:
        return launch(args)
    except (ConfigError, ValueError) as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
