"""FP8 ``grouped_gemm`` in the masked layout of decode: the swapped kernel over the tiles that hold rows, against the
backend's ``grouped_gemm`` as committed at a git revision (one CUDA GPU).

    python3 benchmarks/grouped_masked_swap.py OUT.json --rev REV [--tokens 1,8,16,64,256]

The model's decode shape (``gemm_tiles.grouped_inputs``: 256 experts, top-8, capacity = tokens), gate/up (4096, 7168)
and down (7168, 2048), in both modes. Each variant of the working tree's kernel (tile and programs per SM) is
checked against the reference (worst relative error of the rows of up to 16 experts), compared bit for bit with the
revision's rows, then timed from CUDA graphs in the same run as the revision's kernel (ratio: variant / revision).
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

VARIANTS = [  # (MASKED_SWAPPED_TILE, MASKED_PROGRAMS_PER_SM); the first is the committed one
    (gemm.MASKED_SWAPPED_TILE, gemm.MASKED_PROGRAMS_PER_SM),
    (gemm.Tile(16, 64, 4, 4, swap=True), 2),
    (gemm.Tile(16, 64, 4, 4, swap=True), 4),
    (gemm.Tile(16, 64, 4, 4, swap=True), 5),
    (gemm.Tile(16, 64, 4, 6, swap=True), 3),
    (gemm.Tile(16, 128, 4, 4, swap=True), 2),
    (gemm.Tile(32, 64, 4, 4, swap=True), 4),
]


def live_rows(out: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return torch.cat([out[e, :m] for e, m in enumerate(rows) if m])


def worst_error(out: torch.Tensor, kw: dict, rows: list[int], experts: int = 16) -> float:
    worst = 0.0
    for e in [e for e, m in enumerate(rows) if m][:experts]:
        w = QTensor(kw["w"].data[e], kw["w"].scale[e], kw["w"].block, kw["w"].scale_format).dequantize()
        want = kw["a"][e].dequantize()[: rows[e]] @ w.t()
        got = out[e, : rows[e]].float()
        worst = max(worst, float(((got - want).norm(dim=1) / want.norm(dim=1)).max()))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--rev", required=True)
    parser.add_argument("--tokens", default="1,8,16,64,256")
    args = parser.parse_args()
    before = module_at(args.rev, "gemm")
    committed = gemm.MASKED_SWAPPED_TILE, gemm.MASKED_PROGRAMS_PER_SM
    report = []
    for n, k in ((4096, 7168), (7168, 2048)):
        for tokens in map(int, args.tokens.split(",")):
            sets = grouped_inputs(tokens, n, k, seed=tokens + n)
            rows = sets[0]["masked_m"].tolist()
            for invariant in (False, True):
                with batch_invariant(invariant):
                    old = live_rows(before.grouped_gemm(**sets[0]), rows)
                    old_ms = time_graph_ms(lambda i, s=sets: before.grouped_gemm(**s[i]), sets=len(sets), reps=50)
                    for tile, per_sm in VARIANTS:
                        gemm.MASKED_SWAPPED_TILE, gemm.MASKED_PROGRAMS_PER_SM = tile, per_sm
                        out = gemm.grouped_gemm(**sets[0])
                        row = {
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
                            f"N={n} K={k} T={tokens} inv={invariant} ({row['experts_reached']} experts) "
                            f"{tile.block_m}x{tile.block_n} st{tile.num_stages} {per_sm}/SM: {row['ms']:.4f} ms vs "
                            f"rev {old_ms:.4f} ({row['ratio']:.2f}x), err {row['rel_err']:.1e}, "
                            f"same bits {row['same_bits_as_rev']}",
                            flush=True,
                        )
                    gemm.MASKED_SWAPPED_TILE, gemm.MASKED_PROGRAMS_PER_SM = committed
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
            del sets
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
