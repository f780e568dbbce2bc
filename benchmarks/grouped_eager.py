"""What the host adds to an eager ``grouped_gemm`` call: eager and CUDA-graph medians of the op beside the
per-expert ``scaled_mm`` loop (the bench's issue-7 peer, eager only: it reads the row counts on the host), at the
bench's shapes (32 experts, bf16 activations quantised inside the op); then where the host time goes: the host
milliseconds until each piece returns (after a synchronisation, so the device is idle when it starts).

Usage: python3 benchmarks/grouped_eager.py [ROWS_PER_EXPERT ...]   (default 512)"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import deepinfer
from deepinfer import bench, ops
from deepinfer.conformance.cases import Gen
from deepinfer.validation import Check


def host_ms(fn, reps: int = 30) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def host_breakdown(kw: dict) -> None:
    from deepinfer_cuda_sm100 import gemm

    qa = gemm._as_fp8(kw["a"], kw["w"])
    pieces = {
        "whole op": lambda: ops.grouped_gemm(**kw),
        "backend only (no core checks)": lambda: gemm.grouped_gemm(**kw),
        "backend, FP8 activations given": lambda: gemm.grouped_gemm(**(kw | {"a": qa})),
        "quantize_fp8": lambda: gemm.quantize_fp8(kw["a"], block=128, scale_format=kw["w"].scale_format),
        "offsets check": lambda: Check("grouped_gemm").nondecreasing_offsets(
            "expert_offsets", kw["expert_offsets"], kw["a"].shape[0]
        ),
    }
    print("  host ms: " + ", ".join(f"{name} {host_ms(fn):.3f}" for name, fn in pieces.items()), flush=True)


def main() -> int:
    deepinfer.use("cuda_sm100")
    wanted = {f"rows/expert={m}" for m in (sys.argv[1:] or ["512"])}
    for index, case in enumerate(bench._grouped_cases(quick=False)):
        if case.name.split()[-1] not in wanted:
            continue
        inputs = [case.make(Gen(1000 * index + s, "cuda")) for s in range(3)]
        ours = lambda i, inputs=inputs: ops.grouped_gemm(**inputs[i])
        loop = lambda i, inputs=inputs: bench._per_expert_scaled_mm(inputs[i])
        eager, graph = bench.time_ms(ours, "cuda", sets=3), bench.time_graph_ms(ours, sets=3)
        peer = bench.time_ms(loop, "cuda", sets=3)
        print(
            f"{case.name}: ours eager {eager:.3f} ms, graph {graph:.3f} ms (host adds {eager - graph:.3f}); "
            f"per-expert loop eager {peer:.3f} ms: {peer / eager:.2f}x eager to eager, {peer / graph:.2f}x to graph",
            flush=True,
        )
        host_breakdown(inputs[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
