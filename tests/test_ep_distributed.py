"""``ep_dispatch`` / ``ep_combine`` across the ranks of real multi-process Gloo groups (2 and 4 ranks, CPU).

Each run spawns the ranks once and plays every scenario in them; each scenario is then reported as its own test.
Every rank draws the whole problem (all ranks' tokens and routings) from one shared fresh seed, so each checks its
own received layout against an independent pair-by-pair construction, and its combined output against the
one-process reference on the concatenated batch. Dead and hung ranks must surface as errors within the process
group's timeout, and arguments that differ between ranks as the same ``InputError`` on every rank at once; the
harness kills whatever is left, so a bug can fail these tests but never hang the run.
"""

from __future__ import annotations

import os
import random
import time
import zlib

import pytest
import torch
from ep_harness import (
    Problem,
    check_layout,
    expected_pairs,
    expert,
    fitting_capacity,
    launch,
    overflow_problem,
    random_problem,
    reference_out,
    token_counts,
)

import deepinfer
from deepinfer import InputError
from deepinfer.ops import ep_combine, ep_dispatch
from deepinfer.ops.moe import ExpertPlacement
from deepinfer.reference import ep as ep_ref

SEED = random.randrange(2**31)
RUN_TIMEOUT_S = 30.0  # process-group timeout while the scenarios run: a desynchronised bug fails, never hangs
RUN_DEADLINE_S = 150.0  # the harness kills every rank after this long


# ----------------------------------------------------------------------------------------------------------------
# Problems and the independent expected layout


def setup_rank() -> None:
    deepinfer.use("reference")


def _gen(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(SEED + zlib.crc32(name.encode()))


def _run_and_check(p: Problem, rank: int, mode: str, *, placement=None, capacity=None, exact=None) -> None:
    """Dispatch, expert, combine (all collectives first), then the checks."""
    world = len(p.xs)
    kwargs = {"mode": mode, "capacity": capacity, "group": torch.distributed.group.WORLD}
    if placement is not None:
        kwargs["placement"] = placement
    out = ep_dispatch(p.xs[rank], p.ids[rank], p.weights[rank], num_experts=p.num_experts, **kwargs)
    y = expert(out[0], out[1], out[3])
    combined = ep_combine(y, out[4])
    placement = placement or ExpertPlacement.contiguous(p.num_experts, world)
    check_layout(out, p, placement, rank, mode, capacity)
    assert out[4].overflow is None or not bool(out[4].overflow)
    ref = reference_out(p, rank)
    assert combined.dtype == torch.bfloat16 and combined.shape == ref.shape
    if exact is None:
        exact = mode == "normal" and not ep_ref.sums_per_rank(y, out[4])
    if exact:
        assert torch.equal(combined, ref), f"max diff {(combined.float() - ref.float()).abs().max()}"
    else:  # per-rank fp32 partial sums: fp32 reassociation, then one bf16 rounding
        torch.testing.assert_close(combined.float(), ref.float(), rtol=2**-7, atol=1e-5)
    zero = (p.ids[rank] < 0).all(dim=1)
    assert bool((combined[zero] == 0).all())
    if mode == "normal":  # fp32 outputs always take the per-rank partial sums: within fp32 reassociation
        y32 = expert(out[0], out[1], out[3], torch.float32)
        assert ep_ref.sums_per_rank(y32, out[4])
        torch.testing.assert_close(ep_combine(y32, out[4]), reference_out(p, rank, torch.float32), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# Scenarios (run on every rank; the same calls in the same order everywhere)


def sc_normal_bf16(rank: int, world: int) -> None:
    g = _gen("normal_bf16")
    p = random_problem(g, token_counts(g, world, 40, empty_rank=world - 1 if world > 2 else None), 16, 4, 64)
    _run_and_check(p, rank, "normal")


def sc_normal_fp8(rank: int, world: int) -> None:
    g = _gen("normal_fp8")
    _run_and_check(random_problem(g, token_counts(g, world, 30), 8 * world, 6, 256, fp8="ue8m0"), rank, "normal")


def sc_normal_one_rank_receives(rank: int, world: int) -> None:
    """Every pair goes to rank 0 (the others receive nothing; top-k repeats one destination rank), two of rank 0's
    experts get no token, the last rank sends nothing and one token has no expert at all."""
    g = _gen("normal_skew")
    num_experts = 4 * world
    p = random_problem(
        g, token_counts(g, world, 24, empty_rank=world - 1), num_experts, 2, 128, experts=[0, 2], skip=0.2
    )
    p.ids[0][0] = -1
    _run_and_check(p, rank, "normal")


def sc_normal_sums_per_rank(rank: int, world: int) -> None:
    """Top-8 (repeated and skipped slots, a rank without tokens): the combine adds per-rank fp32 partial sums, for
    bf16 and fp32 expert outputs, except in batch-invariant mode, where it keeps one process's arithmetic bit for
    bit. fp32 outputs show any misplaced or missing partial sum far above fp32 reassociation."""
    g = _gen("normal_sums")
    p = random_problem(g, token_counts(g, world, 24, empty_rank=world - 1), 16, 8, 64, repeat=0.2)
    grp = torch.distributed.group.WORLD
    out = ep_dispatch(p.xs[rank], p.ids[rank], p.weights[rank], num_experts=p.num_experts, group=grp)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2**-7)):
        y = expert(out[0], out[1], out[3], dtype)
        ref = reference_out(p, rank, dtype)
        assert ep_ref.sums_per_rank(y, out[4]), dtype
        torch.testing.assert_close(ep_combine(y, out[4]), ref, rtol=tol, atol=1e-5)
        with deepinfer.batch_invariant():
            assert not ep_ref.sums_per_rank(y, out[4])
            assert torch.equal(ep_combine(y, out[4]), ref), dtype


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
    p = random_problem(g, token_counts(g, world, 20), num_experts, 3, 128, experts=[0, 1, 0, 1, 2, 3, num_experts - 1])
    _run_and_check(p, rank, "normal", placement=_replica_placement(world, num_experts))


