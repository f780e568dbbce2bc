"""Where the time of a one-token MoE layer goes: host against device, with value checks on and off.

    python3 benchmarks/profile_moe_layer.py          # on a CUDA device (the peers use cuBLAS)

Runs ``deepinfer bench``'s ``moe_layer`` case at T=1 (normal mode) on cuda_sm100 and on its torch peers. For
each, with ``DEEPINFER_VALUE_CHECKS`` 1 and 0: the median over 40 calls of the host time to issue the layer and of
the time until the device is done. Then one call of ours under the torch profiler: host ops by self time, and how
many host ops, kernels and host synchronisations it took.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

import deepinfer
from deepinfer import bench
from deepinfer.conformance.cases import Gen


def host_and_total_ms(fn, kw, n: int = 40) -> tuple[float, float]:
    for _ in range(5):
        fn(kw)
    host, total = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(kw)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        total.append((t2 - t0) * 1e3)
    return statistics.median(host), statistics.median(total)


def main() -> None:
    case = next(c for c in bench._moe_layer_cases(False) if c.name.startswith("T=1 ") and c.name.endswith("normal"))
    kw = case.make(Gen(0, "cuda"))
    print(case.name)
    for checks in ("1", "0"):
        os.environ["DEEPINFER_VALUE_CHECKS"] = checks
        with deepinfer.use("cuda_sm100"):
            ours = host_and_total_ms(bench.moe_layer, kw)
        peers = host_and_total_ms(bench._moe_layer_torch_peers, kw)
        print(f"value checks {checks}: ours host {ours[0]:.3f} ms, done {ours[1]:.3f} ms; "
              f"peers host {peers[0]:.3f} ms, done {peers[1]:.3f} ms; ratio {peers[1] / ours[1]:.2f}x")  # fmt: skip
    os.environ["DEEPINFER_VALUE_CHECKS"] = "1"
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with deepinfer.use("cuda_sm100"):
        bench.moe_layer(kw)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=activities) as prof:
            bench.moe_layer(kw)
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=50))
    events = prof.events()
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    print(f"host ops {len(cpu)}, kernels {len(events) - len(cpu)}, "
          f"host synchronisations {sum(e.name == 'cudaStreamSynchronize' for e in cpu)}")  # fmt: skip


if __name__ == "__main__":
    main()
