"""scripts/bench_all.sh's report helpers: the generated block replaces only its marked part
of docs/benchmarks.md, and every "which side is ahead" sentence picks the right side and
ratio for higher-is-better and lower-is-better metrics."""

from __future__ import annotations

import pytest

from pdserve.bench.report import BEGIN, END, ratio_sentence, splice

pytestmark = pytest.mark.fast


def block(text: str) -> str:
    return f"{BEGIN}\n{text}\n{END}\n"


def test_splice_replaces_only_the_marked_block():
    doc = "# Benchmarks\n\nhand-written\n\n" + block("old numbers") + "\n## After\nkept\n"
    out = splice(doc, block("new numbers"))
    assert out == "# Benchmarks\n\nhand-written\n\n" + block("new numbers") + "\n## After\nkept\n"
    assert splice(out, block("new numbers")) == out  # idempotent


def test_splice_appends_when_the_markers_are_missing():
    assert splice("# Benchmarks\ntext", block("x")) == "# Benchmarks\ntext\n\n" + block("x")
    assert splice("", block("x")) == block("x")


def test_ratio_sentences_name_the_winner_and_ratio():
    assert ratio_sentence("output throughput", "vLLM", 1270.6, "pdserve", 972.6, True, "tok/s") == \
        "output throughput: vLLM ahead by 1.31x (1270.6 vs 972.6 tok/s)"
    assert ratio_sentence("mean TTFT", "pdserve", 55.0, "vLLM", 68.0, False, "ms") == \
        "mean TTFT: pdserve ahead by 1.24x (55.0 vs 68.0 ms)"
    assert ratio_sentence("mean TTFT", "a", 68.0, "b", 55.0, False) == "mean TTFT: b ahead by 1.24x (55.0 vs 68.0)"
    assert ratio_sentence("x", "a", 2.0, "b", 2.0, True, "GB/s") == "x: level (2.0 GB/s each)"
    assert "not comparable" in ratio_sentence("x", "a", None, "b", 1.0, True)
    assert "not comparable" in ratio_sentence("x", "a", 0.0, "b", 1.0, True)
