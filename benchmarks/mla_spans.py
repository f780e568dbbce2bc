"""KV span lengths of cuda_sm100's ``mla_decode`` on the device: the default mode (spans chosen by
``attention._split_tokens``) beside fixed spans, each fixed span run through batch-invariant mode with
``attention.SPLIT_TOKENS`` set to it (the same launches the default mode makes when its rule picks that span).
Device time from CUDA graphs, bf16 cache, H=128, latent 512 + rope 64, pages of 64, lengths up to 100 tokens short
of the table's reach.

Usage: python3 benchmarks/mla_spans.py [SPAN ...]   (default spans: 1024 2048 4096)"""

from __future__ import annotations

import sys

from tile_variants import make

import deepinfer
from deepinfer import bench, ops
from deepinfer.dispatch import batch_invariant
from deepinfer_cuda_sm100 import attention


def main() -> None:
    spans = [int(s) for s in sys.argv[1:]] or [1024, 2048, 4096]
    deepinfer.use("cuda_sm100")
    for batch in (1, 8, 32, 64, 128):
        for ctx in (1024, 4096, 16384):
            sets = [
                make(batch, ctx, "bf16", seed, 128, "cuda", short=100) | {"kv_lora_rank": 512, "kv_format": "bf16"}
                for seed in range(3)
            ]
            run = lambda i, sets=sets: ops.mla_decode(**sets[i])
            default = bench.time_graph_ms(run, sets=len(sets))
            line = f"B={batch} ctx={ctx} | default {default:.3f} ms"
            for span in spans:
                attention.SPLIT_TOKENS = span
                with batch_invariant():
                    ms = bench.time_graph_ms(run, sets=len(sets))
                line += f" | span {span}: {ms:.3f} ms ({ms / default:.2f}x)"
            print(line, flush=True)


if __name__ == "__main__":
    main()
