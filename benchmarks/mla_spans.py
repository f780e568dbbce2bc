"""KV span lengths of cuda_sm100's ``mla_decode`` on the device: the default mode (spans chosen by
``attention._split_tokens``) beside fixed spans, each fixed span run through batch-invariant mode with
``attention.SPLIT_TOKENS`` set to it (the same launches the default mode makes when its rule picks that span).
Device time from CUDA graphs, bf16 cache, H=128, latent 512 + rope 64, pages of 64, lengths up to 100 tokens short
of the table's reach. Each variant also prints its worst-row relative error against the fp32 reference on the first
input set.

Usage: python3 benchmarks/mla_spans.py [SPAN ...] [--batches 1,8,...] [--ctx 4096,...]
(default spans: 1024 2048 4096; batches 1, 8, 32, 64, 128; contexts 1024, 4096, 16384)"""

from __future__ import annotations

import argparse

from tile_variants import make

import deepinfer
from deepinfer import bench, ops
from deepinfer.conformance.cases import error
from deepinfer.dispatch import batch_invariant
from deepinfer.reference import attention as reference
from deepinfer_cuda_sm100 import attention


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("spans", nargs="*", type=int, default=[1024, 2048, 4096])
    parser.add_argument("--batches", type=_ints, default=[1, 8, 32, 64, 128])
    parser.add_argument("--ctx", type=_ints, default=[1024, 4096, 16384])
    args = parser.parse_args()
    deepinfer.use("cuda_sm100")
    for batch in args.batches:
        for ctx in args.ctx:
            sets = [make(batch, ctx, "bf16", seed, short=100) for seed in range(3)]
            run = lambda i, sets=sets: ops.mla_decode(**sets[i])
            ref = reference.mla_decode(**(sets[0] | {"q": sets[0]["q"].float()}))
            default = bench.time_graph_ms(run, sets=len(sets))
            line = f"B={batch} ctx={ctx} | default {default:.4f} ms (err {error(run(0), ref):.1e})"
            for span in args.spans:
                attention.SPLIT_TOKENS = span
                with batch_invariant():
                    ms = bench.time_graph_ms(run, sets=len(sets))
                    err = error(run(0), ref)
                line += f" | span {span}: {ms:.4f} ms ({ms / default:.2f}x, err {err:.1e})"
            print(line, flush=True)


if __name__ == "__main__":
    main()
