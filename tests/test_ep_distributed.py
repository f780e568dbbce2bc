"""``ep_dispatch`` / ``ep_combine`` across the ranks of real multi-process Gloo groups (2 and 4 ranks, CPU).

Each run spawns the ranks once and plays every scenario in them; each scenario is then reported as its own test.
Every rank draws the whole problem (all ranks' tokens and routings) from one shared fresh seed, so each checks its
own received layout against an independent pair-by-pair construction, and its combined output against the
one-process reference on the concatenated batch. Dead and hung ranks must surface as errors within the process
group's timeout; the harness kills whatever is left, so a bug can fail these tests but never hang the run.
"""

from __future__ import annotations

import datetime
import os
import queue
import random
import socket
import time
import traceback
import zlib
from dataclasses import dataclass

import pytest
import torch
import torch.multiprocessing as mp

import deepinfer
from deepinfer import InputError, QTensor
from deepinfer.ops import ep_combine, ep_dispatch
from deepinfer.ops.moe import ExpertPlacement
from deepinfer.qtensor import quantize_rows
from deepinfer.reference import ep as ep_ref

SEED = random.randrange(2**31)
RUN_TIMEOUT_S = 30.0  # process-group timeout while the scenarios run: a desynchronised bug fails, never hangs
RUN_DEADLINE_S = 150.0  # the harness kills every rank after this long


# ----------------------------------------------------------------------------------------------------------------
# Problems and the independent expected layout


@dataclass
class Problem:
    xs: list  # per rank: [T_r, H] bf16 or QTensor
    ids: list[torch.Tensor]  # per rank: [T_r, k] int32
    weights: list[torch.Tensor]  # per rank: [T_r, k] fp32
    num_experts: int