def sc_normal_rank_without_experts(rank: int, world: int) -> None:
    g = _gen("normal_no_experts")
    num_experts = 3 * world
    placement = ExpertPlacement.from_expert_rank([e % (world - 1) for e in range(num_experts)], world)
    p = random_problem(g, token_counts(g, world, 16), num_experts, 3, 128)
    _run_and_check(p, rank, "normal", placement=placement)


def sc_row_widths(rank: int, world: int) -> None:
    """Rows whose parts are a whole number of 4-byte words (bf16 x 66; FP8 x 128 with one fp32 scale) or only of
    bytes (bf16 x 65), in both modes."""
    g = _gen("row_widths")
    for hidden, fp8 in ((66, None), (65, None), (128, "fp32")):
        p = random_problem(g, token_counts(g, world, 12), 4 * world, 3, hidden, fp8=fp8)
        _run_and_check(p, rank, "normal")
        _run_and_check(p, rank, "low_latency", capacity=12)


def sc_single_copy(rank: int, world: int) -> None:
    """Each rank's one token goes to the next rank's experts only, so every rank receives exactly one copy. Its rows
    of bf16 x 65 (130 bytes) put the copy's routing record at a byte offset that is not a multiple of 4."""
    num_experts = 2 * world
    p = random_problem(_gen("single_copy"), [1] * world, num_experts, 2, 65, skip=0.0)
    for r in range(world):
        nxt = (r + 1) % world
        p.ids[r][0] = torch.tensor([2 * nxt, 2 * nxt + 1], dtype=torch.int32)
    _run_and_check(p, rank, "normal")


def sc_ll_bf16(rank: int, world: int) -> None:
    g = _gen("ll_bf16")
    p = random_problem(g, token_counts(g, world, 12, empty_rank=1), 4 * world, 3, 64)
    _run_and_check(p, rank, "low_latency", capacity=14)


def sc_ll_fp8_replicas(rank: int, world: int) -> None:
    g = _gen("ll_fp8")
    num_experts = 4 * world
    p = random_problem(g, token_counts(g, world, 9), num_experts, 4, 256, fp8="fp32", experts=[0, 1, 5, 0, 1, 6, 7])
    placement = _replica_placement(world, num_experts)
    _run_and_check(p, rank, "low_latency", capacity=fitting_capacity(p, placement, 9), placement=placement)


