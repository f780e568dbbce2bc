"""Counts Triton compilations across a steady decode-shaped loop (varying batch sizes and context lengths): after
a warm-up over the batch sizes, further steps must compile nothing."""

from __future__ import annotations

import sys

import torch

import deepinfer
from deepinfer import ops
from deepinfer.qtensor import quantize_blocks
from deepinfer_cuda_sm100 import attention, gemm


def compiled(kernel) -> int:
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


def step(batch: int, ctx: int, cache, w):
    page = cache.shape[1]
    pages = cache.shape[0] // 256
    table = torch.randint(0, cache.shape[0], (batch, pages), device="cuda", dtype=torch.int32)
    lens = torch.randint(1, min(ctx, pages * page) + 1, (batch,), device="cuda", dtype=torch.int32)
    q = torch.randn(batch, 1, 128, 576, device="cuda", dtype=torch.bfloat16)
    ops.mla_decode(q, cache, table, lens, softmax_scale=0.07)
    ops.gemm(torch.randn(batch, 7168, device="cuda", dtype=torch.bfloat16), w)


def main() -> int:
    deepinfer.use("cuda_sm100")
    cache = deepinfer.allocate_kv_cache(256 * 64, 64, kv_lora_rank=512, rope_dim=64, device="cuda").normal_()
    w = quantize_blocks(torch.randn(2112, 7168, device="cuda"))
    kernels = [attention._mla_split_kernel, attention._mla_merge_kernel, gemm._gemm_kernel, gemm._quantize_kernel]
    for batch in (1, 2, 3, 8, 16, 17, 64, 65, 128):  # warm-up over every batch bucket
        step(batch, 4096, cache, w)
    before = [compiled(k) for k in kernels]
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        step(int(torch.randint(1, 129, (1,), generator=gen)), 4096, cache, w)
    after = [compiled(k) for k in kernels]
    print("compiled kernel variants after warm-up:", before, "after 50 more steps:", after)
    return 0 if before == after else 1


if __name__ == "__main__":
    sys.exit(main())
