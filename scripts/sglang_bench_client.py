"""Run SGLang's own benchmark client (sglang/benchmark/serving.py) against pdserve.

SGLang's package imports its GPU runtime at import time (its ``__init__`` and the
two names serving.py takes from ``sglang.srt``), which does not install on a CPU
machine. This shim keeps those package ``__init__``s from running, provides the
two names with the same meaning, then runs serving.py as
``python -m sglang.bench_serving`` would. Everything else is SGLang's code,
installed with ``pip install --no-deps sglang`` (plus its benchmark's light
dependencies) in a throwaway venv:

    python -m venv --system-site-packages /tmp/sglvenv
    /tmp/sglvenv/bin/pip install --no-deps sglang msgspec pybase64 datasets multiprocess \
        pandas pyarrow dill xxhash fsspec
    /tmp/sglvenv/bin/python scripts/sglang_bench_client.py --backend sglang --base-url http://127.0.0.1:30000 \
        --dataset-name random --random-input-len 64 --random-output-len 16 --num-prompts 20 \
        --tokenizer <model dir>
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
import types

FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # SGLang's placeholder bootstrap host (sglang/srt/disaggregation/utils.py)


def _base_url(base_url: str, host: str, port: int) -> str:
    if base_url:
        return base_url
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _host_port(base_url: str, host: str, port: int) -> str:
    if base_url:
        return base_url
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _package(name: str, path: list[str]) -> types.ModuleType:
    """``name`` as a package whose __init__ never runs (SGLang's import the runtime)."""
    module = types.ModuleType(name)
    module.__path__ = path  # type: ignore[attr-defined]
    sys.modules[name] = module
    return module


def main() -> None:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("sglang is not installed (pip install --no-deps sglang in a throwaway venv)")
    root = list(spec.submodule_search_locations)[0]
    for name in ("sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.disaggregation"):
        _package(name, [os.path.join(root, *name.split(".")[1:])])
    disagg = types.ModuleType("sglang.srt.disaggregation.utils")
    disagg.FAKE_BOOTSTRAP_HOST = FAKE_BOOTSTRAP_HOST  # type: ignore[attr-defined]
    network = types.ModuleType("sglang.srt.utils.network")
    network.resolve_base_url = _base_url  # type: ignore[attr-defined]
    network.resolve_host_port = _host_port  # type: ignore[attr-defined]
    sys.modules["sglang.srt.disaggregation.utils"] = disagg
    sys.modules["sglang.srt.utils.network"] = network
    sys.argv[0] = "sglang.benchmark.serving"
    runpy.run_module("sglang.benchmark.serving", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
