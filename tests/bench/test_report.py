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


def test_long_prompt_itl_section_reads_both_rows_and_the_decode_counters(tmp_path):
    """Section 7's table: one row per prefill kind, the decode server's draft prefill
    counter beside it, and the ITL p99 sentence naming the lower side."""
    import json

    from pdserve.bench.report_sections import section7

    args = {"request_rate": 3, "num_prompts": 48, "random_input_len": 1900, "random_range_ratio": 0.05,
            "random_output_len": 128}
    for key, p99, drafted in (("p_spec", 20.0, 0), ("p_plain", 30.0, 45000)):
        rec = {"args": args, "mean_ttft_ms": 100.0, "mean_tpot_ms": 9.0, "median_itl_ms": 8.0, "p99_itl_ms": p99,
               "max_itl_ms": 2 * p99, "output_throughput": 50.0, "failed": 0}
        (tmp_path / f"{key}.jsonl").write_text(json.dumps(rec) + "\n")
        (tmp_path / f"{key}.decode_metrics").write_text(
            f"pdserve:decode_draft_prefill_tokens_total {drafted}.0\n"
            f'pdserve:kv_transfer_bytes_total{{kind="features"}} 1.0\n')
    text = section7(tmp_path)
    assert "48 prompts of 95-1900 tokens" in text
    rows = [line for line in text.splitlines() if line.startswith("| P drafting") or line.startswith("| plain P")]
    assert rows[0].endswith("| 20.00 | 40.00 | 50.0 | 0 |") and rows[1].endswith("| 30.00 | 60.00 | 50.0 | 45000 |")
    assert "ITL p99: P drafting ahead by 1.50x (20.00 vs 30.00 ms)" in text
    (tmp_path / "p_plain.jsonl").unlink()
    assert "| plain P (decode drafts the prompt) | not measured |" in section7(tmp_path)


def test_kv_transfer_section_reads_the_table_by_column_names(tmp_path):
    from pdserve.bench.report_sections import section5

    (tmp_path / "kv.txt").write_text(
        "| engine | model | tokens | MiB | raw TCP GB/s | contiguous GB/s (entries) | contiguous / raw "
        "| extent p1 GB/s (/ contiguous; entries; tokens/run) | extent p64 GB/s (/ contiguous; entries; tokens/run) |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
        "| NIXL | demo | 256 | 1 | 2.00 | 1.50 (8) | 0.75x | 0.10 (0.07x; 100; 2.0) | 1.20 (0.80x; 8; 64.0) |\n"
        "| NIXL | wide | 512 | 64 | 4.00 | 4.40 (32) | 1.10x | 0.40 (0.09x; 900; 1.5) | 2.60 (0.59x; 90; 70.1) |\n")
    text = section5(tmp_path)
    assert "NIXL contiguous writes at 0.75x to 1.10x the raw socket" in text
    assert "NIXL page size 1 (extent allocation) at 0.07x to 0.09x its contiguous speed" in text
    assert "NIXL page size 64 (extent allocation) at 0.59x to 0.80x its contiguous speed" in text
    assert "not measured" in section5(tmp_path / "missing")
