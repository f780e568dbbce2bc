"""Expert-parallel load balancing under skewed routing: tokens per rank, and the MoE experts' time per rank.

    python benchmarks/bench_eplb.py --out eplb.json                                   # CPU: balance only
    python benchmarks/bench_eplb.py --time --small                                    # CPU smoke run of the timing
    python benchmarks/bench_eplb.py --time --backend cuda_sm100 --device cuda --out eplb_h200.json   # one GPU

1. Routing: ``--tokens`` tokens of DeepSeek-V3's router shape (256 experts in 8 groups, top-4 groups, top-8;
   ``--small``: 32 experts in 4 groups, top-2 groups, top-4) through ``moe_route`` on random logits plus a skew:
   per-expert popularity falling as a Zipf law over a random order of the experts, and one hot expert that about
   every token picks (``--hot``). Two independent batches: the first is the window whose load places the experts,
   the second is the batch the placements are judged on (out of sample).
2. Balance: for each rank count and number of redundant experts, the rows each rank receives under the
   placement's replica rule (``ExpertPlacement.route``; a rank routes its contiguous share of the tokens, as the
   model does): the contiguous placement without redundancy, EPLB without redundancy, and EPLB with it. Reports
   max/mean rows per rank (1.0 is perfect balance), and how long ``rebalance_experts`` takes for ``--layers``
   layers.
3. ``--time``: each rank's expert work (``grouped_gemm`` gate-up, ``silu_and_mul``, ``grouped_gemm`` down over the
   rows it receives, bf16, V3 widths 7168 x 2048; ``--small``: 256 x 128) run one rank after another on this one
   device and timed (median of ``--iters``; CUDA events on a GPU, the host clock on the CPU). An expert-parallel
   layer waits for its slowest rank, so the report gives the slowest and the mean rank. Dispatch and combine are
   not included (``bench_ep.py`` times those over a real group).

Rank 0's figures are written to ``--out`` as JSON and printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import deepinfer
from deepinfer import ops
from deepinfer.model.eplb import phy2log_of, rebalance_experts
from deepinfer.ops.moe import ExpertPlacement

V3 = dict(experts=256, groups=8, topk_group=4, top_k=8, hidden=7168, inter=2048, ranks=[8, 16, 32], redundant=[32])
SMALL = dict(experts=32, groups=4, topk_group=2, top_k=4, hidden=256, inter=128, ranks=[4, 8], redundant=[8])


def routing(cfg: dict, tokens: int, hot: float, seed: int, popularity: torch.Tensor, hot_expert: int) -> torch.Tensor:
    """``[tokens, top_k]`` expert ids from ``moe_route`` on random logits plus the popularity skew."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, cfg["experts"], generator=g) + popularity
    bias = torch.zeros(cfg["experts"])
    bias[hot_expert] = hot
    _, ids = ops.moe_route(
        logits, bias, top_k=cfg["top_k"], n_group=cfg["groups"], topk_group=cfg["topk_group"], scoring="sigmoid"
    )
    return ids.long()