def _gen(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(SEED + zlib.crc32(name.encode()))


def _problem(
    g: torch.Generator,
    tokens: list[int],
    num_experts: int,
    k: int,
    hidden: int,
    *,
    fp8: str | None = None,
    skip: float = 0.15,
    experts: list[int] | None = None,
) -> Problem:
    """Random routings: k distinct experts per token drawn from ``experts`` (default all), some pairs -1; ``fp8``
    names the scale format of FP8 payloads (None: bf16)."""
    pool = torch.tensor(experts if experts is not None else list(range(num_experts)))
    xs, ids, ws = [], [], []
    for t in tokens:
        x = torch.randn(t, hidden, generator=g).bfloat16()
        xs.append(quantize_rows(x, 128, fp8) if fp8 else x)
        rows = [pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(t)]
        i = torch.stack(rows).to(torch.int32) if t else torch.zeros(0, k, dtype=torch.int32)
        i[torch.rand(i.shape, generator=g) < skip] = -1
        ids.append(i)
        ws.append(torch.rand(i.shape, generator=g) + 0.05)
    return Problem(xs, ids, ws, num_experts)


def _route(placement: ExpertPlacement, expert: int, src: int, token: int) -> tuple[int, int]:
    """The documented replica rule, written out independently of the op."""
    holders = [r for r, held in enumerate(placement.local_experts) if expert in held]
    rank = holders[(src + token) % len(holders)]
    return rank, placement.local_experts[rank].index(expert)


def _expected_pairs(p: Problem, placement: ExpertPlacement, rank: int) -> list[list[tuple[int, int, int]]]:
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


def _row_bytes(x) -> torch.Tensor:
    if isinstance(x, QTensor):
        return torch.cat([x.data.contiguous().view(torch.uint8), x.scale.contiguous().view(torch.uint8)], dim=-1)
    return x.contiguous().view(torch.uint8)


def _expected_rows(p: Problem, pairs, hidden_bytes: int) -> tuple[torch.Tensor, list[int], list[float]]:
    by_rank = [_row_bytes(x) for x in p.xs]
    rows = [by_rank[s][t] for s, t, _ in pairs]
    data = torch.stack(rows) if rows else torch.zeros(0, hidden_bytes, dtype=torch.uint8)
    return data, [int(p.ids[s][t, j]) for s, t, j in pairs], [float(p.weights[s][t, j]) for s, t, j in pairs]


def _check_layout(out, p: Problem, placement: ExpertPlacement, rank: int, mode: str, capacity: int | None) -> None:
    recv_x, recv_ids, recv_w, layout, _ = out
    lists = _expected_pairs(p, placement, rank)
    width = _row_bytes(p.xs[rank]).shape[-1]
    if mode == "normal":
        flat = [pair for lst in lists for pair in lst]
        offsets = [0]
        for lst in lists:
            offsets.append(offsets[-1] + len(lst))
        assert layout.masked_m is None and layout.expert_offsets.dtype == torch.int32
        assert layout.expert_offsets.tolist() == offsets
        data, ids, ws = _expected_rows(p, flat, width)
        assert torch.equal(_row_bytes(recv_x), data), "received rows differ"
        assert recv_ids.dtype == torch.int32 and recv_ids.tolist() == ids
        assert recv_w.tolist() == ws
        return
    world = len(placement.local_experts)
    max_m = world * capacity
    assert layout.expert_offsets is None
    assert tuple(recv_ids.shape) == (len(lists), max_m)
    assert layout.masked_m.tolist() == [min(len(lst), max_m) for lst in lists]
    got = _row_bytes(recv_x)
    for i, lst in enumerate(lists):
        n = min(len(lst), max_m)
        data, ids, ws = _expected_rows(p, lst[:n], width)
        assert torch.equal(got[i, :n], data), f"local expert {i}: received rows differ"
        assert recv_ids[i, :n].tolist() == ids and recv_w[i, :n].tolist() == ws
        assert bool((recv_ids[i, n:] == -1).all()) and bool((recv_w[i, n:] == 0).all())


def _expert(recv_x, recv_ids, layout) -> torch.Tensor:
    """A stand-in expert (each scales its rows by its own factor); rows past masked_m become NaN, so reading one
    anywhere shows."""
    x = recv_x.dequantize() if isinstance(recv_x, QTensor) else recv_x.float()
    y = (x * (1.0 + recv_ids.clamp_min(0).float().unsqueeze(-1) / 8.0)).bfloat16()
    if layout.masked_m is not None:
        unused = torch.arange(y.shape[1])[None, :] >= layout.masked_m[:, None]
        y[unused] = float("nan")
    return y


def _cat(xs):
    if isinstance(xs[0], QTensor):
        return QTensor(
            torch.cat([x.data for x in xs]), torch.cat([x.scale for x in xs]), xs[0].block, xs[0].scale_format
        )
    return torch.cat(xs)


def _reference_out(p: Problem, rank: int) -> torch.Tensor:
    """The one-process reference on the concatenated batch, rows of ``rank``'s tokens."""
    recv_x, recv_ids, _, layout, handle = ep_dispatch(
        _cat(p.xs), torch.cat(p.ids), torch.cat(p.weights), num_experts=p.num_experts
    )
    out = ep_combine(_expert(recv_x, recv_ids, layout), handle)
    start = sum(x.shape[0] for x in p.xs[:rank])
    return out[start : start + p.xs[rank].shape[0]]


def _run_and_check(p: Problem, rank: int, mode: str, *, placement=None, capacity=None, exact=None) -> None:
    """Dispatch, expert, combine (all collectives first), then the checks."""
    world = len(p.xs)
    kwargs = {"mode": mode, "capacity": capacity, "group": torch.distributed.group.WORLD}
    if placement is not None:
        kwargs["placement"] = placement
    out = ep_dispatch(p.xs[rank], p.ids[rank], p.weights[rank], num_experts=p.num_experts, **kwargs)
    combined = ep_combine(_expert(out[0], out[1], out[3]), out[4])
    placement = placement or ExpertPlacement.contiguous(p.num_experts, world)
    _check_layout(out, p, placement, rank, mode, capacity)
    assert out[4].overflow is None or not bool(out[4].overflow)
    ref = _reference_out(p, rank)
    assert combined.dtype == torch.bfloat16 and combined.shape == ref.shape
    if exact is None:
        exact = mode == "normal"
    if exact:
        assert torch.equal(combined, ref), f"max diff {(combined.float() - ref.float()).abs().max()}"
    else:  # low latency adds per-rank fp32 partial sums: fp32 reassociation, then one bf16 rounding
        torch.testing.assert_close(combined.float(), ref.float(), rtol=2**-7, atol=1e-5)
    zero = (p.ids[rank] < 0).all(dim=1)
    assert bool((combined[zero] == 0).all())


# ----------------------------------------------------------------------------------------------------------------
# Scenarios (run on every rank; the same calls in the same order everywhere)


def _tokens(g: torch.Generator, world: int, high: int, *, empty_rank: int | None = None) -> list[int]:
    t = torch.randint(1, high + 1, (world,), generator=g).tolist()
    if empty_rank is not None:
        t[empty_rank] = 0
    return t


def sc_normal_bf16_pipelined(rank: int, world: int) -> None:
    g = _gen("normal_bf16")
    p = _problem(g, _tokens(g, world, 40, empty_rank=world - 1 if world > 2 else None), 16, 4, 64)
    saved = ep_ref.TOKENS_PER_CHUNK
    ep_ref.TOKENS_PER_CHUNK = 4  # several pipelined chunks, some empty on the smaller ranks
    try:
        _run_and_check(p, rank, "normal")
    finally:
        ep_ref.TOKENS_PER_CHUNK = saved


def sc_normal_fp8(rank: int, world: int) -> None:
    g = _gen("normal_fp8")
    _run_and_check(_problem(g, _tokens(g, world, 30), 8 * world, 6, 256, fp8="ue8m0"), rank, "normal")


def sc_normal_one_rank_receives(rank: int, world: int) -> None:
    """Every pair goes to rank 0 (the others receive nothing; top-k repeats one destination rank), two of rank 0's
    experts get no token, the last rank sends nothing and one token has no expert at all."""
    g = _gen("normal_skew")
    num_experts = 4 * world
    p = _problem(g, _tokens(g, world, 24, empty_rank=world - 1), num_experts, 2, 128, experts=[0, 2], skip=0.2)
    p.ids[0][0] = -1
    _run_and_check(p, rank, "normal")


def _replica_placement(world: int, num_experts: int) -> ExpertPlacement:
    """Experts dealt round-robin in descending local order; experts 0 and 1 copied on every rank."""
    held = []
    for r in range(world):
        mine = [e for e in range(num_experts) if e % world == r]
        held.append(tuple(sorted(set(mine) | {0, 1}, reverse=True)))
    return ExpertPlacement(num_experts, tuple(held))


def sc_normal_replicas(rank: int, world: int) -> None:
    g = _gen("normal_replicas")
    num_experts = 4 * world
    p = _problem(g, _tokens(g, world, 20), num_experts, 3, 128, experts=[0, 1, 0, 1, 2, 3, num_experts - 1])
    _run_and_check(p, rank, "normal", placement=_replica_placement(world, num_experts))


def sc_normal_rank_without_experts(rank: int, world: int) -> None:
    g = _gen("normal_no_experts")
    num_experts = 3 * world
    placement = ExpertPlacement.from_expert_rank([e % (world - 1) for e in range(num_experts)], world)
    p = _problem(g, _tokens(g, world, 16), num_experts, 3, 128)
    _run_and_check(p, rank, "normal", placement=placement)


def sc_ll_bf16(rank: int, world: int) -> None:
    g = _gen("ll_bf16")
    p = _problem(g, _tokens(g, world, 12, empty_rank=1), 4 * world, 3, 64)
    _run_and_check(p, rank, "low_latency", capacity=14)


def sc_ll_fp8_replicas(rank: int, world: int) -> None:
    g = _gen("ll_fp8")
    num_experts = 4 * world
    p = _problem(g, _tokens(g, world, 9), num_experts, 4, 256, fp8="fp32", experts=[0, 1, 5, 0, 1, 6, 7])
    _run_and_check(p, rank, "low_latency", capacity=9, placement=_replica_placement(world, num_experts))


def sc_all_empty(rank: int, world: int) -> None:
    p = _problem(_gen("empty"), [0] * world, 2 * world, 2, 128)
    _run_and_check(p, rank, "normal")
    _run_and_check(p, rank, "low_latency", capacity=0)


def _overflow_problem(world: int) -> tuple[Problem, int]:
    """Rank 0 names expert 0 in every slot of every token: world * capacity rows fit, the rest overflow."""
    capacity, k = 5, world + 2
    g = _gen("overflow")
    p = _problem(g, [capacity] * world, 2 * world, k, 64, experts=list(range(1, 2 * world)), skip=0.0)
    p.ids[0][:] = 0
    return p, capacity


def sc_ll_overflow_raises(rank: int, world: int) -> None:
    p, capacity = _overflow_problem(world)
    with pytest.raises(InputError) as err:  # on every rank alike: no rank is left waiting
        ep_dispatch(p.xs[rank], p.ids[rank], p.weights[rank], num_experts=p.num_experts, mode="low_latency",
                    capacity=capacity, group=torch.distributed.group.WORLD)  # fmt: skip
    assert err.value.arg == "capacity"


def sc_ll_overflow_poisons(rank: int, world: int) -> None:
    p, capacity = _overflow_problem(world)
    os.environ["DEEPINFER_VALUE_CHECKS"] = "0"
    try:
        out = ep_dispatch(p.xs[rank], p.ids[rank], p.weights[rank], num_experts=p.num_experts, mode="low_latency",
                          capacity=capacity, group=torch.distributed.group.WORLD)  # fmt: skip
        combined = ep_combine(_expert(out[0], out[1], out[3]), out[4])
    finally:
        del os.environ["DEEPINFER_VALUE_CHECKS"]
    assert bool(out[4].overflow), "every rank must see the overflow"
    max_m = world * capacity
    kept = _expected_pairs(p, ExpertPlacement.contiguous(p.num_experts, world), 0)[0][:max_m]
    lost = (
        {t for t in range(capacity) for j in range(p.ids[0].shape[1]) if (0, t, j) not in kept} if rank == 0 else set()
    )
    assert rank != 0 or lost, "the problem must overflow"
    nan_rows = torch.isnan(combined).all(dim=1)
    assert set(torch.nonzero(nan_rows).flatten().tolist()) == lost
    if rank == 0:
        assert int(out[3].masked_m[0]) == max_m
    ref = _reference_out(p, rank)
    keep = ~nan_rows
    torch.testing.assert_close(combined[keep].float(), ref[keep].float(), rtol=2**-7, atol=1e-5)


def sc_bad_arguments(rank: int, world: int) -> None:
    """Errors every rank raises alike, before any exchange."""
    p = _problem(_gen("bad"), [4] * world, 2 * world, 2, 64)
    x, ids, w = p.xs[rank], p.ids[rank], p.weights[rank]
    grp = torch.distributed.group.WORLD
    cases = [
        ("capacity", {"mode": "low_latency"}),  # required with several ranks
        ("capacity", {"mode": "low_latency", "capacity": 3}),  # below T
        ("placement", {"placement": ExpertPlacement.contiguous(2 * world, world + 1)}),
        ("placement", {"placement": ExpertPlacement(2 * world, ((0,),) * world)}),  # experts nobody holds
        ("placement", {"placement": ExpertPlacement.contiguous(2 * world + 1, world)}),
    ]
    for arg, kw in cases:
        with pytest.raises(InputError) as err:
            ep_dispatch(x, ids, w, num_experts=2 * world, group=grp, **kw)
        assert err.value.arg == arg, (kw, err.value)


SCENARIOS = {
    f.__name__.removeprefix("sc_"): f
    for f in (
        sc_normal_bf16_pipelined,
        sc_normal_fp8,
        sc_normal_one_rank_receives,
        sc_normal_replicas,
        sc_normal_rank_without_experts,
        sc_ll_bf16,
        sc_ll_fp8_replicas,
        sc_all_empty,
        sc_ll_overflow_raises,
        sc_ll_overflow_poisons,
        sc_bad_arguments,
    )
}


def sc_dead_rank(rank: int, world: int) -> None:
    """The last rank exits without a word; the others dispatch."""
    if rank == world - 1:
        os._exit(3)
    p = _problem(_gen("dead"), [4] * world, 2 * world, 2, 64)
    ep_dispatch(p.xs[rank], p.ids[rank], p.weights[rank], num_experts=2 * world, group=torch.distributed.group.WORLD)


def sc_hung_rank(rank: int, world: int) -> None:
    """The last rank never reaches the collective; the others dispatch in low-latency mode."""
    if rank == world - 1:
        time.sleep(3600)
    p = _problem(_gen("hung"), [4] * world, 2 * world, 2, 64)
    ep_dispatch(p.xs[rank], p.ids[rank], p.weights[rank], num_experts=2 * world, mode="low_latency", capacity=4,
                group=torch.distributed.group.WORLD)  # fmt: skip


FAULTS = {"dead_rank": sc_dead_rank, "hung_rank": sc_hung_rank}


# ----------------------------------------------------------------------------------------------------------------
# Harness


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, seed: int, names: list[str], pg_timeout_s: float, results) -> None:
    global SEED
    SEED = seed  # the parent's: every rank draws the same problems
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=pg_timeout_s)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    deepinfer.use("reference")
    for name in names:
        start = time.monotonic()
        try:
            {**SCENARIOS, **FAULTS}[name](rank, world)
            results.put((rank, name, None, time.monotonic() - start))
        except BaseException:
            results.put((rank, name, traceback.format_exc(), time.monotonic() - start))
    dist.destroy_process_group()


