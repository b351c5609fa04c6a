"""The README's table of supported architectures stays true to the code: one row per
registered architecture (pdserve/model/registry.py), MTP drafting "yes" exactly where
the NextN layers are drafted with (speculative/draft_config.mtp_architectures), MoE
"yes" exactly for the architectures that build MoE layers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _table() -> dict[str, list[str]]:
    text = README.read_text()
    section = text[text.index("### Supported architectures and quantisation"):]
    section = section[:section.index("\n\n", section.index("| Architecture"))]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| `(\w+)` \|(.*)\|$", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in m.group(2).split(" | ")]
    return rows


@pytest.mark.fast
def test_readme_architecture_table_matches_the_registry():
    from pdserve.model.registry import architecture_class, supported_architectures
    from pdserve.speculative.draft_config import mtp_architectures

    rows = _table()
    assert sorted(rows) == sorted(supported_architectures())
    for arch, (examples, moe, mtp, fp8, tp, notes) in rows.items():
        assert mtp.startswith("**yes**") == (arch in mtp_architectures()), arch
        assert moe.startswith("yes") == architecture_class(arch).is_moe, arch
        assert examples and fp8 and tp and notes