def popularity_skew(cfg: dict, seed: int, zipf: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive logit bias giving expert ``perm[i]`` popularity ``1 / (i + 1) ** zipf``; and ``perm``."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(cfg["experts"], generator=g)
    skew = torch.empty(cfg["experts"])
    skew[perm] = -zipf * torch.log(torch.arange(1, cfg["experts"] + 1, dtype=torch.float32))
    return skew, perm


def received(placement: ExpertPlacement, ids: torch.Tensor) -> list[list[int]]:
    """Rows each rank receives per local expert, by the replica rule, each rank routing its contiguous share."""
    world, tokens = placement.world_size, ids.shape[0]
    share = -(-tokens // world)
    src = torch.arange(tokens) // share
    local_t = torch.arange(tokens) % share
    holders = placement.expert_ranks
    copies = torch.tensor([len(h) for h in holders])
    width = int(copies.max())
    rank_tab = torch.tensor([list(h) + [h[0]] * (width - len(h)) for h in holders])
    local_tab = torch.tensor(
        [[placement.local_experts[r].index(e) for r in row] for e, row in enumerate(rank_tab.tolist())]
    )
    e = ids
    copy = (src[:, None] + local_t[:, None]) % copies[e]
    dst, loc = rank_tab[e, copy].flatten(), local_tab[e, copy].flatten()
    per_expert = max(len(x) for x in placement.local_experts)
    counts = torch.zeros(world * per_expert, dtype=torch.int64).index_add_(
        0, dst * per_expert + loc, torch.ones_like(dst)
    )
    return [counts[r * per_expert : r * per_expert + len(placement.local_experts[r])].tolist() for r in range(world)]


def imbalance(rows: list[list[int]]) -> float:
    per_rank = [sum(r) for r in rows]
    return max(per_rank) / (sum(per_rank) / len(per_rank))


def time_ranks(rows: list[list[int]], cfg: dict, device: torch.device, iters: int) -> list[float]:
    """Seconds (median) of each rank's expert work over its received rows, run one rank at a time."""
    per = max(len(r) for r in rows)
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(per, 2 * cfg["inter"], cfg["hidden"], generator=g) * 0.02).bfloat16().to(device)
    w2 = (torch.randn(per, cfg["hidden"], cfg["inter"], generator=g) * 0.02).bfloat16().to(device)
    most = max(sum(r) for r in rows)
    x_all = torch.randn(most, cfg["hidden"], generator=g).bfloat16().to(device)
    out = []
    for counts in rows:
        offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=device)
        x = x_all[: int(offsets[-1])]
        a13, a2 = w13[: len(counts)], w2[: len(counts)]

        def work(x=x, a13=a13, a2=a2, offsets=offsets):
            h = ops.grouped_gemm(x, a13, expert_offsets=offsets, out_dtype=torch.bfloat16)
            return ops.grouped_gemm(ops.silu_and_mul(h), a2, expert_offsets=offsets, out_dtype=torch.bfloat16)

        with deepinfer.value_checks(False):
            work()
            samples = []
            for _ in range(iters):
                if device.type == "cuda":
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    work()
                    end.record()
                    end.synchronize()
                    samples.append(start.elapsed_time(end) / 1e3)
                else:
                    t0 = time.perf_counter()
                    work()
                    samples.append(time.perf_counter() - t0)
        out.append(statistics.median(samples))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="small shapes (CPU)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per batch (default 8192, --small 512)")
    ap.add_argument("--zipf", type=float, default=1.0, help="popularity exponent of the skew")
    ap.add_argument("--hot", type=float, default=0.8, help="router bias of the hot expert (1.0: every token)")
    ap.add_argument("--layers", type=int, default=58, help="layers in the timing of rebalance_experts")
    ap.add_argument("--ranks", type=int, nargs="*", default=None)
    ap.add_argument("--redundant", type=int, nargs="*", default=None)
    ap.add_argument("--time", action="store_true", help="time each rank's expert work on this device")
    ap.add_argument("--backend", default="reference")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations per rank (default 20, --small 3)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = dict(SMALL if args.small else V3)
    tokens = args.tokens or (512 if args.small else 8192)
    iters = args.iters or (3 if args.small else 20)
    ranks = args.ranks or cfg["ranks"]
    redundant = args.redundant or cfg["redundant"]
    device = torch.device(args.device)
    settings = {"tokens": tokens, "zipf": args.zipf, "hot": args.hot, "ranks": ranks, "redundant": redundant}
    report: dict = {"config": cfg | settings, "results": []}
    with deepinfer.use(args.backend):
        skew, perm = popularity_skew(cfg, 1, args.zipf)
        window = routing(cfg, tokens, args.hot, 2, skew, int(perm[0]))
        judged = routing(cfg, tokens, args.hot, 3, skew, int(perm[0]))
        load = torch.bincount(window.flatten(), minlength=cfg["experts"]).double()
        top = torch.bincount(judged.flatten(), minlength=cfg["experts"]).max().item() / judged.numel()
        report["hottest_expert_share"] = top
        print(f"routing: {tokens} tokens, top-{cfg['top_k']} of {cfg['experts']}; hottest expert {top:.1%} of pairs")
        big = load.expand(args.layers, -1).contiguous()
        t0 = time.perf_counter()
        rebalance_experts(big, cfg["experts"] + redundant[-1], cfg["groups"], 1, ranks[-1])
        report["rebalance_seconds"] = {"layers": args.layers, "seconds": time.perf_counter() - t0}
        print(f"rebalance_experts: {args.layers} layers in {report['rebalance_seconds']['seconds']:.3f} s")
        for world in ranks:
            cases = {"contiguous": ExpertPlacement.contiguous(cfg["experts"], world)}
            for r in [0, *redundant]:
                if (cfg["experts"] + r) % world == 0:
                    plan = rebalance_experts(load[None], cfg["experts"] + r, cfg["groups"], 1, world)
                    cases[f"eplb_r{r}"] = plan.placements(world)[0]
            for name, placement in cases.items():
                rows = received(placement, judged)
                entry = {
                    "ranks": world,
                    "placement": name,
                    "slots_per_rank": len(placement.local_experts[0]),
                    "max_over_mean_rows": imbalance(rows),
                    "max_rows": max(sum(r) for r in rows),
                    "phy2log": phy2log_of(placement),
                }
                line = f"ranks {world:3d} {name:12s} max/mean rows {entry['max_over_mean_rows']:.3f}"
                if args.time:
                    seconds = time_ranks(rows, cfg, device, iters)
                    entry["rank_seconds"] = seconds
                    entry["slowest_rank_s"], entry["mean_rank_s"] = max(seconds), statistics.mean(seconds)
                    line += f"  slowest rank {max(seconds) * 1e3:.3f} ms, mean {statistics.mean(seconds) * 1e3:.3f} ms"
                print(line)
                report["results"].append(entry)
    report["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