def launch(world: int, names: list[str], *, pg_timeout_s: float, deadline_s: float, expect: set[int] | None = None):
    """Runs ``names`` on ``world`` spawned ranks; returns ``{(rank, name): (traceback or None, seconds)}`` for the
    ranks in ``expect`` (default all). Every rank still alive at the end (or at the deadline) is killed."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, SEED, names, pg_timeout_s, results), daemon=True)
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    expect = set(range(world)) if expect is None else expect
    wanted = len(expect) * len(names)
    got: dict[tuple[int, str], tuple[str | None, float]] = {}
    end = time.monotonic() + deadline_s
    try:
        while len(got) < wanted and time.monotonic() < end:
            try:
                rank, name, err, seconds = results.get(timeout=0.2)
            except queue.Empty:
                if all(not procs[r].is_alive() for r in expect):
                    break
                continue
            if rank in expect:
                got[(rank, name)] = (err, seconds)
    finally:
        for r, proc in enumerate(procs):
            proc.join(timeout=5 if len(got) == wanted and r in expect else 0.1)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    return got


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def world_run(request):
    world = request.param
    start = time.monotonic()
    got = launch(world, list(SCENARIOS), pg_timeout_s=RUN_TIMEOUT_S, deadline_s=RUN_DEADLINE_S)
    return world, got, time.monotonic() - start


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_scenario(world_run, scenario):
    world, got, _ = world_run
    for rank in range(world):
        if (rank, scenario) not in got:
            pytest.fail(f"rank {rank} never reported {scenario!r} (seed {SEED})")
        err, _ = got[(rank, scenario)]
        assert err is None, f"rank {rank} of {world}, seed {SEED}:\n{err}"


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_surfaces_within_timeout(fault):
    """A dead or hung rank makes the collective fail on the others within the group's timeout."""
    world, timeout_s = 2, 3.0
    start = time.monotonic()
    got = launch(world, [fault], pg_timeout_s=timeout_s, deadline_s=timeout_s + 40, expect={0})
    assert (0, fault) in got, f"rank 0 neither finished nor failed within {time.monotonic() - start:.0f} s"
    err, seconds = got[(0, fault)]
    assert err is not None, "the collective succeeded without its peer"
    assert "InputError" not in err, err
    assert seconds < timeout_s + 10, f"the error took {seconds:.1f} s"
    if fault == "hung_rank":  # nothing else failed first: it was the timeout
        assert seconds > 0.8 * timeout_s, err


