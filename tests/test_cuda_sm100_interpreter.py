"""The NVIDIA backend's Triton kernels, run on the CPU through the Triton interpreter (``TRITON_INTERPRET=1``) and
checked by the full conformance suite at small shapes: a wrong kernel fails CI.

What the interpreter cannot run, and so stays with the reference here:
- ``gemm`` with fp32 operands goes to cuBLAS on a GPU; there is no cuBLAS in the interpreter.
The interpreter also lacks bf16 arithmetic and mis-rounds fp32 -> e4m3 casts across a binade; the kernels take a
documented fp32 path for both under the interpreter (``_triton.dot`` and ``_triton.to_e4m3``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

EXPECTED_FALLBACKS = {("gemm", "M=9 N=64 K=128 fp32")}


@pytest.mark.slow
def test_conformance_through_the_triton_interpreter(tmp_path):
    report = tmp_path / "cuda_sm100_interpreter.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [
        sys.executable,
        "-m",
        "deepinfer.cli",
        "conformance",
        "--backend",
        "cuda_sm100",
        "--device",
        "cpu",
        "--report",
        str(report),
        "--note",
        "Triton interpreter on the CPU",
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    body = json.loads(report.read_text())
    fallbacks = {(r["op"], r["case"]) for r in body["results"] if r["status"] == "fallback"}
    assert fallbacks == EXPECTED_FALLBACKS
    served = {r["op"] for r in body["results"] if r["check"] == "accuracy" and r["impl"].startswith("cuda_sm100/")}
    assert len(served) == 13, served  # every op runs a Triton kernel
    assert any(r["check"] == "batch_invariance" and r["status"] == "pass" for r in body["results"])


CAPACITY_OVERFLOW = """
import os, torch, deepinfer
from deepinfer import ops
x, w = torch.randn(6, 128, dtype=torch.bfloat16), torch.rand(6, 2)
ids = torch.tensor([[0, 1]] * 6, dtype=torch.int32)  # six rows each for experts 0 and 1, capacity 4
with deepinfer.use("cuda_sm100"):
    os.environ["DEEPINFER_VALUE_CHECKS"] = "0"
    recv, _, _, layout, handle = ops.ep_dispatch(x, ids, w, num_experts=4, mode="low_latency", capacity=4)
    out = ops.ep_combine(recv, handle)
    lost = torch.isnan(out.float()).any(1).tolist()
    print(type(handle).__name__, layout.masked_m.tolist(), bool(handle.overflow), lost)
"""


def test_capacity_overflow_is_never_silent():
    """Without value checks, the two tokens past capacity come back NaN and the handle says so."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", CAPACITY_OVERFLOW], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "GpuHandle [4, 4, 0, 0] True [False, False, False, False, True, True]"
