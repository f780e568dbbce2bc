"""cuda_sm100's ``mla_decode`` on the device with and without the Gluon kernel's latent halves (``HALVES``: two
programs per head block, each one half of P x V), where the grid leaves SMs idle: both modes, bf16 and fp8_ds_mla
caches, H=128, a few rows. Each line gives the device time of both sides (CUDA graphs, alternated twice, best of
each), whether they gave the same bits (output and lse), and the worst-row relative error against the fp32
reference. Lengths up to 100 tokens short of the table's reach.

Usage: python3 benchmarks/mla_halves.py [--batches 1,2,4,8,16] [--ctx 1024,4096,16384] [--formats bf16,fp8_ds_mla]
[--share S] (the halves' side with ``attention.MLA_HALVES_MAX_SHARE = S``, default the backend's) [--gluon MODULE] (the
Gluon kernel from the backend's module MODULE instead of ``mla_gluon``, e.g. a copy of an earlier ``mla_gluon.py``
saved beside it as ``mla_gluon_before.py``, not committed: the other side of a kernel A/B)"""

from __future__ import annotations

import argparse
import importlib

import torch
from tile_variants import make

import deepinfer
from deepinfer import bench, ops
from deepinfer.conformance.cases import error
from deepinfer.dispatch import batch_invariant
from deepinfer.reference import attention as reference
from deepinfer_cuda_sm100 import attention


def _side(run, share: float) -> tuple[float, tuple[torch.Tensor, torch.Tensor]]:
    attention.MLA_HALVES_MAX_SHARE = share
    return bench.time_graph_ms(run, sets=3), run(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,2,4,8,16")
    parser.add_argument("--ctx", default="1024,4096,16384")
    parser.add_argument("--formats", default="bf16,fp8_ds_mla")
    parser.add_argument("--share", type=float, default=attention.MLA_HALVES_MAX_SHARE)
    parser.add_argument("--gluon", help="the backend's module holding the Gluon kernel (default mla_gluon)")
    args = parser.parse_args()
    if args.gluon:
        attention.mla_gluon = importlib.import_module(f"deepinfer_cuda_sm100.{args.gluon}")
    shipped = attention.MLA_HALVES_MAX_SHARE
    deepinfer.use("cuda_sm100")
    for fmt in args.formats.split(","):
        for batch in map(int, args.batches.split(",")):
            for ctx in map(int, args.ctx.split(",")):
                sets = [make(batch, ctx, fmt, seed, short=100) for seed in range(3)]
                run = lambda i, sets=sets: ops.mla_decode(**sets[i])
                ref = reference.mla_decode(**(sets[0] | {"q": sets[0]["q"].float()}))
                for invariant in (False, True):
                    split = attention._split_tokens(batch * 2, ctx, attention.num_sms(0), invariant)
                    programs = batch * 2 * -(-ctx // split)  # without halves (two head blocks of 64)
                    best, outs = {}, {}
                    with batch_invariant(invariant):
                        for _ in range(2):
                            for halves in (False, True):
                                ms, outs[halves] = _side(run, args.share if halves else 0.0)
                                best[halves] = min(best.get(halves, ms), ms)
                    same = all(torch.equal(a, b) for a, b in zip(outs[False], outs[True]))
                    mode = "invariant" if invariant else "default"
                    print(
                        f"{fmt} B={batch} ctx={ctx} {mode} | {programs} programs | whole {best[False]:.4f} ms"
                        f" | halves {best[True]:.4f} ms ({best[True] / best[False]:.2f}x)"
                        f" | {'same' if same else 'DIFFERENT'} bits | err {error(outs[True], ref):.1e}",
                        flush=True,
                    )
    attention.MLA_HALVES_MAX_SHARE = shipped


if __name__ == "__main__":
    main()
