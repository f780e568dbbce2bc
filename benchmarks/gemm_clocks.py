"""The SM clock and board power while each FP8 product below 75% of the peak runs, beside the peak's own product:
whether the shortfall is the clock. Each case is replayed from a CUDA graph for about two seconds while
``nvidia-smi`` samples clocks and power every 20 ms; the medians of the samples taken during the case are reported
with its graph time.

    python3 benchmarks/gemm_clocks.py OUT.json       (on the GPU)
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import torch
from gemm_tiles import inputs

from deepinfer.bench import time_graph_ms
from deepinfer_cuda_sm100 import gemm, gemm_gluon


def replay_for(fn, seconds: float) -> tuple[float, float]:
    """``fn`` captured in a CUDA graph and replayed back to back for ``seconds``: (start, end) wall times."""
    graph = torch.cuda.CUDAGraph()
    fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        fn()
    start = time.time()
    while time.time() - start < seconds:
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
    return start, time.time()


def main() -> int:
    x = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    cases = {"peak 8192^3 tensor-wise": (lambda: torch._scaled_mm(x, x.t(), one, one, out_dtype=torch.bfloat16),
                                         2 * 8192**3)}  # fmt: skip
    cublas = lambda a, w: gemm.gemm_fp8_cublas(a, w, out_dtype=torch.bfloat16, bias=None)
    for m, n, k, name, fn in (
        (4096, 32768, 512, "gluon", gemm_gluon.launch),
        (8192, 32768, 512, "gluon", gemm_gluon.launch),
        (4096, 2112, 7168, "cublas", cublas),
        (3968, 2112, 7168, "cublas", cublas),
        (8192, 2112, 7168, "cublas", cublas),
    ):
        a, w = inputs(m, n, k, seed=m + n)
        cases[f"{name} M={m} (N, K)=({n}, {k})"] = (lambda a=a[0], w=w[0], fn=fn: fn(a, w), 2 * m * n * k)
    smi = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "20"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    spans = {}
    time.sleep(1.0)
    for name, (fn, _) in cases.items():
        spans[name] = replay_for(fn, 2.0)
        time.sleep(0.5)
    smi.terminate()
    samples = []
    for line in smi.communicate()[0].splitlines():
        stamp, clock, power = (field.strip() for field in line.split(","))
        when = time.mktime(time.strptime(stamp.split(".")[0], "%Y/%m/%d %H:%M:%S")) + float("0." + stamp.split(".")[1])
        samples.append((when, float(clock), float(power)))
    report = {"device": torch.cuda.get_device_name(), "cases": {}}
    for name, (fn, flop) in cases.items():
        start, end = spans[name]
        inside = [(c, p) for t, c, p in samples if start + 0.3 <= t <= end]
        ms = time_graph_ms(lambda i, fn=fn: fn(), sets=1, reps=30)
        row = {"ms": ms, "tflops": flop / ms / 1e9, "samples": len(inside),
               "sm_mhz": statistics.median(c for c, _ in inside) if inside else None,
               "power_w": statistics.median(p for _, p in inside) if inside else None}  # fmt: skip
        report["cases"][name] = row
        print(f"{name}: {ms:.4f} ms, {row['tflops']:.0f} TFLOP/s, SM clock {row['sm_mhz']} MHz, "
              f"power {row['power_w']} W ({len(inside)} samples)", flush=True)  # fmt: skip
    with open(sys.argv[1], "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
