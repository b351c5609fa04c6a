"""Fixtures of the model tests: FP8 versions of conftest's tiny checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from pdserve.testing import build_fp8_checkpoint


@pytest.fixture(scope="session")
def fp8_dirs(model_dirs, tmp_path_factory) -> Callable[..., tuple[Path, Path]]:
    """(FP8 checkpoint, its dequantised plain twin) of a conftest model, built once per layout."""
    built: dict[tuple, tuple[Path, Path]] = {}

    def get(name: str, method: str = "fp8", strategy: str = "block", block: tuple[int, int] = (128, 128),
            split_shards: bool = False) -> tuple[Path, Path]:
        key = (name, method, strategy, block, split_shards)
        if key not in built:
            root = tmp_path_factory.mktemp(f"{name}-{method}-{strategy}")
            fp8 = build_fp8_checkpoint(model_dirs(name), root / "fp8", method, strategy=strategy, block=block,
                                       dequantized_dir=root / "ref", split_shards=split_shards)
            built[key] = (fp8, root / "ref")
        return built[key]
    return get
