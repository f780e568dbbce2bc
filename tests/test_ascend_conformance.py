"""The full conformance suite on the ascend backend, EMULATED: torch_npu is the test double in tests/ascend/double,
which computes on the CPU. This checks the backend's wiring, layouts and scale conversions on every change; it
does not run anything on Ascend hardware (see backends/ascend/README.md for the command that does)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

DOUBLE = Path(__file__).parent / "ascend" / "double"
NOTE = "emulated through the torch_npu test double (CPU), not Ascend hardware"


def run_conformance(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, dict]:
    report = tmp_path / "ascend-conformance.json"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    environ["PYTHONPATH"] = os.pathsep.join([str(DOUBLE), *filter(None, [os.environ.get("PYTHONPATH")])])
    environ.update(env)
    cmd = [sys.executable, "-m", "deepinfer.cli", "conformance", "--backend", "ascend", "--device", "cpu"]
    cmd += ["--note", NOTE, "--report", str(report), *args]
    run = subprocess.run(cmd, capture_output=True, text=True, env=environ, timeout=300)
    return run, json.loads(report.read_text()) if report.exists() else {}


def test_full_small_conformance_passes_through_the_double(tmp_path):
    run, report = run_conformance(tmp_path)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert report["passed"] and report["note"] == NOTE and "emulated" in report["note"]
    assert report["device"] == "cpu" and report["shapes"] == "small"
    statuses = {r["status"] for r in report["results"]}
    assert statuses == {"pass"}, statuses  # no fallback to the reference anywhere
    served = {r["op"]: set() for r in report["results"]}
    for r in report["results"]:
        if r["check"] == "accuracy":
            served[r["op"]].add(r["impl"])
    fused = {op for op, impls in served.items() if any("torch_npu." in i for i in impls)}
    # Every op but these reaches its torch_npu operator (they have none: README).
    composite_only = {"sample", "apply_token_bitmask", "layer_norm", "moe_route_hash", "hc_post"}
    composite_only |= {"compress_kv", "indexer_topk_entries", "sparse_attention_sinks"}
    assert fused == set(served) - composite_only, served
    # The DSA cases inside the fused operators' envelopes reach them (the rest have head dims, ranks or, on the
    # 950, head counts the operators do not take, and run the composites).
    fused_cases = {
        ("indexer_topk", "D=128 topk=16"): "npu_lightning_indexer",  # fp8_ds_index: dequantised to bf16 pages
        ("sparse_mla", "D=512+64"): "npu_sparse_flash_attention",
    }
    for (op, marker), operator in fused_cases.items():
        impls = {r["impl"] for r in report["results"] if r["op"] == op and marker in r["case"]}
        assert impls == {f"ascend/torch_npu.{operator}"}, (op, marker, impls)
    assert served["write_index_cache"] == {"ascend/torch_npu.npu_scatter_nd_update_"}


def test_an_emulated_a2_runs_the_bf16_paths_and_the_composites(tmp_path):
    ops = "mla_decode,write_kv_cache,gemm,grouped_gemm,quantize_fp8,silu_and_mul,write_index_cache,sparse_mla"
    run, report = run_conformance(tmp_path, "--ops", ops, DEEPINFER_TORCH_NPU_DOUBLE_SOC="Ascend910B3")
    assert run.returncode == 0, run.stdout[-4000:]
    fp8 = [r for r in report["results"] if r["check"] == "accuracy" and "fp8" in r["case"] and r["op"] == "gemm"]
    assert fp8 and all(r["impl"] == "ascend/torch-composite" for r in fp8)
    kv = [r for r in report["results"] if r["op"] == "write_kv_cache" and "fp8_ds_mla" in r["case"]]
    assert kv and all(r["status"] == "fallback" for r in kv)  # e4m3 records need a 950
    index = [r for r in report["results"] if r["op"] == "write_index_cache" and "fp8_ds_index" in r["case"]]
    assert index and all(r["status"] == "fallback" for r in index)  # so do the indexer's
    sfa = [r for r in report["results"] if r["op"] == "sparse_mla" and "D=512+64" in r["case"]]
    assert sfa and all(r["impl"] == "ascend/torch_npu.npu_sparse_flash_attention" for r in sfa)


def test_the_mx_recipe_states_its_tolerance_as_data(tmp_path):
    run, report = run_conformance(tmp_path, "--ops", "gemm", DEEPINFER_ASCEND_FP8_GEMM="mx")
    assert run.returncode == 0, run.stdout[-4000:]
    fp8 = [r for r in report["results"] if r["check"] == "accuracy" and "fp8" in r["case"]]
    assert fp8 and all(r["tolerance"] == 0.15 and "MXFP8" in r["detail"] for r in fp8)
    assert max(r["error"] for r in fp8) > 1e-2  # it does lose precision: the default tolerance would not hold
