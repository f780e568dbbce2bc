"""``grouped_gemm`` in the masked layout of decode: the swapped kernel over the tiles that hold rows, against the
backend's ``grouped_gemm`` as committed at a git revision (one CUDA GPU).

    python3 benchmarks/grouped_masked_swap.py OUT.json --rev REV [--tokens 1,8,16,64,256] [--only fp8|bf16]

The model's decode shapes, in both modes. FP8: the routed experts (``gemm_tiles.grouped_inputs``: 256 experts, top-8,
capacity = tokens), gate/up (4096, 7168) and down (7168, 2048). bf16: the absorbed MLA products, one "expert" per
head (128 heads, every head holding every token): ``w_uk`` (512, 128) and ``w_uv`` (128, 512). Each variant of the
working tree's kernel (tile and programs per SM) is checked against the reference (worst relative error of the rows
of up to 16 experts), compared bit for bit with the revision's rows, then timed from CUDA graphs in the same run as
the revision's kernel (ratio: variant / revision).
"""

from __future__ import annotations

import argparse
import json

import torch
from ab_against_git import module_at
from gemm_tiles import grouped_inputs

from deepinfer import QTensor
from deepinfer.bench import time_graph_ms
from deepinfer.dispatch import batch_invariant
from deepinfer_cuda_sm100 import gemm

VARIANTS = [  # (MASKED_TILE, MASKED_PROGRAMS_PER_SM); the first is the committed one
    (gemm.MASKED_TILE, gemm.MASKED_PROGRAMS_PER_SM),
    (gemm.Tile(16, 64, 4, 4, swap=True), 2),
    (gemm.Tile(16, 64, 4, 4, swap=True), 4),
    (gemm.Tile(16, 64, 4, 6, swap=True), 3),
    (gemm.Tile(16, 128, 4, 4, swap=True), 2),
    (gemm.Tile(32, 64, 4, 4, swap=True), 4),
    (gemm.Tile(16, 64, 4, 3, block_k=128, swap=True), 4),  # bf16: K steps of 128 (FP8's are 128 anyway)
]


def live_rows(out: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return torch.cat([out[e, :m] for e, m in enumerate(rows) if m])


def mla_inputs(tokens: int, n: int, k: int, seed: int, heads: int = 128, sets: int = 2) -> list[dict]:
    """The absorbed MLA product of a decode step: ``tokens`` rows of every head against that head's bf16 [n, k]."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = torch.full((heads,), tokens, dtype=torch.int32, device="cuda")
    return [
        {
            "a": torch.randn(heads, tokens, k, device="cuda", generator=gen, dtype=torch.bfloat16),
            "w": torch.randn(heads, n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * k**-0.5,
            "expert_offsets": None,
            "masked_m": rows,
            "out_dtype": torch.bfloat16,
        }
        for _ in range(sets)
    ]


def dense(x, e: int) -> torch.Tensor:
    if isinstance(x, QTensor):
        return QTensor(x.data[e], x.scale[e], x.block, x.scale_format).dequantize()
    return x[e].float()


def worst_error(out: torch.Tensor, kw: dict, rows: list[int], experts: int = 16) -> float:
    worst = 0.0
    for e in [e for e, m in enumerate(rows) if m][:experts]:
        want = dense(kw["a"], e)[: rows[e]] @ dense(kw["w"], e).t()
        got = out[e, : rows[e]].float()
        worst = max(worst, float(((got - want).norm(dim=1) / want.norm(dim=1)).max()))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--rev", required=True)
    parser.add_argument("--tokens", default="1,8,16,64,256")
    parser.add_argument("--only", choices=("fp8", "bf16"))
    args = parser.parse_args()
    shapes = [("fp8", 4096, 7168), ("fp8", 7168, 2048), ("bf16", 512, 128), ("bf16", 128, 512)]
    before = module_at(args.rev, "gemm")
    committed = gemm.MASKED_TILE, gemm.MASKED_PROGRAMS_PER_SM
    report = []
    for kind, n, k in [s for s in shapes if args.only in (None, s[0])]:
        for tokens in map(int, args.tokens.split(",")):
            inputs = grouped_inputs if kind == "fp8" else mla_inputs
            sets = inputs(tokens, n, k, seed=tokens + n)
            rows = sets[0]["masked_m"].tolist()
            for invariant in (False, True):
                with batch_invariant(invariant):
                    old = live_rows(before.grouped_gemm(**sets[0]), rows)
                    old_ms = time_graph_ms(lambda i, s=sets: before.grouped_gemm(**s[i]), sets=len(sets), reps=50)
                    for tile, per_sm in VARIANTS:
                        gemm.MASKED_TILE, gemm.MASKED_PROGRAMS_PER_SM = tile, per_sm
                        out = gemm.grouped_gemm(**sets[0])
                        row = {
                            "kind": kind,
                            "N": n,
                            "K": k,
                            "tokens": tokens,
                            "invariant": invariant,
                            "experts_reached": sum(m > 0 for m in rows),
                            "tile": list(tile),
                            "programs_per_sm": per_sm,
                            "rel_err": worst_error(out, sets[0], rows),
                            "same_bits_as_rev": bool(
                                torch.equal(live_rows(out, rows).view(torch.int16), old.view(torch.int16))
                            ),
                            "rev_ms": old_ms,
                            "ms": time_graph_ms(lambda i, s=sets: gemm.grouped_gemm(**s[i]), sets=len(sets), reps=50),
                        }
                        row["ratio"] = row["ms"] / row["rev_ms"]
                        report.append(row)
                        print(
                            f"{kind} N={n} K={k} T={tokens} inv={invariant} ({row['experts_reached']} experts) "
                            f"{tile.block_m}x{tile.block_n} st{tile.num_stages} {per_sm}/SM: {row['ms']:.4f} ms vs "
                            f"rev {old_ms:.4f} ({row['ratio']:.2f}x), err {row['rel_err']:.1e}, "
                            f"same bits {row['same_bits_as_rev']}",
                            flush=True,
                        )
                    gemm.MASKED_TILE, gemm.MASKED_PROGRAMS_PER_SM = committed
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
            del sets
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