# ----------------------------------------------------------------------------------------------------------------
# One process: the placement record and its validation


def test_placement_record():
    p = ExpertPlacement.contiguous(10, 4)
    assert p.local_experts == ((0, 1), (2, 3, 4), (5, 6), (7, 8, 9)) and p.world_size == 4 and p.problem() is None
    q = ExpertPlacement.from_expert_rank([1, 0, 1, 1], 3)
    assert q.local_experts == ((1,), (0, 2, 3), ()) and q.expert_ranks == ((1,), (0,), (1,), (1,))
    r = ExpertPlacement(4, [[3, 0], [0, 1, 2]])
    assert r.local_experts == ((3, 0), (0, 1, 2)) and r.expert_ranks[0] == (0, 1)
    assert [r.route(0, 0, t) for t in range(3)] == [(0, 1), (1, 0), (0, 1)]
    assert [r.route(0, 1, t) for t in range(2)] == [(1, 0), (0, 1)]
    assert "twice" in ExpertPlacement(2, ((0, 0), (1,))).problem()
    assert "outside" in ExpertPlacement(2, ((0, 2), (1,))).problem()
    assert "held by no rank" in ExpertPlacement(3, ((0,), (1,))).problem()


def test_one_process_placement_reorders_experts():
    """World size 1 with a permuted local order: layout by local index, global ids reported, same combine."""
    g = _gen("one_process")
    p = _problem(g, [23], 8, 3, 128)
    placement = ExpertPlacement(8, ((5, 2, 7, 0, 1, 3, 6, 4),))
    for mode in ("normal", "low_latency"):
        out = ep_dispatch(p.xs[0], p.ids[0], p.weights[0], num_experts=8, mode=mode, placement=placement)
        _check_layout(out, p, placement, 0, mode, 23 if mode == "low_latency" else None)
        combined = ep_combine(_expert(out[0], out[1], out[3]), out[4])
        assert torch.equal(combined, _reference_out(p, 0))


