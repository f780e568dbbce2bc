"""The warp-specialized, persistent Gluon FP8 GEMM (``backends/cuda_sm100/gemm_gluon.py``) beside cuBLAS, in its
schedules: A streamed (4 stages) and A resident in shared memory (K <= 512; 4 or 5 stages of B, 5 is what ``gemm``
takes). It measures whether Hopper's usual GEMM schedule reaches 75% of the FP8 peak at M = 4096 on the DeepSeek-V3
projections where cuBLAS does not, and times each side against a ceiling measured in the same rounds. Other tiles
are in git history: 128 x 128 (commit b51e50a), 128 x 176 (commit 032aead); benchmarks/NOTES.md, gemm, has every
variant's outcome.

    python3 benchmarks/gluon_gemm_ws.py OUT.json        (on the GPU: each side checked against the dequantised product
                                                         and bit for bit against the unsplit kernel, then timed from
                                                         CUDA graphs; M = 4096 on every projection, and two more)
    python3 benchmarks/gluon_gemm_ws.py OUT.json sweep [M,...] [--rev REV] [--shapes NxK,...] [--rounds R]
                                                         (over row counts, on the projections gemm gives it, or on
                                                         the (N, K) given; with the resident schedule as committed
                                                         at git REV beside the working tree's; every side timed R
                                                         times, interleaved, default 3)
    python3 benchmarks/gluon_gemm_ws.py OUT.json trace  (the first program's timeline at M = 4096, (32768, 512), from
                                                         the SM's cycle counter: when each consumer's stage was ready
                                                         and its product done, block by block, and each step of its
                                                         epilogue)
    python3 benchmarks/gluon_gemm_ws.py --compile       (anywhere: compiles every variant for SM90, prints resources and
                                                         whether ptxas serialized the wgmma instructions)
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch
import triton

from deepinfer_cuda_sm100.gemm_gluon import MAX_K, MAX_RESIDENT_K, RESIDENT, STREAMED, WsSchedule, launch

VARIANTS = {"streamed 4st": STREAMED, "resident 4st": replace(RESIDENT, stages=4), "resident 5st": RESIDENT}


def compile_for_sm90(name: str) -> None:
    """Compiles the kernel for SM90 without a GPU, as ``launch`` does, and prints what ptxas reports of it (the CPU
    tests' helpers: ``tests/gluon_helpers.py``)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from gluon_helpers import compile_gemm_sm90, ptxas_report, wgmma_serialized

    kernel = compile_gemm_sm90(VARIANTS[name])
    report = ptxas_report(kernel.asm["ptx"])
    registers = max(int(r) for r in re.findall(r"Used (\d+) registers", report))
    stack = max(int(r) for r in re.findall(r"(\d+) bytes stack frame", report))
    print(f"Triton {triton.__version__}, SM90, {name}, K=512: registers {registers}, stack {stack}, shared "
          f"{kernel.metadata.shared} bytes, wgmma serialized by ptxas: {wgmma_serialized(report)}")  # fmt: skip


PROJECTIONS = ((24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048), (2112, 7168))  # DeepSeek-V3


def shape_row(m: int, n: int, k: int, peak: float, variants=VARIANTS, rounds: int = 3) -> dict:
    """Each side against the dequantised product (and the Gluon kernel bit for bit against the unsplit ``tl``
    kernel, whose bits batch-invariant mode keeps), then timed from CUDA graphs on the same inputs, ``rounds`` times
    with the sides interleaved, the FP8 ceiling's product among them (each round in another order: the board's power
    limit moves the clock within a run, the ceiling's too: 1459 TFLOP/s cold, 1266-1334 a few seconds on). Per side:
    the median over rounds, the rounds' spread, and the medians of its per-round ratios to cuBLAS and to the ceiling
    (``peak``, measured once before, is printed beside them)."""
    from gemm_tiles import SETS, fp8_ceiling, inputs, rel_err

    from deepinfer.bench import time_graph_ms
    from deepinfer_cuda_sm100 import gemm, gemm_cublas

    a, w = inputs(m, n, k, seed=m + n + k)
    want = a[0].dequantize() @ w[0].dequantize().t()
    unsplit = gemm.gemm_fp8(a[0], w[0], out_dtype=torch.bfloat16, bias=None, invariant=True).view(torch.int16)
    sides = {"cublas": lambda i: gemm_cublas.gemm_fp8_cublas(a[i], w[i], out_dtype=torch.bfloat16, bias=None)} | {
        name: lambda i, v=v: launch(a[i], w[i], v) if isinstance(v, WsSchedule) else v(a[i], w[i])
        for name, v in variants.items()
        if k <= MAX_RESIDENT_K or not isinstance(v, WsSchedule) or not v.resident
    }
    row = {"M": m, "N": n, "K": k}
    for name, fn in list(sides.items()):
        try:
            got = fn(0)
            err = rel_err(got, want)
            same = bool(torch.equal(got.view(torch.int16), unsplit))
        except Exception as e:  # a variant the compiler or driver refuses is reported, not hidden
            row[name] = f"{type(e).__name__}: {str(e)[:200]}"
            print(f"M={m} N={n} K={k} {name}: {row[name]}", flush=True)
            del sides[name]
            continue
        row[name] = {"rel_err": err, "bits_equal_unsplit": same, "ms_rounds": []}
        if err >= 1e-2:
            print(f"M={m} N={n} K={k} {name}: rel err {err:.1e}, not timed", flush=True)
            del sides[name]
    names = list(sides)
    ceiling, ceiling_flops = fp8_ceiling()
    sides["ceiling"], row["ceiling"] = ceiling, {"ms_rounds": []}
    order = [*names, "ceiling"]
    for r in range(rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            row[name]["ms_rounds"].append(time_graph_ms(sides[name], sets=1 if name == "ceiling" else SETS, reps=30))
    row["ceiling"]["tflops_rounds"] = [ceiling_flops / ms / 1e9 for ms in row["ceiling"]["ms_rounds"]]
    print(f"M={m} N={n} K={k} FP8 ceiling in the rounds: "
          f"{', '.join(f'{t:.0f}' for t in row['ceiling']['tflops_rounds'])} TFLOP/s", flush=True)  # fmt: skip
    for name in names:
        side = row[name]
        times = side["ms_rounds"]
        side["ms"] = statistics.median(times)
        ratios = [c / t for c, t in zip(row["cublas"]["ms_rounds"], times, strict=True)] if "cublas" in sides else []
        side["vs_cublas"] = statistics.median(ratios) if ratios else None
        shares = [2 * m * n * k / t / 1e9 / c for t, c in zip(times, row["ceiling"]["tflops_rounds"], strict=True)]
        side["of_ceiling"] = statistics.median(shares)
        tflops = 2 * m * n * k / side["ms"] / 1e9
        against = f", {side['vs_cublas']:.2f}x cuBLAS" if ratios else ""
        print(f"M={m} N={n} K={k} {name}: {side['ms']:.4f} ms ({min(times):.4f}-{max(times):.4f}), {tflops:.0f} "
              f"TFLOP/s ({side['of_ceiling']:.0%} of the ceiling in the rounds, {tflops / peak:.0%} of the peak "
              f"before){against}, rel err {side['rel_err']:.1e}, bits = unsplit: {side['bits_equal_unsplit']}",
              flush=True)  # fmt: skip
    return row


def summarize(stamps: list, stores: list, blocks: int) -> dict:
    """Medians per consumer of a traced timeline (cycles): ``busy``, a K block's stage ready to its product done;
    ``gap``, a product done to the next stage ready within a tile; ``boundary``, the tile's last product done to the
    next tile's first stage ready, split into ``epilogue`` (to the store issued) and ``tile_start``; ``per_tile``.
    ``alone``: the median latency of products with no other in flight; ``in_flight``: the share of the time some
    product was."""
    med = statistics.median
    n, tiles = len(stamps), len(stamps) // blocks
    out = {key: [] for key in ("busy", "gap", "boundary", "epilogue", "tile_start", "per_tile")}
    for c in range(3):
        ready, done = [s[c][0] for s in stamps], [s[c][1] for s in stamps]
        out["busy"].append(med(d - r for r, d in zip(ready, done)))
        out["gap"].append(med(ready[i + 1] - done[i] for i in range(n - 1) if (i + 1) % blocks))
        out["boundary"].append(med(ready[i + 1] - done[i] for i in range(n - 1) if (i + 1) % blocks == 0))
        out["epilogue"].append(med(stores[t][c] - done[t * blocks + blocks - 1] for t in range(tiles)))
        out["tile_start"].append(med(ready[(t + 1) * blocks] - stores[t][c] for t in range(tiles - 1)))
        out["per_tile"].append(med(ready[(t + 1) * blocks] - ready[t * blocks] for t in range(tiles - 1)))
    spans = sorted(tuple(s[c]) for s in stamps for c in range(3))
    alone = [hi - lo for i, (lo, hi) in enumerate(spans)
             if all(end <= lo or start >= hi for j, (start, end) in enumerate(spans) if j != i)]  # fmt: skip
    covered, end = 0, spans[0][0]
    for lo, hi in spans:
        covered += max(0, hi - max(lo, end))
        end = max(end, hi)
    total = max(s[c][1] for s in stamps for c in range(3)) - spans[0][0]
    return out | {"alone": med(alone) if alone else None, "in_flight": covered / total}


def timeline(m: int = 4096, n: int = 32768, k: int = 512, tiles: int = 10, skip: int = 2) -> dict:
    """The resident schedule's first program, traced over its first ``tiles`` tiles (``launch(..., trace=...)``), the
    first ``skip`` left out; ``summarize``'s medians, the epilogue's steps (``to_store``: the last block's scaling
    and the release of A; ``store_wait``, ``smem_copy``, ``fence``, ``tma_issue``; then ``next_coords``: the next
    tile's coordinates and first scales, up to its first stage's wait), and the launch's graph time with and without
    the trace."""
    from gemm_tiles import inputs

    from deepinfer.bench import time_graph_ms

    a, w = inputs(m, n, k, seed=7)
    blocks = k // 128
    trace = torch.zeros(3 * (2 * blocks + 6) * tiles, dtype=torch.int64, device="cuda")
    for _ in range(3):
        launch(a[0], w[0], RESIDENT, trace)
    torch.cuda.synchronize()
    t = trace.cpu()
    stamps = t[: tiles * blocks * 6].view(tiles * blocks, 3, 2)[skip * blocks :]  # [block, consumer, (ready, done)]
    steps = t[tiles * blocks * 6 :].view(tiles, 3, 6)[skip:]  # [tile, consumer, epilogue steps and tile start]
    stores = steps[:, :, 4]
    base = int(stamps[0, :, 0].min())
    stamps, stores, steps = (stamps - base).tolist(), (stores - base).tolist(), (steps - base).tolist()
    med = statistics.median
    names = ("to_store", "store_wait", "smem_copy", "fence", "tma_issue", "next_coords")
    fine = {name: [med(steps[t][c][j] - (stamps[t * blocks + blocks - 1][c][1] if j == 0 else steps[t][c][j - 1])
                       for t in range(len(steps) - 1)) for c in range(3)] for j, name in enumerate(names)}  # fmt: skip
    summary = (
        summarize(stamps, stores, blocks)
        | fine
        | {
            "graph_ms_untraced": time_graph_ms(lambda i: launch(a[i], w[i], RESIDENT), sets=4, reps=30),
            "graph_ms_traced": time_graph_ms(lambda i: launch(a[i], w[i], RESIDENT, trace), sets=4, reps=30),
        }
    )
    for i, block in enumerate(stamps[: 3 * blocks]):
        print(f"block {i}: " + "  ".join(f"c{c} {r:6d}..{d:6d}" for c, (r, d) in enumerate(block)), flush=True)
    print(json.dumps(summary), flush=True)
    return {"stamps": stamps, "stores": stores, **summary}


def _option(args: list[str], flag: str) -> str | None:
    """The value after ``flag`` in ``args``, both taken out of it; None without the flag."""
    if flag not in args:
        return None
    value = args.pop(args.index(flag) + 1)
    args.remove(flag)
    return value


def main() -> int:
    if sys.argv[1:] == ["--compile"]:
        for name in VARIANTS:
            compile_for_sm90(name)
        return 0
    if sys.argv[2:3] == ["trace"]:
        with open(sys.argv[1], "w") as f:
            json.dump(timeline(), f)
        return 0
    from gemm_tiles import fp8_peak_tflops

    peak = fp8_peak_tflops()
    report = {"device": torch.cuda.get_device_name(), "fp8_peak_tflops": peak, "rows": []}
    print(f"FP8 peak (same run): {peak:.0f} TFLOP/s", flush=True)
    shapes = [(4096, n, k) for n, k in PROJECTIONS] + [(8192, 2112, 7168), (512, 4096, 7168)]
    variants, rounds = VARIANTS, 3
    if sys.argv[2:3] == ["sweep"]:  # over row counts, where ``gemm`` takes the kernel
        args = sys.argv[3:]
        rounds = int(_option(args, "--rounds") or rounds)
        if rev := _option(args, "--rev"):
            from ab_against_git import module_at

            variants = VARIANTS | {f"resident 5st at {rev}": module_at(rev, "gemm_gluon").launch}
        projections = [(n, k) for n, k in PROJECTIONS if k <= MAX_K]
        if given := _option(args, "--shapes"):
            projections = [tuple(int(d) for d in shape.split("x")) for shape in given.split(",")]
        rows = [int(m) for m in args[0].split(",")] if args else [1024, 2048, 4096, 8192, 16384]
        shapes = [(m, n, k) for n, k in projections for m in rows]
    for m, n, k in shapes:
        report["rows"].append(shape_row(m, n, k, peak, variants, rounds))
        with open(sys.argv[1], "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
