"""Shared by the multi-rank ``ep_dispatch`` / ``ep_combine`` tests: random problems, the received layout built
independently pair by pair, a stand-in expert, the one-process reference, and the harness that plays a test
module's scenarios on spawned Gloo ranks.

A test module using ``launch`` defines ``SCENARIOS`` (and optionally ``FAULTS`` and ``MISMATCHES``): name ->
``f(rank, world, *args)``,
and may define ``SEED`` (set on every rank from the parent's) and ``setup_rank()`` (backend selection before the
process group starts). Every rank still alive at the end or at the deadline is killed, so a bug fails a test but
never hangs the run.
"""

from __future__ import annotations

import datetime
import importlib
import os
import queue
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp

import deepinfer
from deepinfer import QTensor
from deepinfer.ops import ep_combine, ep_dispatch
from deepinfer.ops.moe import ExpertPlacement
from deepinfer.qtensor import quantize_rows


@dataclass
class Problem:
    xs: list  # per rank: [T_r, H] bf16 or QTensor
    ids: list[torch.Tensor]  # per rank: [T_r, k] int32
    weights: list[torch.Tensor]  # per rank: [T_r, k] fp32
    num_experts: int


def random_problem(
    g: torch.Generator,
    tokens: list[int],
    num_experts: int,
    k: int,
    hidden: int,
    *,
    fp8: str | None = None,
    skip: float = 0.15,
    experts: list[int] | None = None,
    repeat: float = 0.0,
) -> Problem:
    """Random routings: ``k`` distinct experts per token drawn from ``experts`` (default all), a ``skip`` share of
    pairs -1, a ``repeat`` share of slots copying slot 0 (a token naming an expert twice); ``fp8`` names the scale
    format of FP8 payloads (None: bf16)."""
    pool = torch.tensor(experts if experts is not None else list(range(num_experts)))
    xs, ids, ws = [], [], []
    for t in tokens:
        x = torch.randn(t, hidden, generator=g).bfloat16()
        xs.append(quantize_rows(x, 128, fp8) if fp8 else x)
        rows = [pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(t)]
        i = torch.stack(rows).to(torch.int32) if t else torch.zeros(0, k, dtype=torch.int32)
        again = torch.rand(i.shape, generator=g) < repeat
        again[:, 0] = False
        i = torch.where(again, i[:, :1].expand_as(i), i)
        i[torch.rand(i.shape, generator=g) < skip] = -1
        ids.append(i.contiguous())
        ws.append(torch.rand(i.shape, generator=g) + 0.05)
    return Problem(xs, ids, ws, num_experts)


def overflow_problem(g: torch.Generator, world: int, hidden: int) -> tuple[Problem, int]:
    """``(problem, capacity)``: rank 0 names expert 0 in every slot of every token, so ``world * capacity`` of its
    rows fit and the rest overflow; the other ranks route elsewhere."""
    capacity, k = 5, world + 2
    p = random_problem(g, [capacity] * world, 2 * world, k, hidden, experts=list(range(1, 2 * world)), skip=0.0)
    p.ids[0][:] = 0
    return p, capacity


def token_counts(g: torch.Generator, world: int, high: int, *, empty_rank: int | None = None) -> list[int]:
    t = torch.randint(1, high + 1, (world,), generator=g).tolist()
    if empty_rank is not None:
        t[empty_rank] = 0
    return t


def _route(placement: ExpertPlacement, expert: int, src: int, token: int) -> tuple[int, int]:
    """The documented replica rule, written out independently of the op."""
    holders = [r for r, held in enumerate(placement.local_experts) if expert in held]
    rank = holders[(src + token) % len(holders)]
    return rank, placement.local_experts[rank].index(expert)


def expected_pairs(p: Problem, placement: ExpertPlacement, rank: int) -> list[list[tuple[int, int, int]]]:
    """Per local expert of ``rank``: its (source rank, token, slot) pairs in the documented order."""
    out: list[list[tuple[int, int, int]]] = [[] for _ in placement.local_experts[rank]]
    for s, ids in enumerate(p.ids):
        for t in range(ids.shape[0]):
            for j in range(ids.shape[1]):
                e = int(ids[t, j])
                if e >= 0:
                    r, i = _route(placement, e, s, t)
                    if r == rank:
                        out[i].append((s, t, j))
    return out


