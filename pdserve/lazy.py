"""Registry entries as ``"module:attr"`` strings, imported when chosen: the registries
(attention backends, architectures, transfer engines, scheduler modes) list what exists
without importing it, so validating a name loads no kernels or native libraries."""

from __future__ import annotations

import importlib
from typing import Any


def load_target(path: str) -> Any:
    """The object ``"module:attr"`` names, its module imported now."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)
