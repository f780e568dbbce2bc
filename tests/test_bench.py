"""``deepinfer bench`` on the CPU at its quick sizes: the harness, not the numbers (speed is measured on devices)."""

from __future__ import annotations

import dataclasses
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
        assert r["roofline_pct"] is None  # --quick measures no ceilings: no roofline against them
    assert result["ceilings"] == {"copy_GBps": None, "bf16_TFLOPs": None, "fp8_TFLOPs": None}
    assert all(r["ms"] is not None or r["note"].startswith("unavailable") for r in result["rows"])


def test_bench_cli_writes_json_and_results_section(tmp_path):
    out, md = tmp_path / "bench.json", tmp_path / "RESULTS.md"
    assert main(["bench", "--quick", "--ops", "rms_norm", "--json", str(out), "--results", str(md)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows and rows[0]["op"] == "rms_norm"
    text = md.read_text()
    assert "`deepinfer bench --quick --ops rms_norm" in text and "| ms eager | ms graph |" in text


def test_quick_bench_on_a_cpu_prints_no_roofline_against_unmeasured_ceilings(capsys):
    assert main(["bench", "--quick", "--ops", "rms_norm,gemm"]) == 0
    out = capsys.readouterr().out
    rows = [ln.split("│") for ln in out.splitlines() if ln.startswith("│ ") and "reference/" in ln]
    header = next(ln.split("┃") for ln in out.splitlines() if "% roofline" in ln)
    column = [c.strip() for c in header].index("% roofline")
    assert rows and {r[column].strip() for r in rows} == {"n/a"}
    assert "ceilings: copy n/a, bf16 matmul n/a, FP8 matmul n/a (not measured with --quick" in " ".join(out.split())
    assert "0 TFLOP/s" not in out


def test_roofline_only_against_measured_ceilings():
    case = bench.BenchCase("gemm", "c", lambda g: {}, flops=2e12, bytes=1e9)
    measured = {"copy_GBps": 1000.0, "bf16_TFLOPs": 100.0, "fp8_TFLOPs": None}  # as on a CPU: no FP8 peak
    row = bench._row(case, "x", ms=40.0, graph_ms=None, ceilings=measured, rel_err=0.0)
    assert row.roofline_pct == 50.0  # max(1 ms of copy, 20 ms of bf16 math) / 40 ms
    fp8 = bench._row(
        dataclasses.replace(case, compute="fp8"), "x", ms=40.0, graph_ms=None, ceilings=measured, rel_err=0.0
    )
    assert fp8.roofline_pct is None and fp8.tflops == 50.0
    assert bench.roofline_text(dataclasses.asdict(fp8)) == "n/a"
