"""Whether the package index is reachable (tests that resolve real wheels skip without it)."""

from __future__ import annotations

import urllib.request


def pypi_reachable() -> bool:
    try:
        urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=5).close()
        return True
    except OSError:
        return False