def sc_ll_batch_invariant(rank: int, world: int) -> None:
    """Top-8 over replicated experts (repeated and skipped slots, a rank without tokens) in low-latency mode: in
    batch-invariant mode the combine gives one process's bits, for bf16 and fp32 expert outputs, as the normal mode
    does (a decode step replayed from a CUDA graph dispatches this way); outside it, per-rank partial sums."""
    g = _gen("ll_invariant")
    num_experts = 4 * world
    p = random_problem(g, token_counts(g, world, 12, empty_rank=world - 1), num_experts, 8, 64, repeat=0.2)
    placement = _replica_placement(world, num_experts)
    capacity = fitting_capacity(p, placement, 12)
    grp = torch.distributed.group.WORLD
    got = []  # every collective first, then the checks: a failing rank leaves none waiting
    for invariant in (True, False):
        with deepinfer.batch_invariant(invariant):
            out = ep_dispatch(p.xs[rank], p.ids[rank], p.weights[rank], num_experts=num_experts, group=grp,
                              mode="low_latency", capacity=capacity, placement=placement)  # fmt: skip
            for dtype in (torch.float32, torch.bfloat16):
                got.append((invariant, dtype, out, ep_combine(expert(out[0], out[1], out[3], dtype), out[4])))
    for invariant, dtype, out, combined in got:
        check_layout(out, p, placement, rank, "low_latency", capacity)
        ref = reference_out(p, rank, dtype)
        assert combined.dtype == dtype and combined.shape == ref.shape
        if invariant:
            assert torch.equal(combined, ref), (dtype, (combined.float() - ref.float()).abs().max())
        else:
            tol = 1e-5 if dtype == torch.float32 else 2**-7
            torch.testing.assert_close(combined, ref, rtol=tol, atol=1e-5)


def sc_ll_overflow_poisons_batch_invariant(rank: int, world: int) -> None:
    with deepinfer.batch_invariant():
        sc_ll_overflow_poisons(rank, world)


def sc_all_empty(rank: int, world: int) -> None:
    p = random_problem(_gen("empty"), [0] * world, 2 * world, 2, 128)
    _run_and_check(p, rank, "normal")
    _run_and_check(p, rank, "low_latency", capacity=0)


def sc_ll_overflow_raises(rank: int, world: int) -> None:
    p, capacity = overflow_problem(_gen("overflow"), world, 64)
    with pytest.raises(InputError) as err:  # on every rank alike: no rank is left waiting
        ep_dispatch(p.xs[rank], p.ids[rank], p.weights[rank], num_experts=p.num_experts, mode="low_latency",
                    capacity=capacity, group=torch.distributed.group.WORLD)  # fmt: skip
    assert err.value.arg == "capacity"


def sc_ll_overflow_poisons(rank: int, world: int) -> None:
    p, capacity = overflow_problem(_gen("overflow"), world, 64)
    os.environ["DEEPINFER_VALUE_CHECKS"] = "0"
    try:
        out = ep_dispatch(p.xs[rank], p.ids[rank], p.weights[rank], num_experts=p.num_experts, mode="low_latency",
                          capacity=capacity, group=torch.distributed.group.WORLD)  # fmt: skip
        combined = ep_combine(expert(out[0], out[1], out[3]), out[4])
    finally:
        del os.environ["DEEPINFER_VALUE_CHECKS"]
    assert bool(out[4].overflow), "every rank must see the overflow"
    max_m = world * capacity
    kept = expected_pairs(p, ExpertPlacement.contiguous(p.num_experts, world), 0)[0][:max_m]
    lost = (
        {t for t in range(capacity) for j in range(p.ids[0].shape[1]) if (0, t, j) not in kept} if rank == 0 else set()
    )
    assert rank != 0 or lost, "the problem must overflow"
    nan_rows = torch.isnan(combined).all(dim=1)
    assert set(torch.nonzero(nan_rows).flatten().tolist()) == lost
    if rank == 0:
        assert int(out[3].masked_m[0]) == max_m
    ref = reference_out(p, rank)
    keep = ~nan_rows
    torch.testing.assert_close(combined[keep].float(), ref[keep].float(), rtol=2**-7, atol=1e-5)


def sc_bad_arguments(rank: int, world: int) -> None:
    """Errors every rank raises alike, before any exchange."""
    p = random_problem(_gen("bad"), [4] * world, 2 * world, 2, 64)
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
        sc_normal_bf16,
        sc_normal_fp8,
        sc_normal_one_rank_receives,
        sc_normal_sums_per_rank,
        sc_normal_replicas,
        sc_normal_rank_without_experts,
        sc_row_widths,
        sc_single_copy,
        sc_ll_bf16,
        sc_ll_fp8_replicas,
        sc_ll_batch_invariant,
        sc_all_empty,
        sc_ll_overflow_raises,
        sc_ll_overflow_poisons,
        sc_ll_overflow_poisons_batch_invariant,
        sc_bad_arguments,
    )
}


