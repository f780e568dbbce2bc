"""FP8 ``grouped_gemm`` in the masked layout of decode: programs per SM over the tiles that hold rows (one CUDA GPU).

    python3 benchmarks/grouped_masked.py OUT.json

The model's decode shape (``gemm_tiles.grouped_inputs``: 256 experts, top-8, capacity = tokens) at 1, 8 and 64
tokens, gate/up (4096, 7168) and down (7168, 2048), in both modes. Each program walks every so many of the experts'
row tiles that hold rows (``MASKED_PROGRAMS_PER_SM`` programs per SM), against one program per row tile there could
be (256 experts x tiles of the capacity: the grid before the walk, whose programs for empty tiles do nothing). Rows
are compared bit for bit between the two, then timed from CUDA graphs.
"""

from __future__ import annotations

import json
import sys

import torch
from gemm_tiles import grouped_inputs

from deepinfer.bench import time_graph_ms
from deepinfer.dispatch import batch_invariant
from deepinfer_cuda_sm100 import gemm

EVERY_TILE = 1 << 30  # programs per SM: as many as there could be tiles


def main() -> None:
    report = []
    default_per_sm = gemm.MASKED_PROGRAMS_PER_SM
    for n, k in ((4096, 7168), (7168, 2048)):
        for tokens in (1, 8, 64):
            sets = grouped_inputs(tokens, n, k, seed=tokens + n)
            rows = sets[0]["masked_m"]
            for invariant in (False, True):
                row = {
                    "N": n,
                    "K": k,
                    "tokens": tokens,
                    "invariant": invariant,
                    "experts_reached": int((rows > 0).sum()),
                }
                outs = {}
                for name, per_sm in (("walk", default_per_sm), ("every_tile", EVERY_TILE)):
                    gemm.MASKED_PROGRAMS_PER_SM = per_sm
                    with batch_invariant(invariant):
                        out = gemm.grouped_gemm(**sets[0])
                        outs[name] = torch.cat([out[e, : rows[e]] for e in range(len(rows)) if rows[e]])
                        row[f"{name}_ms"] = time_graph_ms(lambda i, s=sets: gemm.grouped_gemm(**s[i]), sets=len(sets))
                gemm.MASKED_PROGRAMS_PER_SM = default_per_sm
                row["same_bits"] = bool(
                    torch.equal(outs["walk"].view(torch.int16), outs["every_tile"].view(torch.int16))
                )
                row["ratio"] = row["walk_ms"] / row["every_tile_ms"]
                print(
                    f"N={n} K={k} tokens={tokens} invariant={invariant} ({row['experts_reached']} experts): "
                    f"walk {row['walk_ms']:.4f} ms, every tile {row['every_tile_ms']:.4f} ms ({row['ratio']:.2f}x), "
                    f"same bits {row['same_bits']}",
                    flush=True,
                )
                report.append(row)
                with open(sys.argv[1], "w") as f:
                    json.dump(report, f, indent=1)
            del sets
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
