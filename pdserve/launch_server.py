"""`python -m pdserve.launch_server --model-path DIR ...` (also `pdserve serve ...`; `pdserve up`
starts a whole local deployment, see pdserve/up.py)."""

from __future__ import annotations

import argparse
import logging
import sys

from pdserve.config import ConfigError, ServerArgs


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "up":  # `pdserve up ...`: a whole local deployment
        from pdserve.up import main as up

        return up(argv[1:])
    if argv and argv[0] == "serve":  # the `pdserve serve ...` console script
        argv = argv[1:]
    # Unique prefixes are accepted (argparse's default), as SGLang's launcher does: its
    # users type `--speculative-algo EAGLE`.
    parser = argparse.ArgumentParser(prog="pdserve serve", description="Start a pdserve server.")
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    try:
        args = ServerArgs.from_namespace(ns)
    except ConfigError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s %(name)s] %(message)s")
    from pdserve.server.launch import launch

    try:
        return launch(args)
    except (ConfigError, ValueError) as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
