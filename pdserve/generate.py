"""One-shot offline generation from the command line:

    python -m pdserve.generate --model-path DIR --prompt "What is 2 + 3?" --max-new-tokens 32

Takes every server flag (see README) plus the sampling flags below.
"""

from __future__ import annotations

import argparse
import json
import sys

from pdserve.config import ConfigError, ServerArgs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print the full result dicts")
    ns = parser.parse_args(argv)
    try:
        args = ServerArgs.from_namespace(ns)
    except ConfigError as exc:
        parser.error(str(exc))
    from pdserve.engine import Engine

    params = {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature, "top_p": ns.top_p,
              "seed": ns.seed}
    with Engine(**vars(args)) as engine:
        outs = engine.generate(ns.prompt, params)
    for prompt, out in zip(ns.prompt, outs):
        if ns.json:
            print(json.dumps(out))
        else:
            print(f"{prompt!r} -> {out['text']!r}  ({out['meta_info']['finish_reason']['type']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
