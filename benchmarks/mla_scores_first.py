"""cuda_sm100's batch-invariant ``mla_decode``, its scores computed first
(``mla_gluon.launch_scores_first``) against the Gluon split kernel alone, at a few rows, where the split kernel leaves
SMs idle; the default mode beside both. Each line gives the device time of each side (CUDA graphs, alternated twice,
best of each), whether every scores-first side gave the split kernel's bits (output and lse), and the worst-row
relative error against the fp32 reference. Lengths up to 100 tokens short of the table's reach.

Usage: python3 benchmarks/mla_scores_first.py [--batches 1,2,4,8,16] [--ctx 1024,4096,16384]
[--formats bf16,fp8_ds_mla] [--set NAME=INT ...] (a constant of ``mla_gluon`` for this run, e.g. VALUES_STAGES=6)
[--side LABEL=NAME:INT,... ...] (one more scores-first side, timed in turn with the others, with those constants of
``mla_gluon``, or else of ``attention``, set while it runs; ``MLA_SCORES_FIRST_MAX_SHARE:0`` makes it a split-kernel
side) [--profile] (then each kernel's mean device time on the scores-first side, from the torch profiler)"""

from __future__ import annotations

import argparse
import itertools

import torch
from tile_variants import make

import deepinfer
from deepinfer import bench, ops
from deepinfer.conformance.cases import error
from deepinfer.dispatch import batch_invariant
from deepinfer.reference import attention as reference
from deepinfer_cuda_sm100 import attention, mla_gluon


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,2,4,8,16")
    parser.add_argument("--ctx", default="1024,4096,16384")
    parser.add_argument("--formats", default="bf16,fp8_ds_mla")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=INT")
    parser.add_argument("--side", action="append", default=[], metavar="LABEL=NAME:INT,...")
    args = parser.parse_args()
    for item in args.set:
        name, value = item.split("=")
        setattr(mla_gluon, name, int(value))
    shipped = attention.MLA_SCORES_FIRST_MAX_SHARE
    deepinfer.use("cuda_sm100")
    sides = {"default": (False, 0.0, {}), "split": (True, 0.0, {}), "scores first": (True, float("inf"), {})}
    for item in args.side:
        label, settings = item.split("=")
        sides[label] = (True, float("inf"), {k: int(v) for k, v in (kv.split(":") for kv in settings.split(","))})
    for fmt, batch, ctx in itertools.product(
        args.formats.split(","), *(map(int, a.split(",")) for a in (args.batches, args.ctx))
    ):
        sets = [make(batch, ctx, fmt, seed, short=100) for seed in range(3)]
        run = lambda i, sets=sets: ops.mla_decode(**sets[i])
        ref = reference.mla_decode(**(sets[0] | {"q": sets[0]["q"].float()}))
        best, outs = {}, {}
        for _ in range(2):
            for side, (invariant, share, settings) in sides.items():
                attention.MLA_SCORES_FIRST_MAX_SHARE = share
                kept = {name: getattr(_module(name), name) for name in settings}
                for name, value in settings.items():
                    setattr(_module(name), name, value)
                with batch_invariant(invariant):
                    ms = bench.time_graph_ms(run, sets=3)
                    outs[side] = run(0)
                for name, value in kept.items():
                    setattr(_module(name), name, value)
                best[side] = min(best.get(side, ms), ms)
        attention.MLA_SCORES_FIRST_MAX_SHARE = shipped
        first = [side for side, (_, share, _) in sides.items() if share]
        same = all(torch.equal(a, b) for side in first for a, b in zip(outs["split"], outs[side]))
        split = attention._split_tokens(batch * 2, ctx, attention.num_sms(0), True)
        ratios = " | ".join(f"{side} {best[side]:.4f} ms ({best[side] / best['default']:.2f}x)" for side in sides)
        print(
            f"{fmt} B={batch} ctx={ctx} | {batch * 2 * -(-ctx // split)} split programs | {ratios}"
            f" | {'same' if same else 'DIFFERENT'} bits | err {error(outs['scores first'], ref):.1e}",
            flush=True,
        )
        if args.profile:
            attention.MLA_SCORES_FIRST_MAX_SHARE = float("inf")
            with batch_invariant(True):
                print("   ", _kernel_times(run))
            attention.MLA_SCORES_FIRST_MAX_SHARE = shipped


def _module(name: str):
    """Where a ``--side`` constant lives: ``mla_gluon``, else ``attention``."""
    return mla_gluon if hasattr(mla_gluon, name) else attention


def _kernel_times(run, calls: int = 30) -> str:
    """Each of the op's kernels' mean device time in microseconds over ``calls`` eager calls of ``run`` (the eager
    input checks' small kernels left out)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            run(i % 3)
        torch.cuda.synchronize()
    times = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times.setdefault(event.name, []).append(event.device_time)
    return ", ".join(f"{name[:40]} {sum(t) / len(t):.1f} us" for name, t in times.items() if name.startswith("_mla"))


if __name__ == "__main__":
    main()
