"""Embedded model assets: the demo model and its EAGLE / EAGLE3 draft heads.

Each asset is a Hugging Face model directory next to this file, produced by
``scripts/train_demo_model.py`` (and the EAGLE trainers for the heads).
"""

from __future__ import annotations

import pathlib

_ROOT = pathlib.Path(__file__).resolve().parent
NAMES: tuple[str, ...] = ("demo", "demo-eagle", "demo-eagle3")


def path(name: str) -> pathlib.Path:
    """Directory of the embedded asset ``name`` ('demo', 'demo-eagle', 'demo-eagle3').

    Raises ValueError for an unknown name and FileNotFoundError when the asset
    has not been built yet (no ``config.json`` in its directory).
    """
    if name not in NAMES:
        raise ValueError(f"unknown asset {name!r}; expected one of {', '.join(NAMES)}")
    d = _ROOT / name
    if not (d / "config.json").is_file():
        raise FileNotFoundError(
            f"asset {name!r} is not built: {d / 'config.json'} does not exist "
            "(build the demo model with scripts/train_demo_model.py)"
        )
    return d
