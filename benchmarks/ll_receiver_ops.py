"""Device work of a low-latency ``ep_dispatch``'s receiver, the core's torch code against cuda_sm100's kernels (CPU).

    TRITON_INTERPRET=1 python3 benchmarks/ll_receiver_ops.py [--capacity 128]

A decode step replays low-latency dispatches from a CUDA graph, where every kernel is a graph node and small
kernels cost their launch slot more than their work. This counts, for the receiver at the issue's shapes (2 ranks,
``--capacity`` tokens each, top-8 of 256 experts, hidden 7168, bf16), the torch ops that run on the device
(views left out) and the Triton launches of ``ep.place_pairs`` (the core) and of cuda_sm100's ``_place_pairs``,
on the same gathered routing. The Triton interpreter runs the kernels, so it needs no GPU; it is a count, not a time.
"""

from __future__ import annotations

import argparse
import collections

import torch
import triton.runtime.interpreter as interpreter
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer.ops.moe import ExpertPlacement
from deepinfer.reference import ep

VIEWS = {"view", "_unsafe_view", "reshape", "slice", "as_strided", "detach", "t", "unsqueeze", "select", "alias",
         "expand", "permute", "transpose", "squeeze", "split", "unbind", "lift_fresh"}  # fmt: skip


class DeviceOps(TorchDispatchMode):
    """Counts torch ops by name, except while a Triton kernel runs (the interpreter's own tensor work)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.launches = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and name not in VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capacity", type=int, default=128)
    args = ap.parse_args()
    from deepinfer_cuda_sm100 import _triton, moe

    if not _triton.INTERPRET:
        raise SystemExit("run with TRITON_INTERPRET=1 (the kernels run in the interpreter on the CPU)")
    world, k, experts, hidden = 2, 8, 256, 7168
    tab = ep._tables(ExpertPlacement.contiguous(experts, world), torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    slots = world * args.capacity
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(slots)]).int()
    weights = torch.rand(slots, k, generator=gen)
    x = torch.randn(slots, hidden, generator=gen).bfloat16()
    payload = ep.Payload.of(x)
    run = interpreter.InterpretedFunction.run
    for name, place in (("core ep.place_pairs", ep.place_pairs), ("cuda_sm100 _place_pairs", moe._place_pairs)):
        counter = DeviceOps()

        def counted_run(self, *a, counter=counter, **kw):
            counter.launches += 1
            counter.paused = True
            try:
                return run(self, *a, **kw)
            finally:
                counter.paused = False

        interpreter.InterpretedFunction.run = counted_run
        try:
            with counter:
                place(payload.to_words(x), ids, weights, payload, tab, 0, world, args.capacity, slots)
        finally:
            interpreter.InterpretedFunction.run = run
        print(f"{name}: {sum(counter.ops.values())} torch ops on the device, {counter.launches} Triton launches")
        print(f"  {dict(counter.ops.most_common())}")


if __name__ == "__main__":
    main()
