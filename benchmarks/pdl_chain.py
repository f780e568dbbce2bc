"""What programmatic dependent launch (PDL) saves between the small kernels of a decode step (one CUDA GPU, SM90+).

    python3 benchmarks/pdl_chain.py OUT.json

Two chains, each captured in one CUDA graph and replayed (median of many replays):

- ``small``: 64 dependent launches of a one-program elementwise kernel (each reads the previous one's output);
- ``stream``: 8 pairs of [a small kernel that writes the activation, a GEMV that streams a (2048, 7168) bf16
  weight and reads that activation]; the 8 weights (235 MB) do not fit in L2, as in a decode step.

Both chains run with plain launches and with PDL (every kernel lets its successor launch at once, then waits for
its predecessor with ``griddepcontrol.wait`` before touching memory); ``stream`` also with PDL and each GEMV program
prefetching the first 2 or 8 KB of its weight rows into L2 before that wait (weights are never written by a kernel,
so that read cannot race). The outputs of every variant must equal the plain chain's bit for bit.
"""

from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _pdl_enter(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def _small_kernel(x_ptr, y_ptr, bias_ptr, n, PDL: tl.constexpr, BLOCK: tl.constexpr):
    _pdl_enter(PDL)
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    bias = tl.load(bias_ptr)
    tl.store(y_ptr + offs, x * 0.5 + bias, mask=offs < n)


@triton.jit
def _gemv_kernel(
    w_ptr, x_ptr, y_ptr, N, K, PDL: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if PREFETCH > 0:
        tl.inline_asm_elementwise(
            f"cp.async.bulk.prefetch.L2.global [$1], {PREFETCH}; mov.u32 $0, 0;",
            "=r,l",
            [w_ptr + rows.to(tl.int64) * K],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    _pdl_enter(PDL)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :])
        x = tl.load(x_ptr + cols)
        acc += tl.sum(w.to(tl.float32) * x[None, :].to(tl.float32), axis=1)
    tl.store(y_ptr + rows, acc)


def graph_ms(fn, reps: int = 50) -> float:
    """Median milliseconds of one replay of ``fn`` captured in a CUDA graph (capture errors are raised)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2]


def small_chain(x, bufs, pdl):
    for i in range(len(bufs)):
        src = x if i == 0 else bufs[i - 1]
        _small_kernel[(1,)](src, bufs[i], src, x.numel(), PDL=pdl, BLOCK=1024, launch_pdl=pdl)
    return bufs[-1]


def stream_chain(x, acts, weights, outs, pdl, prefetch):
    n, k = weights[0].shape
    for i, w in enumerate(weights):
        bias = x if i == 0 else outs[i - 1]
        _small_kernel[(1,)](x, acts[i], bias, k, PDL=pdl, BLOCK=8192, launch_pdl=pdl)
        _gemv_kernel[(n // 16,)](
            w,
            acts[i],
            outs[i],
            n,
            k,
            PDL=pdl,
            PREFETCH=prefetch,
            BLOCK_N=16,
            BLOCK_K=256,
            num_warps=4,
            num_stages=4,
            launch_pdl=pdl,
        )
    return outs[-1]


def main() -> None:
    out_path = sys.argv[1]
    torch.manual_seed(0)
    dev = "cuda"
    report = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__}

    x = torch.randn(1024, device=dev)
    bufs = [torch.empty_like(x) for _ in range(64)]
    small = {}
    for name, pdl in (("plain", False), ("pdl", True)):
        small_chain(x, bufs, pdl)
        torch.cuda.synchronize()
        got = bufs[-1].clone()
        if name == "plain":
            want = got
        ms = graph_ms(lambda pdl=pdl: small_chain(x, bufs, pdl))
        torch.cuda.synchronize()
        same = torch.equal(got, want) and torch.equal(bufs[-1], want)  # eager, then replayed
        small[name] = {"ms": ms, "same_bits": bool(same)}
    report["small_64_launches"] = small

    n, k = 2048, 7168
    xs = torch.randn(k, device=dev)
    weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(8)]
    acts = [torch.empty(k, device=dev) for _ in weights]
    outs = [torch.empty(n, device=dev) for _ in weights]
    stream = {}
    for name, pdl, prefetch in (
        ("plain", False, 0),
        ("pdl", True, 0),
        ("pdl_prefetch_2k", True, 2048),
        ("pdl_prefetch_8k", True, 8192),
        ("plain", False, 0),
    ):
        stream_chain(xs, acts, weights, outs, pdl, prefetch)
        torch.cuda.synchronize()
        got = outs[-1].clone()
        if "want" not in stream:
            stream["want"] = got
        ms = graph_ms(lambda pdl=pdl, prefetch=prefetch: stream_chain(xs, acts, weights, outs, pdl, prefetch))
        torch.cuda.synchronize()
        same = torch.equal(got, stream["want"]) and torch.equal(outs[-1], stream["want"])
        stream.setdefault(name, []).append({"ms": ms, "same_bits": bool(same)})
    del stream["want"]
    report["stream_8_pairs"] = stream
    report["stream_weight_bytes"] = 8 * n * k * 2
    print(json.dumps(report, indent=1))
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
