"""Where the time of a few-row FP8 ``gemm`` goes (default mode, one CUDA GPU): each V3 projection at a few rows,
timed two ways from CUDA graphs: one call per graph (the graph's own launch included), and chained, many calls
back to back in one graph (``time_graph_ms``'s default, as a decode step's graph runs them), beside the time its
weight takes to stream at the copy bandwidth measured in the same run and the one-call time of a graph of one trivial
kernel. Up to ``SWAP_MAX_M`` rows, the swapped kernel's split over K is swept (1, 2, 4, 8, 16 spans).

    python3 benchmarks/gemm_small_m.py OUT.json [M,...]     (default 1,16,64)
"""

from __future__ import annotations

import json
import sys

import torch
from gemm_tiles import SETS, inputs, rel_err

from deepinfer.bench import measure_ceilings, time_graph_ms
from deepinfer.conformance.gemm import V3_PROJECTIONS
from deepinfer_cuda_sm100 import gemm


def shape_rows(m: int, n: int, k: int, bandwidth: float) -> list[dict]:
    """The default mode's launch at [m, n, k], and up to ``SWAP_MAX_M`` rows the swapped kernel at each split."""
    a, w = inputs(m, n, k, seed=m + n + k)
    want = a[0].dequantize() @ w[0].dequantize().t()
    floor_us = (n * k + w[0].scale.numel() * 4) / bandwidth * 1e6
    sides = {"default": lambda i: gemm.gemm_fp8(a[i], w[i], out_dtype=torch.bfloat16, bias=None)}
    if m <= gemm.SWAP_MAX_M:
        for split in (1, 2, 4, 8, 16):
            tile = gemm.SWAPPED_TILE._replace(num_stages=4, split_k=split)
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            sides[f"swapped split {split}"] = lambda i, t=tile, out=out: gemm._launch_gemm(
                a[i].data, w[i].data, out, a[i].scale, w[i].scale, None, False, t)  # fmt: skip
    rows = []
    for name, fn in sides.items():
        err = rel_err(fn(0), want)
        us = time_graph_ms(fn, sets=SETS, reps=50, chain_below_ms=None) * 1e3
        chained = time_graph_ms(fn, sets=SETS, reps=50) * 1e3
        rows.append({"M": m, "N": n, "K": k, "side": name, "us": us, "chained_us": chained, "floor_us": floor_us,
                     "rel_err": err})  # fmt: skip
        print(f"M={m} (N, K)=({n}, {k}) {name}: {us:.1f} us alone, {chained:.1f} us chained (weight at copy "
              f"bandwidth {floor_us:.1f} us: {floor_us / chained:.0%}), rel err {err:.1e}", flush=True)  # fmt: skip
    return rows


def main() -> int:
    rows = [int(m) for m in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 16, 64]
    bandwidth = measure_ceilings("cuda", quick=False)["copy_GBps"] * 1e9  # as ``deepinfer bench`` measures it
    x = torch.zeros(1, device="cuda")
    trivial = time_graph_ms(lambda i: x.add_(1), sets=1, reps=50, chain_below_ms=None) * 1e3
    print(f"copy bandwidth (same run): {bandwidth / 1e9:.0f} GB/s; a graph of one trivial kernel: {trivial:.1f} us",
          flush=True)  # fmt: skip
    report = {"device": torch.cuda.get_device_name(), "copy_gb_s": bandwidth / 1e9, "trivial_graph_us": trivial,
              "rows": []}  # fmt: skip
    for n, k in V3_PROJECTIONS:
        for m in rows:
            report["rows"] += shape_rows(m, n, k, bandwidth)
            with open(sys.argv[1], "w") as f:
                json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
