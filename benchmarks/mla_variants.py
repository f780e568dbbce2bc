"""mla_decode tile variants on the device: each checked against the reference, then timed (median of CUDA-event
timings over rotated input sets), at DeepSeek-V3 shapes (H=128, 512+64, page 64)."""

from __future__ import annotations

import itertools
import statistics
import sys

import torch

import deepinfer
from deepinfer import ops
from deepinfer.kv_cache import pack_fp8_ds_mla
from deepinfer_cuda_sm100 import attention


def make(batch: int, ctx: int, fmt: str, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = ctx // 64
    cache = deepinfer.allocate_kv_cache(batch * pages, 64, kv_lora_rank=512, rope_dim=64, kv_format=fmt, device="cuda")
    latent = torch.randn(batch * pages * 64, 576, device="cuda", generator=gen).bfloat16()
    cache.view(batch * pages * 64, -1).copy_(latent if fmt == "bf16" else pack_fp8_ds_mla(latent, 512))
    table = torch.randperm(batch * pages, device="cuda", generator=gen).view(batch, pages).int()
    q = torch.randn(batch, 1, 128, 576, device="cuda", generator=gen).bfloat16()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return {"q": q, "kv_cache": cache, "block_table": table, "seq_lens": lens, "softmax_scale": 192**-0.5}


def time_ms(inputs) -> float:
    times = []
    for i in range(40):
        kw = inputs[i % len(inputs)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        ops.mla_decode(**kw)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[5:])


def main() -> int:
    deepinfer.use("cuda_sm100")
    copy_gbps = float(sys.argv[1]) if len(sys.argv) > 1 else 4200.0
    for fmt, (batch, ctx) in itertools.product(("bf16", "fp8_ds_mla"), ((64, 4096),)):
        inputs = [make(batch, ctx, fmt, s) for s in range(3)]
        with deepinfer.use("reference"):
            ref, _ = ops.mla_decode(**inputs[0])
        width = 1152 if fmt == "bf16" else 656
        nbytes = batch * ctx * width
        for block_h, block_n, warps, stages in itertools.product((16, 32, 64), (32, 64), (4, 8), (2,)):
            attention.MLA_TILE.update(BLOCK_H=block_h, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
            try:
                out, _ = ops.mla_decode(**inputs[0])
                err = float((out.float() - ref.float()).norm() / ref.float().norm())
                ms = time_ms(inputs)
                print(
                    f"{fmt} B={batch} ctx={ctx} H=128 | BLOCK_H={block_h} BLOCK_N={block_n} warps={warps} "
                    f"stages={stages} | {ms:.3f} ms | {nbytes / ms / 1e6:.0f} GB/s "
                    f"({100 * nbytes / ms / 1e6 / copy_gbps:.0f}% of copy) | rel err {err:.1e}",
                    flush=True,
                )
            except Exception as e:
                print(
                    f"{fmt} BLOCK_H={block_h} BLOCK_N={block_n} warps={warps} stages={stages}: "
                    f"{type(e).__name__}: {str(e)[:120]}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
