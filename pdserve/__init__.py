"""pdserve: disaggregated prefill/decode LLM serving."""

from __future__ import annotations

from typing import Any

__all__ = ["Engine", "ServerArgs", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy: importing pdserve must not import torch/transformers or start anything.
    if name == "Engine":
        from pdserve.engine import Engine
        return Engine
    if name == "ServerArgs":
        from pdserve.config import ServerArgs
        return ServerArgs
    if name == "SamplingParams":
        from pdserve.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(name)
