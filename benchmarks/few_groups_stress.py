"""The few-row Gluon FP8 GEMM in K groups (``gemm_gluon.fp8_gemm_few_rows`` with ``K_GROUPS`` > 1), checked for
lost or early hand-overs under load (one CUDA GPU).

    python3 benchmarks/few_groups_stress.py [ROUNDS]

Its groups meet at a per-tile counter in global memory, so a fault in that protocol would show as a race, not on every
launch. Every output below is compared bit for bit with the unsplit Triton launch on the same inputs: launches back
to back without a synchronisation (programmatic dependent launch overlapping them, the counter sets reused), the
same from one CUDA graph, and from two streams at once. Fresh random inputs each round.
"""

from __future__ import annotations

import sys

import torch

import deepinfer
from deepinfer import QTensor
from deepinfer.qtensor import quantize_blocks, quantize_rows
from deepinfer_cuda_sm100 import gemm, gemm_gluon

CASES = [(2112, 7168, m, 4) for m in (1, 2, 3, 5, 8)] + [(4096, 7168, 1, 2), (2112, 7168, 16, 2)]
BURST = 24  # launches queued before one synchronisation


def unsplit(a: QTensor, w: QTensor) -> torch.Tensor:
    out = torch.empty(a.shape[0], w.shape[0], dtype=torch.bfloat16, device="cuda")
    tile = gemm.SWAPPED_TILE if a.shape[0] <= gemm.SWAP_MAX_M else None
    return gemm._launch_gemm(a.data, w.data, out, a.scale, w.scale, None, True, tile)


def burst(inputs: list[tuple[QTensor, QTensor]], order: list[int]) -> list[tuple[int, torch.Tensor]]:
    """About ``BURST`` K-group launches over the cases in ``order``, queued without a synchronisation."""
    return [
        (c, gemm_gluon.launch_few_rows(*inputs[c], groups=CASES[c][3]))
        for _ in range(BURST // len(CASES) + 1)
        for c in order
    ]


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    deepinfer.use("cuda_sm100")
    gen = torch.Generator(device="cuda").manual_seed(0)
    launches = mismatches = 0
    for r in range(rounds):
        inputs, wants = [], []
        for n, k, m, _ in CASES:
            a = quantize_rows(torch.randn(m, k, device="cuda", generator=gen), 128, "fp32")
            w = quantize_blocks(torch.randn(n, k, device="cuda", generator=gen) * k**-0.5)
            inputs.append((a, w))
            wants.append(unsplit(a, w).view(torch.int16))

        order = list(range(len(CASES)))
        outs = burst(inputs, order)  # eager, back to back
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # two streams at once
            outs_side = burst(inputs, order[::-1])
        outs += burst(inputs, order)
        torch.cuda.current_stream().wait_stream(side)
        outs += outs_side
        if r == 0:  # one graph of a burst, replayed: the counters' sets as a decode step's graph uses them
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = burst(inputs, order)
            graph_inputs = inputs
        for _ in range(3):
            for now, then in zip(inputs, graph_inputs, strict=True):  # this round's inputs into the graph's
                for x, x0 in zip(now, then, strict=True):
                    x0.data.copy_(x.data)
                    x0.scale.copy_(x.scale)
            graph.replay()
            outs += [(c, o.clone()) for c, o in captured]
        torch.cuda.synchronize()
        for c, out in outs:
            launches += 1
            mismatches += not torch.equal(out.view(torch.int16), wants[c])
        print(
            f"round {r + 1}/{rounds}: {launches} launches checked, {mismatches} not equal to the unsplit bits",
            flush=True,
        )
    sys.exit(1 if mismatches else 0)


if __name__ == "__main__":
    main()
