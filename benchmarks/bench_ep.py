"""Expert-parallel ``ep_dispatch`` + ``ep_combine`` over a real process group: correctness, then bandwidth/latency.

    torchrun --nproc-per-node 2 benchmarks/bench_ep.py --out ep.json                       # NCCL, one GPU per rank
    torchrun --nproc-per-node 2 benchmarks/bench_ep.py --backend gloo --small --out ep.json  # CPU smoke run
    torchrun --nproc-per-node 2 benchmarks/bench_ep.py --backend gloo-cuda --check-only --out ep.json  # one GPU

1. Correctness: fresh random routings (plus a skewed one: every pair to rank 0's experts, some -1 ids), bf16 and
   FP8 payloads, both modes. Each rank checks its received layout byte for byte against the one-process reference
   on the concatenated batch (with the default contiguous placement rank r's layout is a slice of that), and its
   combined output against the reference's rows of its tokens.
2. normal mode, 4096 tokens x 7168 hidden, top-8 of 256 experts per rank (``--small``: 64 x 256, top-4 of 16):
   dispatch + combine timed with CUDA events (median over iterations; each iteration takes the next of 8 random
   routings drawn beforehand, so consecutive iterations never route alike), against raw
   ``all_to_all_single`` calls moving the same bytes with the same splits in the same run (dispatch payload and
   weights one way, combine payload back). Reports GB/s of each and their ratio (target >= 0.8), for bf16 and FP8
   dispatch (combine always bf16). Both figures count one payload row per (token, expert) pair. The dispatch
   itself sends a token once to each rank that holds its experts, and the combine returns one fp32 partial sum per
   (token, rank) where that is not more bytes (``combine`` in the report), so both put fewer bytes on the wire than
   the raw exchange (``bytes_ours_moves_per_rank``).
3. low_latency mode at 128 tokens (capacity 128): dispatch and combine latency, eagerly and replayed from one
   CUDA graph (the graph result is reported, or the reason it could not be captured).

Timing runs with ``DEEPINFER_VALUE_CHECKS=0`` (the checks synchronise with the host); the correctness phase runs
with them on. ``NCCL_NVLS_ENABLE=0`` is forced: NVLink multicast is never used. Rank 0 writes the JSON report
(every rank's medians, and the worst over ranks).
"""

from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast; set before NCCL initialises

import argparse
import datetime
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import deepinfer
from deepinfer import QTensor
from deepinfer.ops import ep_combine, ep_dispatch
from deepinfer.qtensor import quantize_rows
from deepinfer.reference.ep import sums_per_rank

FULL = {"tokens": 4096, "hidden": 7168, "experts": 256, "top_k": 8, "ll_tokens": 128}
SMALL = {"tokens": 64, "hidden": 256, "experts": 16, "top_k": 4, "ll_tokens": 16}


