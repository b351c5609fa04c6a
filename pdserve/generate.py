"""One-shot offline generation from the command line:

    python -m pdserve.generate --model-path DIR --prompt "What is 2 + 3?" --max-new-tokens 32

Takes every server flag (see README) plus the sampling flags below.
"""

from __future__ import annotations

import argparse
import json
import sys

from pdserve.config import ConfigError, ServerArgs
from pdserve.flags import error_lines, raise_problems

PROG = "python -m pdserve.generate"


def main(argv: list[str] | None = None) -> int:
    parser = ServerArgs.cli_parser(PROG, __doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", action="append", help="required; repeat for a batch")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print the full result dicts")
    try:
        ns, _, problems = parser.parse_collecting(sys.argv[1:] if argv is None else argv)
        if ns is not None and not ns.prompt:  # checked here, not by argparse: reported with the rest
            problems.append("--prompt: required (repeat it for a batch)")
        raise_problems(problems, ConfigError)
        assert ns is not None
        args = ServerArgs.from_namespace(ns)
    except ConfigError as exc:
        sys.stderr.write(error_lines(PROG, exc))
        return 2
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
