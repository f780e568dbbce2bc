"""Where batch-invariant FP8 ``gemm``'s block-product launch spends its time (one CUDA GPU): the product kernel
alone (which stores each K block's product) and the kernel that adds them in K order alone, beside the unsplit launch
and the default mode's, at a few rows of the long DeepSeek-V3 projections. Every launch's bits are compared with
the unsplit launch's.

    python3 benchmarks/gemm_block_products.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.bench import time_graph_ms
from deepinfer.qtensor import quantize_blocks, quantize_rows
from deepinfer_cuda_sm100 import gemm

SETS = 4


@triton.jit
def _sum_chunked_kernel(parts_ptr, as_ptr, bs_ptr, out_ptr, MN, N, stride_om, KB: tl.constexpr, CH: tl.constexpr,
                        BLOCK: tl.constexpr):  # fmt: skip
    """``_sum_block_products_kernel`` (no bias) loading CH K blocks at a time as one [BLOCK, CH] tile."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < MN
    m, n = i // N, i % N
    cols = tl.arange(0, CH)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in tl.static_range(0, KB, CH):
        kb = c + cols
        both = mask[:, None] & (kb < KB)[None, :]
        parts = tl.load(parts_ptr + kb[None, :] * MN + i[:, None], mask=both, other=0.0)
        sa = tl.load(as_ptr + m[:, None] * KB + kb[None, :], mask=both, other=0.0)
        sb = tl.load(bs_ptr + (n // 128)[:, None] * KB + kb[None, :], mask=both, other=0.0)
        s = sa * sb
        for j in tl.static_range(CH):
            if c + j < KB:
                pick = cols[None, :] == j
                acc = acc + tl.sum(tl.where(pick, parts, 0.0), axis=1) * tl.sum(tl.where(pick, s, 0.0), axis=1)
    tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def case(n: int, k: int, m: int, w: list, gen: torch.Generator) -> str:
    a = [quantize_rows(torch.randn(m, k, device="cuda", generator=gen), 128, "fp32") for _ in range(SETS)]

    def launch(i: int, tile: gemm.Tile) -> torch.Tensor:
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        return gemm._launch_gemm(a[i].data, w[i].data, out, a[i].scale, w[i].scale, None, True, tile)

    unsplit, default = gemm._unsplit_tile(m, n, k), gemm._tile(m, n, k, True, False)
    want = bits(launch(0, unsplit))
    line = [f"N={n} K={k} M={m}: unsplit {time_graph_ms(lambda i: launch(i, unsplit), sets=SETS):.4f}"]
    line.append(f"default {time_graph_ms(lambda i: launch(i, default), sets=SETS):.4f}")
    for tile in (gemm.Tile(64, 64, 4, 4, 4, True), gemm.Tile(64, 128, 4, 4, 4, True),
                 gemm.Tile(64, 64, 4, 4, 2, True), gemm.Tile(64, 64, 4, 4, 8, True)):  # fmt: skip
        total = time_graph_ms(lambda i, t=tile: launch(i, t), sets=SETS)
        same = torch.equal(bits(launch(0, tile)), want)
        real, gemm._sum_block_products_kernel = gemm._sum_block_products_kernel, _NoLaunch()
        try:
            alone = time_graph_ms(lambda i, t=tile: launch(i, t), sets=SETS)
        finally:
            gemm._sum_block_products_kernel = real
        line.append(f"bp {tile.block_n}x{tile.split_k} {total:.4f} (products {alone:.4f}) same {same}")
    kb = k // 128
    parts = [torch.randn(kb, m, n, device="cuda", generator=gen) for _ in range(SETS)]
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")

    def add(i: int, kernel, block: int, **extra) -> torch.Tensor:
        bias = (w[i].scale,) if kernel is gemm._sum_block_products_kernel else ()  # an unread bias pointer
        args = (parts[i], a[i].scale, w[i].scale, *bias, out, m * n, n, out.stride(0))
        kernel[(triton.cdiv(m * n, block),)](*args, KB=kb, BLOCK=block, **extra)
        return out

    ref = bits(add(0, gemm._sum_block_products_kernel, 128, HAS_BIAS=False)).clone()
    for name, kernel, block, extra in (("sum", gemm._sum_block_products_kernel, 128, {"HAS_BIAS": False}),
                                       ("sum-ch8", _sum_chunked_kernel, 256, {"CH": 8}),
                                       ("sum-ch16", _sum_chunked_kernel, 256, {"CH": 16})):  # fmt: skip
        ms = time_graph_ms(lambda i, kernel=kernel, block=block, extra=extra: add(i, kernel, block, **extra), sets=SETS)
        line.append(f"{name} {ms:.4f} same {torch.equal(bits(add(0, kernel, block, **extra)), ref)}")
    return "; ".join(line)


def main() -> None:
    for n, k in [(7168, 16384), (4096, 7168), (2112, 7168)]:
        gen = torch.Generator(device="cuda").manual_seed(n + k)
        w = [quantize_blocks(torch.randn(n, k, device="cuda", generator=gen) * k**-0.5) for _ in range(SETS)]
        for m in (1, 8):
            print(case(n, k, m, w, gen), flush=True)


if __name__ == "__main__":
    main()