def fitting_capacity(p: Problem, placement: ExpertPlacement, least: int) -> int:
    """The smallest low-latency capacity >= ``least`` with room for every local expert's rows (``world * capacity``
    per local expert): random routings with repeated experts can need more than the scenario's nominal capacity."""
    world = placement.world_size
    most = max((len(rows) for r in range(world) for rows in expected_pairs(p, placement, r)), default=0)
    return max(least, -(-most // world))


def row_bytes(x) -> torch.Tensor:
    if isinstance(x, QTensor):
        return torch.cat([x.data.contiguous().view(torch.uint8), x.scale.contiguous().view(torch.uint8)], dim=-1)
    return x.contiguous().view(torch.uint8)


def _expected_rows(p: Problem, pairs, width: int) -> tuple[torch.Tensor, list[int], list[float]]:
    by_rank = [row_bytes(x) for x in p.xs]
    rows = [by_rank[s][t] for s, t, _ in pairs]
    data = torch.stack(rows) if rows else torch.zeros(0, width, dtype=torch.uint8)
    return data, [int(p.ids[s][t, j]) for s, t, j in pairs], [float(p.weights[s][t, j]) for s, t, j in pairs]


def check_layout(out, p: Problem, placement: ExpertPlacement, rank: int, mode: str, capacity: int | None) -> None:
    """``ep_dispatch``'s result on ``rank`` equals the layout built pair by pair, byte for byte."""
    recv_x, recv_ids, recv_w, layout, _ = out
    lists = expected_pairs(p, placement, rank)
    width = row_bytes(p.xs[rank]).shape[-1]
    if mode == "normal":
        flat = [pair for lst in lists for pair in lst]
        offsets = [0]
        for lst in lists:
            offsets.append(offsets[-1] + len(lst))
        # one process: a row for every pair, the skipped ones last in the last expert's range (id -1, weight 0)
        skipped = p.ids[rank].numel() - len(flat) if placement.world_size == 1 else 0
        offsets[-1] += skipped
        assert layout.masked_m is None and layout.expert_offsets.dtype == torch.int32
        assert layout.expert_offsets.tolist() == offsets
        data, ids, ws = _expected_rows(p, flat, width)
        assert torch.equal(row_bytes(recv_x)[: len(flat)], data), "received rows differ"
        assert recv_ids.dtype == torch.int32 and recv_ids.tolist() == ids + [-1] * skipped
        assert recv_w.tolist() == ws + [0.0] * skipped
        return
    max_m = placement.world_size * capacity
    assert layout.expert_offsets is None
    assert tuple(recv_ids.shape) == (len(lists), max_m)
    assert layout.masked_m.tolist() == [min(len(lst), max_m) for lst in lists]
    got = row_bytes(recv_x)
    for i, lst in enumerate(lists):
        n = min(len(lst), max_m)
        data, ids, ws = _expected_rows(p, lst[:n], width)
        assert torch.equal(got[i, :n], data), f"local expert {i}: received rows differ"
        assert recv_ids[i, :n].tolist() == ids and recv_w[i, :n].tolist() == ws
        assert bool((recv_ids[i, n:] == -1).all()) and bool((recv_w[i, n:] == 0).all())


def expert(recv_x, recv_ids, layout, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A stand-in expert (each scales its rows by its own factor); rows past masked_m, and the skipped pairs' rows
    of one process's normal mode, become NaN, so reading one anywhere shows."""
    x = recv_x.dequantize() if isinstance(recv_x, QTensor) else recv_x.float()
    y = (x * (1.0 + recv_ids.clamp_min(0).float().unsqueeze(-1) / 8.0)).to(dtype)
    if layout.masked_m is not None:
        unused = torch.arange(y.shape[1])[None, :] >= layout.masked_m[:, None]
        y[unused] = float("nan")
    else:
        y[recv_ids < 0] = float("nan")
    return y


def _cat(xs):
    if isinstance(xs[0], QTensor):
        return QTensor(
            torch.cat([x.data for x in xs]), torch.cat([x.scale for x in xs]), xs[0].block, xs[0].scale_format
        )
    return torch.cat(xs)


def reference_out(p: Problem, rank: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The one-process reference on the concatenated batch, rows of ``rank``'s tokens."""
    with deepinfer.use("reference"):
        recv_x, recv_ids, _, layout, handle = ep_dispatch(
            _cat(p.xs), torch.cat(p.ids), torch.cat(p.weights), num_experts=p.num_experts
        )
        out = ep_combine(expert(recv_x, recv_ids, layout, dtype), handle)
    start = sum(x.shape[0] for x in p.xs[:rank])
    return out[start : start + p.xs[rank].shape[0]]


# ----------------------------------------------------------------------------------------------------------------
# Harness


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(module: str, rank: int, world: int, port: int, seed, args, names, pg_timeout_s: float, results) -> None:
    mod = importlib.import_module(module)
    if seed is not None:
        mod.SEED = seed  # the parent's: every rank draws the same problems
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        getattr(mod, "setup_rank", lambda: None)()
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=pg_timeout_s))
    except BaseException:
        for name in names:
            results.put((rank, name, traceback.format_exc(), None, 0.0))
        return
    scenarios = {**mod.SCENARIOS, **getattr(mod, "FAULTS", {}), **getattr(mod, "MISMATCHES", {})}
    for name in names:
        start = time.monotonic()
        try:
            payload = scenarios[name](rank, world, *args)
            results.put((rank, name, None, payload, time.monotonic() - start))
        except BaseException:
            results.put((rank, name, traceback.format_exc(), None, time.monotonic() - start))
    dist.destroy_process_group()


def launch(
    module: str,
    world: int,
    names: list[str],
    *,
    pg_timeout_s: float,
    deadline_s: float,
    seed: int | None = None,
    args: tuple = (),
    expect: set[int] | None = None,
) -> dict[tuple[int, str], tuple[str | None, Any, float]]:
    """Plays scenarios ``names`` of test module ``module`` (each ``f(rank, world, *args)``) on ``world`` spawned
    ranks; returns ``{(rank, name): (traceback or None, what the scenario returned, seconds)}`` for the ranks in
    ``expect`` (default all). ``seed``: the module's ``SEED`` on every rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_worker, args=(module, r, world, port, seed, args, names, pg_timeout_s, results), daemon=True
        )
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    expect = set(range(world)) if expect is None else expect
    wanted = len(expect) * len(names)
    got: dict[tuple[int, str], tuple[str | None, Any, float]] = {}
    end = time.monotonic() + deadline_s
    try:
        while len(got) < wanted and time.monotonic() < end:
            try:
                rank, name, err, payload, seconds = results.get(timeout=0.2)
            except queue.Empty:
                if all(not procs[r].is_alive() for r in expect):
                    break
                continue
            if rank in expect:
                got[(rank, name)] = (err, payload, seconds)
    finally:
        for r, proc in enumerate(procs):
            proc.join(timeout=5 if len(got) == wanted and r in expect else 0.1)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    return got