def sc_dead_rank(rank: int, world: int) -> None:
    """The last rank exits without a word; the others dispatch."""
    if rank == world - 1:
        os._exit(3)
    p = random_problem(_gen("dead"), [4] * world, 2 * world, 2, 64)
    ep_dispatch(p.xs[rank], p.ids[rank], p.weights[rank], num_experts=2 * world, group=torch.distributed.group.WORLD)


def sc_hung_rank(rank: int, world: int) -> None:
    """The last rank never reaches the collective; the others dispatch in low-latency mode."""
    if rank == world - 1:
        time.sleep(3600)
    p = random_problem(_gen("hung"), [4] * world, 2 * world, 2, 64)
    ep_dispatch(p.xs[rank], p.ids[rank], p.weights[rank], num_experts=2 * world, mode="low_latency", capacity=4,
                group=torch.distributed.group.WORLD)  # fmt: skip


FAULTS = {"dead_rank": sc_dead_rank, "hung_rank": sc_hung_rank}


def _mismatch(rank: int, world: int, arg: str, ours: dict, theirs: dict, shown: tuple[str, str]) -> str:
    """Every rank dispatches a fresh random problem over a new group (its first use: nothing agreed yet) with the
    keyword arguments ``ours``, the last rank with ``theirs`` instead; every rank must raise ``InputError`` about
    ``arg`` showing both values (``shown``: how the message spells ours and theirs). Returns the message."""
    grp = torch.distributed.new_group(list(range(world)))
    mine = theirs if rank == world - 1 else ours
    hidden, k, dtype, num_experts = mine.get("hidden", 64), mine.get("k", 2), mine.get("dtype"), mine["num_experts"]
    p = random_problem(_gen(f"mismatch {arg}"), [4] * world, num_experts, k, hidden)
    x = p.xs[rank] if dtype is None else p.xs[rank].to(dtype)
    kw = {key: v for key, v in mine.items() if key not in ("hidden", "k", "dtype")}
    with pytest.raises(InputError) as err:
        ep_dispatch(x, p.ids[rank], p.weights[rank], group=grp, **kw)
    message = str(err.value)
    assert err.value.arg == arg, message
    assert f"{shown[0]} on rank" in message and f"{shown[1]} on rank {world - 1}" in message, message
    assert "every rank of the group" in err.value.expected, message
    return message


def sc_mismatch_placement(rank: int, world: int) -> str:
    """Both placements are valid on their own: without the check the sums come out wrong on every rank, silently."""
    ours = ExpertPlacement.contiguous(2 * world, world)
    theirs = ExpertPlacement(2 * world, ours.local_experts[::-1])
    n = 2 * world
    return _mismatch(rank, world, "placement", {"num_experts": n, "placement": ours},
                     {"num_experts": n, "placement": theirs}, (repr(ours), repr(theirs)))  # fmt: skip


def sc_mismatch_num_experts(rank: int, world: int) -> str:
    n = 2 * world
    return _mismatch(rank, world, "num_experts", {"num_experts": n}, {"num_experts": n + 2}, (str(n), str(n + 2)))


def sc_mismatch_hidden(rank: int, world: int) -> str:
    n = 2 * world
    return _mismatch(rank, world, "x", {"num_experts": n}, {"num_experts": n, "hidden": 128}, ("64", "128"))


def sc_mismatch_dtype(rank: int, world: int) -> str:
    n = 2 * world
    theirs = {"num_experts": n, "dtype": torch.float32}
    return _mismatch(rank, world, "x", {"num_experts": n}, theirs, ("'torch.bfloat16'", "'torch.float32'"))


def sc_mismatch_capacity(rank: int, world: int) -> str:
    ours = {"num_experts": 2 * world, "mode": "low_latency", "capacity": 4}
    return _mismatch(rank, world, "capacity", ours, ours | {"capacity": 6}, ("4", "6"))


def sc_mismatch_mode(rank: int, world: int) -> str:
    ours = {"num_experts": 2 * world}
    theirs = ours | {"mode": "low_latency", "capacity": 4}
    return _mismatch(rank, world, "mode", ours, theirs, ("'normal'", "'low_latency'"))


def sc_mismatch_top_k(rank: int, world: int) -> str:
    n = 2 * world
    return _mismatch(rank, world, "ids", {"num_experts": n}, {"num_experts": n, "k": 3}, ("2", "3"))


