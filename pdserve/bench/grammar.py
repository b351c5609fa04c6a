"""Grammar compile times and mask costs of constrained decoding.

    python -m pdserve.bench.grammar [--tokenizer DIR] [--num-schemas 200]

Compiles distinct random JSON schemas (nested objects, arrays, enums, integer and
number ranges, bounded strings: the generator the tests use) through the scheduler's
``GrammarBackend``, one at a time on its compile thread, and reports the compile
time distribution, the one-off vocabulary scan, and the time to fill one token
mask from a fresh matcher.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

NAMES = ["id", "name", "kind", "size", "tags", "ok", "items", "x"]


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A bounded schema (every value has a length limit, so a complete output fits a
    token budget): nested objects, arrays, enums, required fields, number ranges."""
    kinds = ["enum", "integer", "string", "boolean", "number"] + (["object", "array"] * 2 if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "object":
        keys = rng.sample(NAMES, rng.randint(1, 3))
        return {"type": "object", "properties": {k: random_schema(rng, depth + 1) for k in keys},
                "required": [k for k in keys if rng.random() < 0.7], "additionalProperties": False}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 7, 42, "a b"], rng.randint(2, 4))}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "number":
        lo = rng.randint(-5, 5)
        return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 10)}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(2, 6)}
    return {"type": "boolean"}


def object_schema(rng: random.Random) -> dict[str, Any]:
    """A random object schema whose every property is required."""
    keys = rng.sample(NAMES, rng.randint(1, 3))
    return {"type": "object", "properties": {k: random_schema(rng, 1) for k in keys}, "required": keys,
            "additionalProperties": False}


def _quantiles(ms: list[float]) -> str:
    ms = sorted(ms)
    pick = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]  # noqa: E731
    return (f"mean {statistics.fmean(ms):7.2f}  p50 {pick(0.5):7.2f}  p90 {pick(0.9):7.2f}  "
            f"p99 {pick(0.99):7.2f}  max {ms[-1]:7.2f}")


def main(argv: list[str] | None = None) -> None:
    from importlib.metadata import version

    from pdserve.assets import path as asset_path
    from pdserve.model.model_config import ModelConfig
    from pdserve.scheduler.grammar import GrammarBackend, GrammarState, new_bitmask
    from pdserve.tokenizer import load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=None, help="tokenizer (or model) directory; default: the demo model")
    ap.add_argument("--vocab-size", type=int, default=None, help="model vocabulary (default: the dir's config)")
    ap.add_argument("--num-schemas", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    where = args.tokenizer or str(asset_path("demo"))
    tokenizer = load_tokenizer(where)
    vocab = args.vocab_size or ModelConfig.from_dir(where).vocab_size
    backend = GrammarBackend(tokenizer, vocab, [tokenizer.eos_token_id])
    t0 = time.perf_counter()
    backend.compile("regex", "a").result()  # the vocabulary scan, once per scheduler
    scan_ms = (time.perf_counter() - t0) * 1e3
    rng = random.Random(args.seed)
    schemas = list({json.dumps(object_schema(rng)) for _ in range(args.num_schemas)})
    compile_ms, fill_ms = [], []
    bits = new_bitmask(1, vocab)
    for text in schemas:
        t0 = time.perf_counter()
        future = backend.compile("json_schema", text)
        future.result()
        compile_ms.append((time.perf_counter() - t0) * 1e3)
        state = GrammarState(future)
        t0 = time.perf_counter()
        state.fill(bits, 0, [], [])
        fill_ms.append((time.perf_counter() - t0) * 1e3)
    t0 = time.perf_counter()
    for text in schemas:
        backend.compile("json_schema", text).result()
    cached_ms = (time.perf_counter() - t0) * 1e3 / len(schemas)
    backend.close()
    print(f"tokenizer {where} (vocab {vocab}), xgrammar {version('xgrammar')}, "
          f"{len(schemas)} distinct random object schemas")
    print(f"vocabulary scan (first compile)   : {scan_ms:8.2f} ms")
    print(f"compile ms, cold                  : {_quantiles(compile_ms)}")
    print(f"compile ms, cached (repeat)       : mean {cached_ms:7.3f}")
    print(f"first mask fill ms                : {_quantiles(fill_ms)}")


if __name__ == "__main__":
    main()
