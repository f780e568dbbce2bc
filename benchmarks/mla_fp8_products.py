"""How far FP8 tensor-core products would move ``mla_decode`` over an ``fp8_ds_mla`` cache from the reference (CPU).

    python3 benchmarks/mla_fp8_products.py [--heads 128] [--ctx 1024,4096,16384] [--outliers 0,8]

The cuda_sm100 kernels dequantise the cache to bf16 and multiply in bf16 (exact for e4m3 values times power-of-two
scales), so only P's rounding to bf16 separates them from the fp32 reference. A kernel that multiplies in FP8 would
round more. This script emulates each rounding in PyTorch, on the conformance suite's data (normal queries and
latents, softmax scale 192^-0.5), and reports the worst-row relative error ``|out - ref| / |ref|`` that the
conformance suite bounds by 1e-2 for ``mla_decode/fp8_ds_mla``:

- ``bf16 products``: the kernels as they are (P rounded to bf16);
- ``fp8 S``: the query's latent part quantised to e4m3 per (head, 128-column group), amax / 448 scales; the cache's
  own e4m3 values and scales; the rope part stays bf16; P as above;
- ``fp8 PV``: P times the cache's scale for (token, group), divided by the largest such scale in its 64-token block
  (a power of two, so exact) and times 256, quantised to e4m3; the block's scale and 1/256 applied to the product;
- ``fp8 S + PV``: both.

``--outliers F`` multiplies 8 of the 512 latent channels by F before the cache is quantised (a channel outlier, as
real latents have), which widens every group's scale that holds one.
"""

from __future__ import annotations

import argparse

import torch

from deepinfer.kv_cache import FP8_GROUP, pack_fp8_ds_mla, unpack_fp8_ds_mla

E4M3 = torch.float8_e4m3fn
BLOCK = 64  # tokens per block, as the kernels read them
P_SHIFT = 256.0  # P times this before e4m3: P's small values stay normal numbers


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., L]`` to e4m3 values (as fp32) and fp32 scales per 128-column group (amax / 448)."""
    g = x.unflatten(-1, (-1, FP8_GROUP))
    scale = g.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0
    return (g / scale).to(E4M3).float(), scale


def attend(q: torch.Tensor, records: torch.Tensor, scale: float, fp8_s: bool, fp8_pv: bool, L: int) -> torch.Tensor:
    """One sequence: ``q [H, L + R]`` fp32, ``records [N, width]`` fp8_ds_mla -> out ``[H, L]`` fp32."""
    n = records.shape[0]
    values = records[:, :L].view(E4M3).float()  # [N, L] e4m3
    k_scale = records[:, L : L + 4 * (L // FP8_GROUP)].contiguous().view(torch.float32)  # [N, G]
    kv = unpack_fp8_ds_mla(records, L)  # [N, L + R] fp32, exact
    rope_s = q[:, L:].bfloat16().float() @ kv[:, L:].T
    if fp8_s:
        q8, q_scale = quantize_groups(q[:, :L])  # [H, G, 128], [H, G, 1]
        per_group = torch.einsum("hgc,ngc->hgn", q8, values.unflatten(1, (-1, FP8_GROUP)))
        s = (per_group * q_scale * k_scale.T.unsqueeze(0)).sum(1) + rope_s
    else:
        s = q[:, :L].bfloat16().float() @ kv[:, :L].T + rope_s
    s = s * scale
    p = torch.exp(s - s.amax(-1, keepdim=True))  # [H, N]
    denom = p.sum(-1, keepdim=True)
    if not fp8_pv:
        return (p.bfloat16().float() @ kv[:, :L]) / denom
    out = torch.zeros(q.shape[0], L)
    for b0 in range(0, n, BLOCK):
        blk = slice(b0, min(b0 + BLOCK, n))
        top = k_scale[blk].amax(0)  # [G] powers of two
        for g in range(L // FP8_GROUP):
            cols = slice(g * FP8_GROUP, (g + 1) * FP8_GROUP)
            a = (p[:, blk] * (k_scale[blk, g] / top[g]) * P_SHIFT).to(E4M3).float()
            out[:, cols] += (a @ values[blk, cols]) * (top[g] / P_SHIFT)
    return out / denom


def worst_row_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)).max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--ctx", default="1024,4096,16384")
    ap.add_argument("--outliers", default="0,8", help="factors for 8 outlier channels; 0 for none")
    ap.add_argument("--sequences", type=int, default=2, help="sequences per shape (worst row over all)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    L, R = 512, 64
    scale = (128 + R) ** -0.5
    variants = {"bf16 products": (False, False), "fp8 S": (True, False), "fp8 PV": (False, True),
                "fp8 S + PV": (True, True)}  # fmt: skip
    g = torch.Generator().manual_seed(args.seed)
    print(f"worst-row relative error against the fp32 reference (H={args.heads}, {args.sequences} sequences each)")
    print(f"{'ctx':>6} {'outliers':>8} " + " ".join(f"{v:>14}" for v in variants))
    for outlier in (float(f) for f in args.outliers.split(",")):
        for ctx in (int(c) for c in args.ctx.split(",")):
            worst = dict.fromkeys(variants, 0.0)
            for _ in range(args.sequences):
                latent = torch.randn(ctx, L + R, generator=g)
                if outlier:
                    latent[:, torch.randperm(L, generator=g)[:8]] *= outlier
                records = pack_fp8_ds_mla(latent, L)
                q = torch.randn(args.heads, L + R, generator=g).bfloat16().float()
                kv = unpack_fp8_ds_mla(records, L)
                s = (q @ kv.T) * scale
                want = torch.softmax(s, -1) @ kv[:, :L]
                for name, (fp8_s, fp8_pv) in variants.items():
                    got = attend(q, records, scale, fp8_s, fp8_pv, L)
                    worst[name] = max(worst[name], worst_row_error(got, want))
            print(f"{ctx:>6} {outlier:>8g} " + " ".join(f"{worst[v]:>14.2e}" for v in variants))


if __name__ == "__main__":
    main()
