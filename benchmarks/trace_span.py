"""A cycle trace of ``mla_gluon``'s span kernel (batch-invariant ``mla_decode`` at a few rows): an instrumented copy
of ``backends/cuda_sm100/mla_gluon.py`` (written beside it for the run, then removed) stamps ``%clock64`` at fixed
points of each block in the first program, B=1, and the script prints each block's timeline and the mean of each
step. All three warpgroups of a program run on one SM, so their stamps share one clock.

- softmax warpgroups (blocks of their parity): start of the block, scores read, P computed, P published, latent filled;
- P x V warpgroup: latent stage landed, P landed, product done.

The stamps mark points in the instruction stream; arithmetic may move across them a little (the compiler orders a
stamp only against memory operations and other stamps). "P" excludes the row sums, which the publish step computes.

Usage: python3 benchmarks/trace_span.py [--ctx 4096] [--formats bf16,fp8_ds_mla]

The copy is made by exact text replacements; when the kernel changes, a replacement that no longer applies stops the
script with the text it looked for."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import torch
from tile_variants import make

import deepinfer
from deepinfer import ops
from deepinfer.dispatch import batch_invariant
from deepinfer_cuda_sm100 import attention

SOURCE = Path(__file__).resolve().parents[1] / "backends" / "cuda_sm100" / "mla_gluon.py"
TRACED = SOURCE.with_name("_mla_gluon_traced.py")
SLOTS = 8  # stamps per block
FIRST_PROGRAM = "gl.program_id(0) + gl.program_id(1) + gl.program_id(2) == 0"  # the traced program
IMPORTS = "from ._triton import hopper, num_sms\n"
SIGNATURES = [  # (text, replacement, count): gemm_gluon's stamp; trace_ptr through the kernel, its parts, the launch
    (IMPORTS, IMPORTS + "from .gemm_gluon import _stamp\n\nTRACE = None  # the launch's trace buffer\n", 1),
    ("    blocks,\n    PAGE: gl.constexpr,", "    blocks,\n    trace_ptr,\n    PAGE: gl.constexpr,", 1),
    ("FP8)),", "FP8, trace_ptr)),", 2),
    ("n_splits, W, STAGES)),", "n_splits, W, STAGES, trace_ptr)),", 1),
    ("STAGES: gl.constexpr, FP8: gl.constexpr):", "STAGES: gl.constexpr, FP8: gl.constexpr, trace_ptr):", 1),
    ("W: gl.constexpr, STAGES: gl.constexpr):", "W: gl.constexpr, STAGES: gl.constexpr, trace_ptr):", 1),
    ("n_splits, blocks,\n", "n_splits, blocks, TRACE,\n", 1),
]
STAMPS = [  # (the one line a stamp goes next to, its slot, after the line)
    ("s = _span_scores(s_s, s_ready, i, STAGES)", 0, False),
    ("BARRIER()  # every warp has read the stage", 1, True),
    ("_publish_p(p, alpha, gl.sum(p, axis=1), p_s, a_s, r_s, p_ready, p_free, i)", 2, False),
    ("_publish_p(p, alpha, gl.sum(p, axis=1), p_s, a_s, r_s, p_ready, p_free, i)", 3, True),
    ("m_i = gl.maximum(m_new, other)", 4, False),
    ("mbarrier.wait(v_ready.index(i % STAGES), (i // STAGES) & 1)", 5, True),
    ("mbarrier.wait(p_ready.index(buf), (i // 2) & 1)", 6, True),
    ("l_i = l_i * alpha + r_s", 7, False),
]


def traced_source(source: str) -> str:
    """``mla_gluon``'s source with the stamps in (each edit must apply exactly as often as listed)."""
    for text, replacement, count in SIGNATURES:
        _expect(source, text, count)
        source = source.replace(text, replacement)
    lines = source.split("\n")
    for text, slot, after in STAMPS:
        at = [n for n, line in enumerate(lines) if text in line]
        _expect(source, text, 1, len(at))
        indent = lines[at[0]][: len(lines[at[0]]) - len(lines[at[0]].lstrip())]
        lines.insert(at[0] + after, f"{indent}_stamp(trace_ptr, i * {SLOTS} + {slot}, {FIRST_PROGRAM}, 1)")
    return "\n".join(lines)


def _expect(source: str, text: str, count: int, found: int | None = None) -> None:
    found = source.count(text) if found is None else found
    if found != count:
        raise SystemExit(f"trace_span: the kernel changed; expected {count} of (found {found}):\n{text}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--formats", default="bf16,fp8_ds_mla")
    args = parser.parse_args()
    TRACED.write_text(traced_source(SOURCE.read_text()))
    try:
        traced = importlib.import_module("deepinfer_cuda_sm100._mla_gluon_traced")
    finally:
        TRACED.unlink()
    deepinfer.use("cuda_sm100")
    shipped = attention.mla_gluon, attention.MLA_SCORES_FIRST_MAX_SHARE
    attention.mla_gluon, attention.MLA_SCORES_FIRST_MAX_SHARE = traced, float("inf")
    try:
        for fmt in args.formats.split(","):
            inputs = make(1, args.ctx, fmt, seed=0)
            n_blocks = min(args.ctx, 2048) // 64  # the first span's blocks
            traced.TRACE = torch.zeros(n_blocks * SLOTS, dtype=torch.int64, device="cuda")
            with batch_invariant(True):
                for _ in range(3):  # the last launch's stamps stay
                    ops.mla_decode(**inputs)
            torch.cuda.synchronize()
            _report(fmt, traced.TRACE.view(n_blocks, SLOTS).cpu())
    finally:
        attention.mla_gluon, attention.MLA_SCORES_FIRST_MAX_SHARE = shipped


def _report(fmt: str, t: torch.Tensor) -> None:
    t = t - t[0, 5]  # cycles from block 0's latent landing
    n = t.shape[0]
    print(f"{fmt}: {n} blocks, program 0")
    print(" blk | softmax: start read P published filled | P x V: latent P product")
    for i in range(n):
        cells = [f"{int(v):8d}" for v in t[i]]
        print(f"{i:4d} | {' '.join(cells[:5])} | {' '.join(cells[5:])}")
    per_block = float(t[-1, 7] - t[0, 7]) / (n - 1)
    steps = lambda a, b, rows=slice(2, n): float((t[rows, b] - t[rows, a]).float().mean())
    wait_v = float((t[2:, 5] - t[1:-1, 7]).float().mean())
    print(f"  a block every {per_block:.0f} cycles (P x V products)")
    print(f"  softmax, per block of its own: wait and read {steps(0, 1):.0f}, P {steps(1, 2):.0f}, "
          f"publish {steps(2, 3):.0f}, fill {steps(3, 4):.0f}")  # fmt: skip
    print(f"  P x V: wait for the latent {wait_v:.0f}, for P {steps(5, 6):.0f}, product {steps(6, 7):.0f}")


if __name__ == "__main__":
    main()
