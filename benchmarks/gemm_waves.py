"""Whether cuBLAS's block-scaled FP8 ``gemm`` is bound by waves of tiles where it misses 75% of the FP8 peak,
(N, K) = (2112, 7168) at 4096 rows: with 128 x 128 tiles, 32 x 17 = 544 tiles are 4.12 waves of 132 SMs. Times
cuBLAS at row counts around it, names the kernel it runs, and times the product split in two launches by rows: the
first a whole number of waves, the second the rest (each checked against the dequantised product): both by cuBLAS,
or the first by cuBLAS straight into the output's first rows and the rest by the Triton kernel split over K
(``tail split S``), so that the rest's few tiles spread over the SMs instead of taking a whole tile's time; or the
rest by the few-row Gluon kernel (``rest few rows``; both: ``first + few rows``, ``gemm_gluon.gemm_fp8_cublas_waves``,
which ``gemm`` runs up to ``CUBLAS_SPLIT_MAX_WAVES`` whole waves since the thirty-ninth session; timed here at every
row count where the rest fits the few-row kernel).

    python3 benchmarks/gemm_waves.py OUT.json [NxK,...] [M,...]    (on the GPU)
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from functools import partial

import torch
from gemm_tiles import SETS, fp8_peak_tflops, inputs, rel_err

from deepinfer.bench import time_graph_ms
from deepinfer_cuda_sm100 import gemm, gemm_gluon
from deepinfer_cuda_sm100._triton import num_sms


def whole_waves(m: int, n: int, tile: int = 128) -> int:
    """The most rows, a multiple of ``tile``, whose ``tile`` x ``tile`` tiles fit in the whole waves of ``m`` rows'
    tiles (4 waves at 4096 x 2112: 3968 rows)."""
    sms, grid_n = num_sms(), -(-n // tile)
    waves = -(-m // tile) * grid_n // sms
    return waves * sms // grid_n * tile


def cublas_into(a, w, out: torch.Tensor) -> torch.Tensor:
    """``gemm.gemm_fp8_cublas`` written into ``out`` (rows a multiple of 4), through ``_scaled_mm_v2``'s out form."""
    recipe = torch.nn.functional.ScalingType
    scale_a = a.scale.t().contiguous().t()
    return torch._scaled_mm_v2(
        a.data, w.data.t(), [scale_a], [recipe.BlockWise1x128.value], [], [w.scale.t()],
        [recipe.BlockWise128x128.value], [], None, torch.bfloat16, [], False, out=out,
    )  # fmt: skip


def kernel_names(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(0)
        torch.cuda.synchronize()
    return sorted({e.key for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA})


def row(m: int, n: int, k: int, peak: float) -> dict:
    a, w = inputs(m, n, k, seed=m + n + k)
    want = a[0].dequantize() @ w[0].dequantize().t()
    cublas = lambda x, y: gemm.gemm_fp8_cublas(x, y, out_dtype=torch.bfloat16, bias=None)
    first = whole_waves(m, n)
    halves = [[replace(t, data=t.data[:first], scale=t.scale[:first]) for t in a],
              [replace(t, data=t.data[first:], scale=t.scale[first:]) for t in a]]  # fmt: skip
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")

    def split(i):
        out[:first] = cublas(halves[0][i], w[i])
        out[first:] = cublas(halves[1][i], w[i])
        return out

    def tail(i, parts):
        rest = halves[1][i]
        tile = gemm.Tile(64, 128, 4, 4, split_k=parts)
        return gemm._launch_gemm(rest.data, w[i].data, out[first:], rest.scale, w[i].scale, None, False, tile)

    def streamed(i, parts):
        cublas_into(halves[0][i], w[i], out[:first])
        tail(i, parts)
        return out

    sides = {"whole": lambda i: cublas(a[i], w[i]), "split": split,
             "first": lambda i: cublas(halves[0][i], w[i]), "rest": lambda i: cublas(halves[1][i], w[i])}  # fmt: skip
    if gemm_gluon.cublas_whole_waves(m, n, k, num_sms()) == first:
        sides |= {
            "rest few rows": lambda i: gemm_gluon.launch_few_rows(halves[1][i], w[i], out=out[first:]),
            "first + few rows": lambda i: gemm_gluon.gemm_fp8_cublas_waves(
                a[i], w[i], out_dtype=torch.bfloat16, bias=None
            ),
        }
    for parts in (4, 8, 14):
        sides |= {
            f"tail split {parts}": partial(tail, parts=parts),
            f"first + tail {parts}": partial(streamed, parts=parts),
        }
    result = {"M": m, "N": n, "K": k, "first_rows": first, "tiles_128": -(-m // 128) * -(-n // 128)}
    for name, fn in sides.items():
        whole = name in ("whole", "split") or name.startswith("first +")
        try:
            err = rel_err(fn(0), want) if whole else None
            ms = time_graph_ms(fn, sets=SETS, reps=50)
        except Exception as e:  # reported, not hidden
            result[name] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"M={m} N={n} K={k} {name}: {result[name]}", flush=True)
            continue
        rows = m if whole else (first if name == "first" else m - first)  # "rest few rows": timed, not checked
        result[name] = {"ms": ms, "rel_err": err, "pct_peak": 2 * rows * n * k / ms / 1e9 / peak}
        print(f"M={m} N={n} K={k} {name} ({rows} rows): {ms:.4f} ms, {result[name]['pct_peak']:.0%} of peak"
              + (f", rel err {err:.1e}" if err is not None else ""), flush=True)  # fmt: skip
    result["kernels"] = kernel_names(sides["whole"])
    print("  kernels:", result["kernels"], flush=True)
    return result


def main() -> int:
    gemm_gluon.CUBLAS_SPLIT_MAX_WAVES = 1 << 30  # the split timed past the waves where ``gemm`` takes it
    given = sys.argv[2] if len(sys.argv) > 2 else "2112x7168"
    shapes = [tuple(int(d) for d in shape.split("x")) for shape in given.split(",")]
    rows = [int(m) for m in sys.argv[3].split(",")] if len(sys.argv) > 3 else [1024, 2048, 3072, 3968, 4096, 8192]
    peak = fp8_peak_tflops()
    print(f"FP8 peak (same run): {peak:.0f} TFLOP/s", flush=True)
    report = {"device": torch.cuda.get_device_name(), "fp8_peak_tflops": peak, "rows": []}
    for n, k in shapes:
        for m in rows:
            report["rows"].append(row(m, n, k, peak))
            with open(sys.argv[1], "w") as f:
                json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
