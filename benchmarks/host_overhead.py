"""Host time of eager ``mla_decode`` calls on cuda_sm100 (one CUDA GPU), with the value checks on (the default:
they read ``seq_lens`` and ``block_table`` on the host, which waits for the device) and off
(``DEEPINFER_VALUE_CHECKS=0``), then a cProfile of the calls with the checks on.

    python3 benchmarks/host_overhead.py [CALLS]
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time

import torch
from tile_variants import make

import deepinfer
from deepinfer import ops


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    deepinfer.use("cuda_sm100")
    inputs = make(64, 4096, "bf16", 0)
    for _ in range(5):
        ops.mla_decode(**inputs)
    for checks in ("1", "0"):
        os.environ["DEEPINFER_VALUE_CHECKS"] = checks
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            ops.mla_decode(**inputs)
        host = (time.perf_counter() - t0) / calls
        torch.cuda.synchronize()
        print(f"DEEPINFER_VALUE_CHECKS={checks}: host time per call {host * 1e3:.3f} ms")
    os.environ["DEEPINFER_VALUE_CHECKS"] = "1"
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        ops.mla_decode(**inputs)
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("cumulative").print_stats(35)


if __name__ == "__main__":
    main()
