"""Tile variants of the cuda_sm100 attention kernels on the device, each checked against the reference, then timed
(median of CUDA-event timings over rotated input sets): mla_decode at DeepSeek-V3 shapes (H=128, 512+64, page 64)
and attention_varlen prefill (4 x 4096 tokens, then the default tile at 4 x 8192; H=128, D 192/128, causal) beside
torch SDPA with its own pick of kernel and with its flash path.

Usage: python3 benchmarks/tile_variants.py COPY_GBPS [mla|varlen|all]"""

from __future__ import annotations

import itertools
import sys

import torch

import deepinfer
from deepinfer import bench, ops
from deepinfer.bench import time_graph_ms
from deepinfer.kv_cache import pack_fp8_ds_mla
from deepinfer_cuda_sm100 import attention


def make(batch: int, ctx: int, fmt: str, seed: int, heads: int = 128, device: str = "cuda", short: int = 0):
    """mla_decode inputs at DeepSeek-V3's record layout, pages in random order; each sequence holds ``ctx`` tokens,
    or a random length in ``[ctx - short, ctx]``. All of ``mla_decode``'s arguments (the reference's too)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pages = ctx // 64
    cache = deepinfer.allocate_kv_cache(batch * pages, 64, kv_lora_rank=512, rope_dim=64, kv_format=fmt, device=device)
    latent = torch.randn(batch * pages * 64, 576, device=device, generator=gen).bfloat16()
    cache.view(batch * pages * 64, -1).copy_(latent if fmt == "bf16" else pack_fp8_ds_mla(latent, 512))
    table = torch.randperm(batch * pages, device=device, generator=gen).view(batch, pages).int()
    q = torch.randn(batch, 1, heads, 576, device=device, generator=gen).bfloat16()
    lens = torch.randint(ctx - short, ctx + 1, (batch,), device=device, generator=gen).int()
    scalars = {"softmax_scale": 192**-0.5, "kv_lora_rank": 512, "kv_format": fmt}
    return {"q": q, "kv_cache": cache, "block_table": table, "seq_lens": lens} | scalars


def time_ms(inputs, fn=ops.mla_decode) -> float:
    """Median device time of ``fn`` over the input sets, replayed from CUDA graphs (no host launch cost); eager
    where ``fn`` cannot be captured (varlen prefill reads its sequence lengths on the host)."""
    run = lambda i: fn(**inputs[i])
    graph = time_graph_ms(run, sets=len(inputs), reps=40)
    return graph if graph is not None else bench.time_ms(run, "cuda", sets=len(inputs), reps=20)


def varlen_inputs(seed: int, seqs: int = 4, length: int = 4096, heads: int = 128):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    t = seqs * length
    cu = torch.arange(0, seqs + 1, device="cuda", dtype=torch.int32) * length
    rand = lambda *shape: torch.randn(*shape, device="cuda", generator=gen).bfloat16()
    return {
        "q": rand(t, heads, 192),
        "k": rand(t, heads, 192),
        "v": rand(t, heads, 128),
        "cu_seqlens_q": cu,
        "cu_seqlens_k": cu,
        "softmax_scale": 192**-0.5,
        "causal": True,
    }


SDPA_PEERS = {  # core's bench peers: torch's own pick (cuDNN on the H200) and the flash path with v padded
    "its own pick": lambda **kw: bench._sdpa(kw),
    "flash, v padded to 192": lambda **kw: bench._sdpa(kw, flash=True),
}
VARLEN_VARIANTS = [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 8, 4)]  # BLOCK_M, BLOCK_N, warps, stages


def varlen_variants(length: int, variants=VARLEN_VARIANTS) -> None:
    inputs = [varlen_inputs(s, length=length) for s in range(2)]
    with deepinfer.use("reference"):
        ref = ops.attention_varlen(**inputs[0]).float()
    flops = 4 * length * length * 128 * (192 + 128)  # causal: half of 2 * L^2 * (D_qk + D_v) per sequence and head
    label = f"varlen 4 x {length}"
    for name, peer in SDPA_PEERS.items():
        ms = time_ms(inputs, peer)
        err = float((peer(**inputs[0]).float() - ref).norm() / ref.norm())
        print(
            f"{label} peer SDPA {name} | {ms:.3f} ms | {flops / ms / 1e9:.0f} TFLOP/s | rel err {err:.1e}", flush=True
        )
    for block_m, block_n, warps, stages in variants:
        attention.VARLEN_TILE = attention.VarlenTile(block_m, block_n, warps, stages)
        tile = f"BLOCK_M={block_m} BLOCK_N={block_n} warps={warps} stages={stages}"
        try:
            out = ops.attention_varlen(**inputs[0]).float()
            err = float((out - ref).norm() / ref.norm())
            ms = time_ms(inputs, ops.attention_varlen)
            print(f"{label} {tile} | {ms:.3f} ms | {flops / ms / 1e9:.0f} TFLOP/s | rel err {err:.1e}", flush=True)
        except Exception as e:
            print(f"{label} {tile}: {type(e).__name__}: {str(e)[:120]}", flush=True)


def main() -> int:
    deepinfer.use("cuda_sm100")
    copy_gbps = float(sys.argv[1]) if len(sys.argv) > 1 else 4200.0
    which = sys.argv[2] if len(sys.argv) > 2 else "all"
    if which in ("varlen", "all"):
        varlen_variants(4096)
        varlen_variants(8192, VARLEN_VARIANTS[:1])
    if which not in ("mla", "all"):
        return 0
    variants = [  # (BLOCK_H, BLOCK_N, warps, stages, split, TMA); the first is the default tile
        (64, 64, 8, 2, 1024, True),
        (64, 64, 8, 2, 1024, False),
        (64, 64, 8, 3, 1024, True),
        (64, 32, 8, 3, 1024, True),
        (64, 64, 8, 1, 1024, True),
        (64, 64, 8, 2, 512, True),
    ]
    for fmt, (batch, ctx) in itertools.product(("bf16", "fp8_ds_mla"), ((64, 4096), (128, 16384))):
        inputs = [make(batch, ctx, fmt, s) for s in range(3)]
        with deepinfer.use("reference"):
            ref, _ = ops.mla_decode(**inputs[0])
        width = 1152 if fmt == "bf16" else 656
        nbytes = batch * ctx * width
        flops = 2 * batch * ctx * 128 * (576 + 512)  # QK over 576 columns, PV over 512, for 128 heads
        for block_h, block_n, warps, stages, split, tma in variants:
            attention.MLA_TILE = attention.MlaTile(block_h, block_n, warps, stages)
            attention.MLA_TMA = tma
            attention.MAX_SPLIT_TOKENS = split  # the span at B=64 (the grid already fills the GPU)
            try:
                out, _ = ops.mla_decode(**inputs[0])
                err = float((out.float() - ref.float()).norm() / ref.float().norm())
                ms = time_ms(inputs)
                print(
                    f"{fmt} B={batch} ctx={ctx} H=128 | BLOCK_H={block_h} BLOCK_N={block_n} warps={warps} "
                    f"stages={stages} split={split} tma={tma} | {ms:.3f} ms | {nbytes / ms / 1e6:.0f} GB/s "
                    f"({100 * nbytes / ms / 1e6 / copy_gbps:.0f}% of copy) | {flops / ms / 1e9:.0f} TFLOP/s "
                    f"| rel err {err:.1e}",
                    flush=True,
                )
            except Exception as e:
                print(
                    f"{fmt} BLOCK_H={block_h} BLOCK_N={block_n} warps={warps} stages={stages} split={split} tma={tma}: "
                    f"{type(e).__name__}: {str(e)[:120]}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