def test_one_process_overflow_poisons_without_value_checks(monkeypatch):
    monkeypatch.setenv("DEEPINFER_VALUE_CHECKS", "0")
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [3, -1]], dtype=torch.int32)
    x, w = torch.randn(4, 64).bfloat16(), torch.rand(4, 2)
    out = ep_dispatch(x, ids, w, num_experts=4, mode="low_latency", capacity=2)
    assert bool(out[4].overflow) and out[3].masked_m.tolist() == [2, 2, 1, 1]
    combined = ep_combine(_expert(out[0], out[1], out[3]), out[4])
    assert torch.isnan(combined).all(dim=1).tolist() == [False, False, True, False]
    monkeypatch.setenv("DEEPINFER_VALUE_CHECKS", "1")
    with pytest.raises(InputError) as err:
        ep_dispatch(x, ids, w, num_experts=4, mode="low_latency", capacity=2)
    assert err.value.arg == "capacity"


def test_one_process_placement_errors():
    x, ids, w = torch.randn(2, 64).bfloat16(), torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1)
    for bad in (ExpertPlacement.contiguous(4, 2), ExpertPlacement(4, ((0, 1, 2),)), "contiguous"):
        with pytest.raises(InputError) as err:
            ep_dispatch(x, ids, w, num_experts=4, placement=bad)
        assert err.value.arg == "placement"
