"""The warp-specialized, persistent Gluon FP8 GEMM (``backends/cuda_sm100/gemm_gluon.py``) beside cuBLAS, in its
schedules: A streamed (4 stages) and A resident in shared memory (K <= 512; 4 or 5 stages of B, 5 is what ``gemm``
takes). It was written to test whether Hopper's usual GEMM schedule reaches 75% of the FP8 peak at M = 4096 on the
DeepSeek-V3 projections where cuBLAS does not. The 128 x 128 tiles measured in the twenty-third session are in git
history (commit b51e50a); NOTES.md has every variant's outcome.

    python3 benchmarks/gluon_gemm_ws.py OUT.json        (on the GPU: each side checked against the dequantised product
                                                         and bit for bit against the unsplit kernel, then timed from
                                                         CUDA graphs; M = 4096 on every projection, and two more)
    python3 benchmarks/gluon_gemm_ws.py OUT.json sweep [M,...]  (over row counts, on the projections gemm gives it)
    python3 benchmarks/gluon_gemm_ws.py --compile       (anywhere: compiles every variant for SM90, prints resources and
                                                         whether ptxas serialized the wgmma instructions)
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch
import triton

from deepinfer_cuda_sm100.gemm_gluon import MAX_K, MAX_RESIDENT_K, RESIDENT, STREAMED, launch

VARIANTS = {"streamed 4st": STREAMED, "resident 4st": RESIDENT | {"STAGES": 4}, "resident 5st": RESIDENT}


def compile_for_sm90(name: str) -> None:
    """Compiles the kernel for SM90 without a GPU, as ``launch`` does, and prints what ptxas reports of it (the CPU
    tests' helpers: ``tests/gluon_helpers.py``)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from gluon_helpers import compile_gemm_sm90, ptxas_report

    kernel = compile_gemm_sm90(VARIANTS[name])
    report = ptxas_report(kernel.asm["ptx"])  # C7514: ptxas serialized the wgmma instructions
    registers = max(int(r) for r in re.findall(r"Used (\d+) registers", report))
    stack = max(int(r) for r in re.findall(r"(\d+) bytes stack frame", report))
    print(f"Triton {triton.__version__}, SM90, {name}, K=512: registers {registers}, stack {stack}, shared "
          f"{kernel.metadata.shared} bytes, wgmma serialized by ptxas: {'C7514' in report}")  # fmt: skip


PROJECTIONS = ((24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048), (2112, 7168))  # DeepSeek-V3


def shape_row(m: int, n: int, k: int, peak: float, variants=VARIANTS) -> dict:
    """Each side against the dequantised product (and the Gluon kernel bit for bit against the unsplit ``tl``
    kernel, whose bits batch-invariant mode keeps), then timed from CUDA graphs on the same inputs."""
    from gemm_tiles import SETS, inputs, rel_err

    from deepinfer.bench import time_graph_ms
    from deepinfer_cuda_sm100 import gemm

    a, w = inputs(m, n, k, seed=m + n + k)
    want = a[0].dequantize() @ w[0].dequantize().t()
    unsplit = gemm.gemm_fp8(a[0], w[0], out_dtype=torch.bfloat16, bias=None, invariant=True).view(torch.int16)
    sides = {"cublas": lambda i: gemm.gemm_fp8_cublas(a[i], w[i], out_dtype=torch.bfloat16, bias=None)} | {
        name: lambda i, v=v: launch(a[i], w[i], v)
        for name, v in variants.items()
        if k <= MAX_RESIDENT_K or not v["RESIDENT"]
    }
    row = {"M": m, "N": n, "K": k}
    for name, fn in sides.items():
        try:
            got = fn(0)
            err = rel_err(got, want)
            same = bool(torch.equal(got.view(torch.int16), unsplit))
            ms = time_graph_ms(fn, sets=SETS, reps=30) if err < 1e-2 else None
        except Exception as e:  # a variant the compiler or driver refuses is reported, not hidden
            row[name] = f"{type(e).__name__}: {str(e)[:200]}"
            print(f"M={m} N={n} K={k} {name}: {row[name]}", flush=True)
            continue
        row[name] = {"ms": ms, "rel_err": err, "bits_equal_unsplit": same}
        tflops = 2 * m * n * k / ms / 1e9 if ms else 0.0
        print(f"M={m} N={n} K={k} {name}: {ms} ms, {tflops:.0f} TFLOP/s ({tflops / peak:.0%} of peak), "
              f"rel err {err:.1e}, bits = unsplit: {same}", flush=True)  # fmt: skip
    return row


def main() -> int:
    if sys.argv[1:] == ["--compile"]:
        for name in VARIANTS:
            compile_for_sm90(name)
        return 0
    from deepinfer.bench import time_graph_ms

    size = 8192  # the FP8 peak, as gemm_kloop.py measures it: tensor-wise scaled_mm at 8192^3
    x = torch.randn(size, size, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    ms = time_graph_ms(lambda i: torch._scaled_mm(x, x.t(), one, one, out_dtype=torch.bfloat16), sets=1, reps=20)
    peak = 2 * size**3 / ms / 1e9
    report = {"device": torch.cuda.get_device_name(), "fp8_peak_tflops": peak, "rows": []}
    print(f"FP8 peak (same run): {peak:.0f} TFLOP/s", flush=True)
    shapes = [(4096, n, k) for n, k in PROJECTIONS] + [(8192, 2112, 7168), (512, 4096, 7168)]
    if sys.argv[2:3] == ["sweep"]:  # over row counts, where ``gemm`` takes the kernel
        rows = [int(m) for m in sys.argv[3].split(",")] if sys.argv[3:] else [1024, 2048, 4096, 8192, 16384]
        shapes = [(m, n, k) for n, k in PROJECTIONS if k <= MAX_K for m in rows]
    for m, n, k in shapes:
        report["rows"].append(shape_row(m, n, k, peak))
        with open(sys.argv[1], "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
