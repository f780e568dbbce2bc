"""``deepinfer bench`` on the CPU at its quick sizes: the harness, not the numbers (speed is measured on devices)."""

from __future__ import annotations

import json

from deepinfer import bench
from deepinfer.cli import main


def test_quick_bench_checks_then_times_every_case(tmp_path):
    seen = []
    result = bench.run_bench(
        quick=True, only_ops=["gemm", "rms_norm", "moe_layer"], sets=2, on_case=lambda r: seen.append(len(r["rows"]))
    )
    ours = [r for r in result["rows"] if not r["impl"].startswith("peer:")]
    assert {r["op"] for r in ours} == {"gemm", "rms_norm", "moe_layer"}
    assert len(ours) == len(seen) and seen == sorted(seen)  # results handed over after every case, growing
    for r in ours:
        assert r["ms"] > 0 and r["graph_ms"] is None  # no CUDA graphs on the CPU
        assert r["rel_err"] < 1e-2, r  # checked against the reference before timing
        assert r["roofline_pct"] > 0
    assert all(r["ms"] is not None or r["note"].startswith("unavailable") for r in result["rows"])


def test_bench_cli_writes_json_and_results_section(tmp_path):
    out, md = tmp_path / "bench.json", tmp_path / "RESULTS.md"
    assert main(["bench", "--quick", "--ops", "rms_norm", "--json", str(out), "--results", str(md)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows and rows[0]["op"] == "rms_norm"
    text = md.read_text()
    assert "`deepinfer bench --quick --ops rms_norm" in text and "| ms eager | ms graph |" in text