def sc_agreeing_after_mismatches(rank: int, world: int) -> None:
    """After the mismatches, each raised on every rank, the group still works."""
    _run_and_check(random_problem(_gen("after mismatches"), [5] * world, 2 * world, 2, 64), rank, "normal")


MISMATCHES = {
    f.__name__.removeprefix("sc_"): f
    for f in (
        sc_mismatch_placement,
        sc_mismatch_num_experts,
        sc_mismatch_hidden,
        sc_mismatch_dtype,
        sc_mismatch_capacity,
        sc_mismatch_mode,
        sc_mismatch_top_k,
        sc_agreeing_after_mismatches,
    )
}


# ----------------------------------------------------------------------------------------------------------------
# Harness


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def world_run(request):
    world = request.param
    start = time.monotonic()
    got = launch(__name__, world, list(SCENARIOS), seed=SEED, pg_timeout_s=RUN_TIMEOUT_S, deadline_s=RUN_DEADLINE_S)
    return world, got, time.monotonic() - start


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_scenario(world_run, scenario):
    world, got, _ = world_run
    for rank in range(world):
        if (rank, scenario) not in got:
            pytest.fail(f"rank {rank} never reported {scenario!r} (seed {SEED})")
        err, _, _ = got[(rank, scenario)]
        assert err is None, f"rank {rank} of {world}, seed {SEED}:\n{err}"


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_surfaces_within_timeout(fault):
    """A dead or hung rank makes the collective fail on the others within the group's timeout."""
    world, timeout_s = 2, 3.0
    start = time.monotonic()
    got = launch(__name__, world, [fault], seed=SEED, pg_timeout_s=timeout_s, deadline_s=timeout_s + 40, expect={0})
    assert (0, fault) in got, f"rank 0 neither finished nor failed within {time.monotonic() - start:.0f} s"
    err, _, seconds = got[(0, fault)]
    assert err is not None, "the collective succeeded without its peer"
    assert "InputError" not in err, err
    assert seconds < timeout_s + 10, f"the error took {seconds:.1f} s"
    if fault == "hung_rank":  # nothing else failed first: it was the timeout
        assert seconds > 0.8 * timeout_s, err


@pytest.mark.parametrize("world", [2, 4])
def test_mismatched_arguments_raise_on_every_rank(world):
    """Ranks that pass different placements, expert counts, hidden sizes, dtypes, capacities, modes or top-k: every
    rank raises ``InputError`` naming the argument and each rank's value, at once (well within the group's timeout),
    instead of silently wrong sums on every rank or an abort of one."""
    timeout_s = 20.0
    got = launch(__name__, world, list(MISMATCHES), seed=SEED, pg_timeout_s=timeout_s, deadline_s=120.0)
    for name in MISMATCHES:
        for rank in range(world):
            assert (rank, name) in got, f"rank {rank} never reported {name!r} (seed {SEED}): it died or hung"
            err, _, seconds = got[(rank, name)]
            assert err is None, f"{name}, rank {rank} of {world}, seed {SEED}:\n{err}"
            assert seconds < timeout_s / 2, f"{name} took {seconds:.1f} s on rank {rank}"
        if name != "agreeing_after_mismatches":
            assert len({got[(r, name)][1] for r in range(world)}) == 1, f"{name}: the ranks' messages differ"


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
    p = random_problem(g, [23], 8, 3, 128)
    placement = ExpertPlacement(8, ((5, 2, 7, 0, 1, 3, 6, 4),))
    for mode in ("normal", "low_latency"):
        out = ep_dispatch(p.xs[0], p.ids[0], p.weights[0], num_experts=8, mode=mode, placement=placement)
        check_layout(out, p, placement, 0, mode, 23 if mode == "low_latency" else None)
        combined = ep_combine(expert(out[0], out[1], out[3]), out[4])
        assert torch.equal(combined, reference_out(p, 0))


def test_one_process_overflow_poisons_without_value_checks(monkeypatch):
    monkeypatch.setenv("DEEPINFER_VALUE_CHECKS", "0")
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [3, -1]], dtype=torch.int32)
    x, w = torch.randn(4, 64).bfloat16(), torch.rand(4, 2)
    out = ep_dispatch(x, ids, w, num_experts=4, mode="low_latency", capacity=2)
    assert bool(out[4].overflow) and out[3].masked_m.tolist() == [2, 2, 1, 1]
    combined = ep_combine(expert(out[0], out[1], out[3]), out[4])
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
