"""What the host adds to an eager ``grouped_gemm`` call: eager and CUDA-graph medians of the op beside the
per-expert ``scaled_mm`` loop (the bench's issue-7 peer, eager only: it reads the row counts on the host), at the
bench's shapes (32 experts, bf16 activations quantised inside the op).

Usage: python3 benchmarks/grouped_eager.py [ROWS_PER_EXPERT ...]   (default 512)"""

from __future__ import annotations

import sys

import deepinfer
from deepinfer import bench, ops
from deepinfer.conformance.cases import Gen


def main() -> int:
    deepinfer.use("cuda_sm100")
    wanted = {f"rows/expert={m}" for m in (sys.argv[1:] or ["512"])}
    for index, case in enumerate(bench._grouped_cases(quick=False)):
        if case.name.split()[-1] not in wanted:
            continue
        inputs = [case.make(Gen(1000 * index + s, "cuda")) for s in range(3)]
        ours = lambda i, inputs=inputs: ops.grouped_gemm(**inputs[i])
        loop = lambda i, inputs=inputs: bench._per_expert_scaled_mm(inputs[i])
        eager, graph = bench.time_ms(ours, "cuda", sets=3), bench.time_graph_ms(ours, sets=3)
        peer = bench.time_ms(loop, "cuda", sets=3)
        print(
            f"{case.name}: ours eager {eager:.3f} ms, graph {graph:.3f} ms (host adds {eager - graph:.3f}); "
            f"per-expert loop eager {peer:.3f} ms: {peer / eager:.2f}x eager to eager, {peer / graph:.2f}x to graph",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