class Timer:
    """Elapsed time of a region on the device timeline (CUDA events) or the host clock (CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def ms(self, a, b) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b)
        return (b - a) * 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def routing(gen: torch.Generator, tokens: int, experts: int, k: int, skip: float = 0.0, pool: int | None = None):
    """k distinct experts per token (among the first ``pool`` experts if given), a ``skip`` fraction of pairs -1."""
    scores = torch.rand(tokens, experts, generator=gen)
    if pool is not None:
        scores[:, pool:] = -1.0
    ids = scores.topk(k, dim=1).indices.to(torch.int32)
    ids[torch.rand(ids.shape, generator=gen) < skip] = -1
    return ids, torch.rand(ids.shape, generator=gen) + 0.05


def stand_in_expert(recv_x, recv_ids) -> torch.Tensor:
    x = recv_x.dequantize() if isinstance(recv_x, QTensor) else recv_x.float()
    return (x * (1.0 + recv_ids.clamp_min(0).float().unsqueeze(-1) / 8.0)).to(torch.bfloat16)


def row_bytes(x) -> torch.Tensor:
    if isinstance(x, QTensor):
        return torch.cat([x.data.contiguous().view(torch.uint8), x.scale.contiguous().view(torch.uint8)], dim=-1)
    return x.contiguous().view(torch.uint8)


def check_case(name, *, mode, fp8, tokens, hidden, experts, k, device, seed, skew=False) -> dict:
    """One correctness case; every rank draws the whole batch from ``seed`` and checks its own part."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed)
    total = tokens * world
    x_all = torch.randn(total, hidden, generator=gen).to(torch.bfloat16)
    pool = experts // world if skew else None  # skew: only rank 0's experts, so the others receive nothing
    ids_all, w_all = routing(gen, total, experts, min(k, pool or k), skip=0.1 if skew else 0.02, pool=pool)
    x_all, ids_all, w_all = x_all.to(device), ids_all.to(device), w_all.to(device)
    if fp8:
        x_all = quantize_rows(x_all, 128, "fp32")
    mine = slice(rank * tokens, (rank + 1) * tokens)
    x = QTensor(x_all.data[mine], x_all.scale[mine], x_all.block, x_all.scale_format) if fp8 else x_all[mine]
    capacity = tokens if mode == "low_latency" else None
    out = ep_dispatch(x, ids_all[mine], w_all[mine], num_experts=experts, group=dist.group.WORLD, mode=mode,
                      capacity=capacity)  # fmt: skip
    recv_x, recv_ids, recv_w, layout, handle = out
    y = stand_in_expert(recv_x, recv_ids)
    combined = ep_combine(y, handle)

    impl, fallback = deepinfer.dispatch.last_resolution("ep_dispatch")
    with deepinfer.use("reference"):  # the one-process reference on the whole batch
        ref_x, ref_ids, ref_w, ref_layout, ref_handle = ep_dispatch(x_all, ids_all, w_all, num_experts=experts)
        ref_out = ep_combine(stand_in_expert(ref_x, ref_ids), ref_handle)[mine]
    lo, hi = rank * experts // world, (rank + 1) * experts // world
    off = ref_layout.expert_offsets.long().clone()
    off[-1] = int((ref_ids >= 0).sum())  # one process's last range also holds the skipped pairs' rows
    problems = []
    if mode == "normal":
        a, b = int(off[lo]), int(off[hi])
        if layout.expert_offsets.tolist() != (off[lo : hi + 1] - a).tolist():
            problems.append("expert_offsets")
        if not torch.equal(row_bytes(recv_x), row_bytes(ref_x)[a:b]):
            problems.append("recv_x")
        if not torch.equal(recv_ids, ref_ids[a:b]) or not torch.equal(recv_w, ref_w[a:b]):
            problems.append("recv_ids/recv_weights")
    else:
        counts = (off[lo + 1 : hi + 1] - off[lo:hi]).tolist()
        if layout.masked_m.tolist() != counts:
            problems.append("masked_m")
        got, ref_rows = row_bytes(recv_x), row_bytes(ref_x)
        for e, n in enumerate(counts):
            a = int(off[lo + e])
            if not torch.equal(got[e, :n], ref_rows[a : a + n]) or not torch.equal(recv_ids[e, :n], ref_ids[a : a + n]):
                problems.append(f"rows of local expert {e}")
                break
    diff = (combined.float() - ref_out.float()).norm(dim=-1) / ref_out.float().norm(dim=-1).clamp_min(1e-30)
    worst = float(diff.max()) if diff.numel() else 0.0
    if not worst <= 1e-3:
        problems.append(f"combine worst-row relative error {worst:.2e}")
    return {
        "case": name,
        "ok": not problems,
        "problems": problems,
        "combine_bitwise_equal": bool(torch.equal(combined, ref_out)),
        "combine_worst_row_rel_err": worst,
        "rows_received": int(recv_ids.numel() if mode == "normal" else layout.masked_m.sum()),
        "implementation": f"{impl.backend}/{impl.provider}" + (" (fallback to the reference)" if fallback else ""),
    }


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def bench_normal(cfg, *, fp8: bool, device, timer: Timer, iters: int, warmup: int, seed: int) -> dict:
    """dispatch + combine against raw all_to_all_single of the same bytes (medians in ms, GB/s per rank)."""
    world = dist.get_world_size()
    grp = dist.group.WORLD
    tokens, hidden, experts, k = cfg["tokens"], cfg["hidden"], cfg["experts"], cfg["top_k"]
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    x = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=torch.bfloat16)
    if fp8:
        x = quantize_rows(x, 128, "fp32")
    routings = [tuple(t.to(device) for t in routing(gen, tokens, experts, k)) for _ in range(8)]
    y_pool = torch.randn(tokens * k * world, hidden, generator=gen).to(device=device, dtype=torch.bfloat16)
    payload_width = hidden * (1 if fp8 else 2) + (4 * hidden // 128 if fp8 else 0)
    combine_width = 2 * hidden
    ours = {"dispatch": [], "combine": [], "total": []}
    raw = {"dispatch_dir": [], "combine_dir": [], "total": []}
    sent_bytes, cross_bytes, wire_bytes, partial = [], [], [], False
    for it in range(warmup + iters):
        ids, w = routings[it % len(routings)]
        dist.barrier()
        timer.sync()
        t0 = timer.mark()
        recv_x, _, _, _, handle = ep_dispatch(x, ids, w, num_experts=experts, group=grp)
        t1 = timer.mark()
        y = recv_x if not fp8 else y_pool[: handle.recv_shape[0]]
        ep_combine(y, handle)
        t2 = timer.mark()
        # The same bytes, raw: the same splits, in three plain exchanges.
        send, recv = handle.send_splits, handle.recv_splits
        a = torch.empty(sum(send), payload_width, dtype=torch.uint8, device=device)
        b = torch.empty(sum(recv), payload_width, dtype=torch.uint8, device=device)
        wa = torch.empty(sum(send), dtype=torch.float32, device=device)
        wb = torch.empty(sum(recv), dtype=torch.float32, device=device)
        c = torch.empty(sum(recv), combine_width, dtype=torch.uint8, device=device)
        d = torch.empty(sum(send), combine_width, dtype=torch.uint8, device=device)
        dist.barrier()
        timer.sync()
        r0 = timer.mark()
        dist.all_to_all_single(wb, wa, recv, send, group=grp)
        dist.all_to_all_single(b, a, recv, send, group=grp)
        r1 = timer.mark()
        dist.all_to_all_single(d, c, send, recv, group=grp)
        r2 = timer.mark()
        if it >= warmup:
            ours["dispatch"].append(timer.ms(t0, t1))
            ours["combine"].append(timer.ms(t1, t2))
            ours["total"].append(timer.ms(t0, t2))
            raw["dispatch_dir"].append(timer.ms(r0, r1))
            raw["combine_dir"].append(timer.ms(r1, r2))
            raw["total"].append(timer.ms(r0, r2))
            rank = dist.get_rank()
            total_rows = sum(send)
            sent_bytes.append(total_rows * (payload_width + 4 + combine_width))
            cross_bytes.append((total_rows - send[rank]) * (payload_width + 4 + combine_width))
            # What ours moves: per token copy its payload row and a record of 4 int32 per slot, then the combine's
            # fp32 partial sums (one per received copy) or its rows (one per pair) back.
            partial = sums_per_rank(y, handle)
            back = sum(handle.copy_recv_splits) * 4 * hidden if partial else total_rows * combine_width
            wire_bytes.append(sum(handle.copy_splits) * (payload_width + 16 * k) + back)
    med = {f"ours_{k_}_ms": median(v) for k_, v in ours.items()} | {f"raw_{k_}_ms": median(v) for k_, v in raw.items()}
    nbytes = median(sent_bytes)
    out = {
        "bytes_sent_per_rank": nbytes,
        "bytes_crossing_ranks_per_rank": median(cross_bytes),
        "bytes_ours_moves_per_rank": median(wire_bytes),
        "combine": "per-rank fp32 partial sums" if partial else "a row per pair",
        **med,
        "ours_GBps": nbytes / med["ours_total_ms"] / 1e6,
        "raw_GBps": nbytes / med["raw_total_ms"] / 1e6,
    }
    out["ratio"] = out["ours_GBps"] / out["raw_GBps"]
    return out


def bench_low_latency(cfg, *, fp8: bool, device, timer: Timer, iters: int, warmup: int, seed: int) -> dict:
    grp = dist.group.WORLD
    tokens, hidden, experts, k = cfg["ll_tokens"], cfg["hidden"], cfg["experts"], cfg["top_k"]
    gen = torch.Generator().manual_seed(seed + 7 * dist.get_rank())
    x = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=torch.bfloat16)
    if fp8:
        x = quantize_rows(x, 128, "fp32")
    routings = [tuple(t.to(device) for t in routing(gen, tokens, experts, k)) for _ in range(8)]
    world = dist.get_world_size()
    y = torch.randn(experts // world, world * tokens, hidden, generator=gen).to(device=device, dtype=torch.bfloat16)

    def step(ids, w):
        out = ep_dispatch(x, ids, w, num_experts=experts, group=grp, mode="low_latency", capacity=tokens)
        return out, ep_combine(y, out[4])

    disp, comb = [], []
    for it in range(warmup + iters):
        ids, w = routings[it % len(routings)]
        dist.barrier()
        timer.sync()
        t0 = timer.mark()
        out = ep_dispatch(x, ids, w, num_experts=experts, group=grp, mode="low_latency", capacity=tokens)
        t1 = timer.mark()
        ep_combine(y, out[4])
        t2 = timer.mark()
        if it >= warmup:
            disp.append(timer.ms(t0, t1) * 1e3)
            comb.append(timer.ms(t1, t2) * 1e3)
    result = {"tokens": tokens, "capacity": tokens, "dispatch_us": median(disp), "combine_us": median(comb)}
    if device.type != "cuda":
        return result
    # The same step captured once in a CUDA graph and replayed: inputs are copied into the captured buffers.
    try:
        ids_buf, w_buf = (t.clone() for t in routings[0])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(ids_buf, w_buf)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(ids_buf, w_buf)
        times = []
        for it in range(warmup + iters):
            ids, w = routings[it % len(routings)]
            ids_buf.copy_(ids)
            w_buf.copy_(w)
            dist.barrier()
            timer.sync()
            t0 = timer.mark()
            graph.replay()
            t1 = timer.mark()
            if it >= warmup:
                times.append(timer.ms(t0, t1) * 1e3)
        result["graph_dispatch_plus_combine_us"] = median(times)
    except Exception as err:  # reported, not fatal: the eager numbers stand
        result["graph_error"] = f"{type(err).__name__}: {err}"[:500]
    return result


def gather_report(local: dict) -> list[dict]:
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    return everyone


def worst(per_rank: list[dict], key_is_time: Callable[[str], bool]) -> dict:
    """Over ranks: the largest time, the smallest bandwidth and ratio."""
    out = {}
    for key, value in per_rank[0].items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            out[key] = value
            continue
        values = [r[key] for r in per_rank]
        out[key] = max(values) if key_is_time(key) else min(values)
    return out


def profile_normal(cfg, *, device, seed: int, trace: str) -> None:
    """One bf16 normal-mode dispatch + combine under the torch profiler; rank 0 prints its kernels and host time and
    writes the timeline (host ops and kernels) as a Chrome trace to ``trace``."""
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    x = torch.randn(cfg["tokens"], cfg["hidden"], generator=gen).to(device=device, dtype=torch.bfloat16)
    ids, w = (t.to(device) for t in routing(gen, cfg["tokens"], cfg["experts"], cfg["top_k"]))

    def round_trip():
        recv_x, _, _, _, handle = ep_dispatch(x, ids, w, num_experts=cfg["experts"], group=dist.group.WORLD)
        return ep_combine(recv_x, handle)

    round_trip()
    dist.barrier()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        round_trip()
        torch.cuda.synchronize()
    if dist.get_rank() == 0:
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
        prof.export_chrome_trace(trace)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON report (written by rank 0)")
    ap.add_argument(
        "--backend",
        default="nccl",
        choices=["nccl", "gloo", "gloo-cuda"],
        help="gloo-cuda: Gloo with CUDA tensors, ranks sharing the GPUs there are (checks GPU kernels without NCCL)",
    )
    ap.add_argument("--check-only", action="store_true", help="correctness only, no timing")
    ap.add_argument("--small", action="store_true", help="small shapes (CPU smoke run)")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations (default 50, --small 5)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed iterations first (default 5, --small 1)")
    ap.add_argument("--timeout", type=float, default=300.0, help="process-group timeout, seconds")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--accelerator", default=None, help="deepinfer backend to measure (default: the selected one)")
    ap.add_argument(
        "--profile", action="store_true", help="rank 0's kernels of one bf16 normal-mode round; trace beside --out"
    )
    args = ap.parse_args()
    cfg = SMALL if args.small else FULL
    iters = args.iters or (5 if args.small else 50)
    warmup = args.warmup if args.warmup is not None else (1 if args.small else 5)

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = datetime.timedelta(seconds=args.timeout)
    if args.backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    elif args.backend == "gloo-cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dist.init_process_group("gloo", timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.accelerator:
        deepinfer.use(args.accelerator)
    seed = args.seed if args.seed is not None else int(time.time())
    seed_t = torch.tensor([seed], dtype=torch.int64, device=device)
    dist.broadcast(seed_t, 0)
    seed = int(seed_t)
    timer = Timer(device)
    report: dict = {
        "config": {
            **cfg,
            "world_size": world,
            "backend": args.backend,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if args.backend == "nccl" else None,
            "NCCL_NVLS_ENABLE": os.environ["NCCL_NVLS_ENABLE"],
            "iters": iters,
            "warmup": warmup,
            "seed": seed,
            "selected_backend": deepinfer.current_backend().name,
        }
    }

    # 1. correctness (value checks on)
    checks = []
    small = {"tokens": 96, "hidden": cfg["hidden"], "experts": cfg["experts"], "k": cfg["top_k"]}
    for mode in ("normal", "low_latency"):
        for fp8 in (False, True):
            tag = f"{mode} {'fp8' if fp8 else 'bf16'}"
            shape = {"tokens": cfg["tokens"] if mode == "normal" else cfg["ll_tokens"]} | {
                "hidden": cfg["hidden"],
                "experts": cfg["experts"],
                "k": cfg["top_k"],
            }
            checks.append(check_case(tag, mode=mode, fp8=fp8, device=device, seed=seed + len(checks), **shape))
        checks.append(check_case(f"{mode} bf16 skewed", mode=mode, fp8=False, device=device, seed=seed + 99, skew=True,
                                 **small))  # fmt: skip
    per_rank = gather_report({"checks": checks})
    report["correctness"] = [
        {**c, "ok": all(r["checks"][i]["ok"] for r in per_rank), "per_rank": [r["checks"][i] for r in per_rank]}
        for i, c in enumerate(checks)
    ]
    ok = all(c["ok"] for c in report["correctness"])
    report["correctness_ok"] = ok

    # 2-3. timing (value checks off)
    os.environ["DEEPINFER_VALUE_CHECKS"] = "0"
    if ok and not args.check_only:
        normal = {}
        for fp8 in (False, True):
            res = bench_normal(cfg, fp8=fp8, device=device, timer=timer, iters=iters, warmup=warmup, seed=seed)
            ranks = gather_report(res)
            key = "fp8" if fp8 else "bf16"
            normal[key] = {"worst_rank": worst(ranks, lambda k_: k_.endswith("_ms")), "per_rank": ranks}
            normal[key]["worst_rank"]["target_0.8_met"] = normal[key]["worst_rank"]["ratio"] >= 0.8
        report["normal"] = normal
        low = {}
        for fp8 in (False, True):
            res = bench_low_latency(cfg, fp8=fp8, device=device, timer=timer, iters=iters, warmup=warmup, seed=seed)
            ranks = gather_report(res)
            worst_rank = worst(ranks, lambda k_: k_.endswith("_us"))
            low["fp8" if fp8 else "bf16"] = {"worst_rank": worst_rank, "per_rank": ranks}
        report["low_latency"] = low
        if args.profile:
            profile_normal(cfg, device=device, seed=seed, trace=os.path.splitext(args.out)[0] + ".trace.json")
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        print(json.dumps(_summary(report), indent=2))
    dist.barrier()
    dist.destroy_process_group()
    if not ok:
        raise SystemExit("correctness checks failed: see the report")


def _summary(report: dict) -> dict:
    out = {"correctness_ok": report["correctness_ok"]}
    for key, v in report.get("normal", {}).items():
        w = v["worst_rank"]
        out[f"normal {key}"] = (
            f"{w['ours_total_ms']:.3f} ms ({w['ours_GBps']:.1f} GB/s) vs raw {w['raw_total_ms']:.3f} ms "
            f"({w['raw_GBps']:.1f} GB/s): ratio {w['ratio']:.2f}"
        )
    for key, v in report.get("low_latency", {}).items():
        w = v["worst_rank"]
        if "graph_dispatch_plus_combine_us" in w:
            graph = f"{w['graph_dispatch_plus_combine_us']:.1f} us for both, replayed from a CUDA graph"
        else:
            graph = w.get("graph_error", "no CUDA graph on this device")
        out[f"low_latency {key}"] = f"dispatch {w['dispatch_us']:.1f} us, combine {w['combine_us']:.1f} us; {graph}"
    return out


if __name__ == "__main__":
    main()
