"""Multi-rank ``ep_dispatch`` / ``ep_combine`` on the ascend backend through MC2 (``npu_moe_distribute_dispatch_v2``
/ ``combine_v2``), EMULATED: torch_npu is the test double in tests/ascend/double, whose MC2 operators exchange data
between real processes over Gloo on the CPU. Nothing here runs on an NPU or over HCCL.

Each run spawns the ranks once and plays every scenario in them; each scenario is reported as its own test. Every
rank draws the whole problem from one shared fresh seed, checks its received layout byte for byte against an
independent pair-by-pair construction, and its combined output against the one-process reference on the concatenated
batch. The double shuffles rows within a local expert (their order is undocumented), so a backend that relied on
the operator's order fails here. A dead or hung peer surfaces as the process group's timeout, and the harness kills
whatever is left, so a bug fails these tests but never hangs the run.
"""

from __future__ import annotations

import os
import random
import sys
import zlib
from pathlib import Path

import pytest
import torch
from ep_harness import (
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
from deepinfer import InputError, registry
from deepinfer.dispatch import last_resolution
from deepinfer.ops import ep_combine, ep_dispatch
from deepinfer.ops.moe import ExpertPlacement

DOUBLE = Path(__file__).parent / "ascend" / "double"
SEED = random.randrange(2**31)
RUN_TIMEOUT_S = 30.0  # process-group timeout while the scenarios run
RUN_DEADLINE_S = 120.0  # the harness kills every rank after this long
MC2_DISPATCH = "torch_npu.npu_moe_distribute_dispatch_v2"
MC2_COMBINE = "torch_npu.npu_moe_distribute_combine_v2"


# ----------------------------------------------------------------------------------------------------------------
# Problems and the independent expected layout


def setup_rank() -> None:
    """The torch_npu test double in place of torch_npu, the ascend backend selected, no NPU settings inherited."""
    for key in (
        "DEEPINFER_ASCEND_SOC",
        "DEEPINFER_ASCEND_MC2_MAX_BS",
        "HCCL_BUFFSIZE",
        "DEEPINFER_TORCH_NPU_DOUBLE_SOC",
    ):
        os.environ.pop(key, None)
    sys.path.insert(0, str(DOUBLE))
    import torch_npu

    assert torch_npu.TEST_DOUBLE
    registry.reload()
    deepinfer.use("ascend")


def _gen(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(SEED + zlib.crc32(name.encode()))


def _provider(op: str) -> str:
    impl, fallback = last_resolution(op)
    return "reference (fallback)" if fallback else impl.provider


def _run_and_check(p, rank, mode, *, capacity=None, placement=None, y_dtype=torch.bfloat16, via=None) -> None:
    """Dispatch, expert, combine (all collectives first), then the checks. ``via``: the (dispatch, combine)
    providers that must have served the calls."""
    world = len(p.xs)
    kwargs = {"mode": mode, "capacity": capacity, "group": torch.distributed.group.WORLD}
    if placement is not None:
        kwargs["placement"] = placement
    out = ep_dispatch(p.xs[rank], p.ids[rank], p.weights[rank], num_experts=p.num_experts, **kwargs)
    served = [_provider("ep_dispatch")]
    combined = ep_combine(expert(out[0], out[1], out[3], y_dtype), out[4])
    served.append(_provider("ep_combine"))
    if via is not None:
        assert tuple(served) == via, served
    check_layout(out, p, ExpertPlacement.contiguous(p.num_experts, world), rank, mode, capacity)
    assert out[4].overflow is None or not bool(out[4].overflow)
    ref = reference_out(p, rank, y_dtype)
    assert combined.dtype == y_dtype and combined.shape == ref.shape
    if served[1] == MC2_COMBINE:  # another summation path: one rounding of the output apart at most
        torch.testing.assert_close(combined.float(), ref.float(), rtol=2**-7, atol=1e-5)
    else:  # the reference combine on the MC2 handle: the reference's arithmetic
        torch.testing.assert_close(combined.float(), ref.float(), rtol=0 if mode == "normal" else 2**-7, atol=1e-5)
    zero = (p.ids[rank] < 0).all(dim=1)
    assert bool((combined[zero] == 0).all())


class _env:
    """Sets environment variables for one scenario."""

    def __init__(self, **values: str) -> None:
        self.values, self.saved = values, {}

    def __enter__(self):
        for key, value in self.values.items():
            self.saved[key] = os.environ.get(key)
            os.environ[key] = value

    def __exit__(self, *exc):
        for key, value in self.saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


MC2 = (MC2_DISPATCH, MC2_COMBINE)


# ----------------------------------------------------------------------------------------------------------------
# Scenarios (run on every rank; the same calls in the same order everywhere)


def sc_normal_bf16(rank: int, world: int) -> None:
    """Uneven batches, one rank sends nothing (it still joins every MC2 call with a padding token), -1 pairs."""
    g = _gen("normal_bf16")
    p = random_problem(g, token_counts(g, world, 30, empty_rank=world - 1), 4 * world, 4, 1024)
    _run_and_check(p, rank, "normal", via=MC2)


def sc_normal_rounds_narrow(rank: int, world: int) -> None:
    """At most 4 tokens per MC2 call: several rounds; a narrow hidden size is padded to the documented 1024."""
    g = _gen("normal_rounds")
    with _env(DEEPINFER_ASCEND_MC2_MAX_BS="4"):
        p = random_problem(g, token_counts(g, world, 15), 2 * world, 3, 192)
        _run_and_check(p, rank, "normal", via=MC2)


def sc_normal_fp8(rank: int, world: int) -> None:
    g = _gen("normal_fp8")
    p = random_problem(g, token_counts(g, world, 20), 4 * world, 6, 512, fp8="ue8m0")
    _run_and_check(p, rank, "normal", via=MC2)


def sc_normal_skewed_repeats(rank: int, world: int) -> None:
    """Every pair goes to rank 0 (the others receive nothing), two of its experts get no token, tokens name an
    expert twice, one token has no expert at all."""
    g = _gen("normal_skew")
    num_experts = 4 * world
    p = random_problem(g, token_counts(g, world, 16), num_experts, 3, 256, experts=[0, 2, 3], skip=0.2, repeat=0.3)
    p.ids[0][0] = -1
    _run_and_check(p, rank, "normal", via=MC2)


def sc_normal_fp32_outputs_fall_back(rank: int, world: int) -> None:
    """combine_v2 takes bf16/fp16 only: fp32 expert outputs go through the reference combine on the MC2 handle."""
    g = _gen("normal_fp32")
    p = random_problem(g, token_counts(g, world, 12), 2 * world, 2, 128, repeat=0.2)
    _run_and_check(p, rank, "normal", y_dtype=torch.float32, via=(MC2_DISPATCH, "reference (fallback)"))


def sc_normal_many_experts(rank: int, world: int) -> None:
    """More than 512 experts: both MC2 operators take up to 1024 (A3)."""
    g = _gen("normal_many")
    with _env(DEEPINFER_ASCEND_MC2_MAX_BS="4"):
        p = random_problem(g, token_counts(g, world, 6), 320 * world, 2, 128)
        _run_and_check(p, rank, "normal", via=MC2)


def sc_ll_bf16(rank: int, world: int) -> None:
    g = _gen("ll_bf16")
    with _env(DEEPINFER_ASCEND_MC2_MAX_BS="8"):
        p = random_problem(g, token_counts(g, world, 12, empty_rank=1), 4 * world, 3, 1024)
        _run_and_check(p, rank, "low_latency", capacity=14, via=MC2)


def sc_ll_fp8_repeats(rank: int, world: int) -> None:
    g = _gen("ll_fp8")
    p = random_problem(g, token_counts(g, world, 9), 2 * world, 4, 256, fp8="fp32", repeat=0.2)
    capacity = fitting_capacity(p, ExpertPlacement.contiguous(p.num_experts, world), 9)
    _run_and_check(p, rank, "low_latency", capacity=capacity, via=MC2)


def sc_ll_wide_combine(rank: int, world: int) -> None:
    """A hidden size above 7168: combine_v2 takes H up to 8192 on A3, as dispatch_v2 does."""
    g = _gen("ll_wide")
    p = random_problem(g, token_counts(g, world, 3), 2 * world, 2, 7296, repeat=0.3)
    capacity = fitting_capacity(p, ExpertPlacement.contiguous(p.num_experts, world), 3)
    _run_and_check(p, rank, "low_latency", capacity=capacity, via=MC2)


def sc_all_empty(rank: int, world: int) -> None:
    p = random_problem(_gen("empty"), [0] * world, 2 * world, 2, 128)
    _run_and_check(p, rank, "normal", via=MC2)
    _run_and_check(p, rank, "low_latency", capacity=0, via=MC2)


def sc_declined_placement_runs_reference(rank: int, world: int) -> None:
    """A non-contiguous placement is declined on every rank alike: the reference collectives run."""
    g = _gen("declined")
    num_experts = 2 * world
    placement = ExpertPlacement.from_expert_rank([(e + 1) % world for e in range(num_experts)], world)
    p = random_problem(g, token_counts(g, world, 10), num_experts, 2, 128)
    out = ep_dispatch(p.xs[rank], p.ids[rank], p.weights[rank], num_experts=num_experts,
                      group=torch.distributed.group.WORLD, placement=placement)  # fmt: skip
    assert _provider("ep_dispatch") == "reference (fallback)"
    combined = ep_combine(expert(out[0], out[1], out[3]), out[4])
    assert torch.equal(combined, reference_out(p, rank))


def sc_declined_small_buffer_runs_reference(rank: int, world: int) -> None:
    """An HCCL buffer below the docs' formula is declined (the setting is the same on every rank)."""
    g = _gen("small_buffer")
    with _env(HCCL_BUFFSIZE="0"):
        p = random_problem(g, token_counts(g, world, 6), 2 * world, 2, 128)
        _run_and_check(p, rank, "normal", via=("reference (fallback)", "reference (fallback)"))


def sc_ll_overflow_raises(rank: int, world: int) -> None:
    p, capacity = overflow_problem(_gen("overflow"), world, 128)
    with pytest.raises(InputError) as err:  # on every rank alike: the overflow flag is reduced over the group
        ep_dispatch(p.xs[rank], p.ids[rank], p.weights[rank], num_experts=p.num_experts, mode="low_latency",
                    capacity=capacity, group=torch.distributed.group.WORLD)  # fmt: skip
    assert err.value.arg == "capacity"
    assert _provider("ep_dispatch") == MC2_DISPATCH


def sc_ll_overflow_poisons(rank: int, world: int) -> None:
    p, capacity = overflow_problem(_gen("overflow"), world, 128)
    with _env(DEEPINFER_VALUE_CHECKS="0"):
        out = ep_dispatch(p.xs[rank], p.ids[rank], p.weights[rank], num_experts=p.num_experts, mode="low_latency",
                          capacity=capacity, group=torch.distributed.group.WORLD)  # fmt: skip
        combined = ep_combine(expert(out[0], out[1], out[3]), out[4])
    assert _provider("ep_combine") == MC2_COMBINE
    assert bool(out[4].overflow), "every rank must see the overflow"
    max_m = world * capacity
    kept = expected_pairs(p, ExpertPlacement.contiguous(p.num_experts, world), 0)[0][:max_m]
    k = p.ids[0].shape[1]
    lost = {t for t in range(capacity) for j in range(k) if (0, t, j) not in kept} if rank == 0 else set()
    assert rank != 0 or lost, "the problem must overflow"
    nan_rows = torch.isnan(combined).all(dim=1)
    assert set(torch.nonzero(nan_rows).flatten().tolist()) == lost
    ref = reference_out(p, rank)
    keep = ~nan_rows
    torch.testing.assert_close(combined[keep].float(), ref[keep].float(), rtol=2**-7, atol=1e-5)


def sc_double_rejects_undocumented_input(rank: int, world: int) -> None:
    """The double refuses what the docs refuse, before any exchange (so every rank raises alike)."""
    import torch.distributed as dist
    import torch_npu

    from deepinfer_ascend import ep_mc2

    name = ep_mc2._communicator(dist.group.WORLD)
    x = torch.zeros(2, 1024, dtype=torch.bfloat16)
    ok = torch.tensor([[0, 1], [1, 0]], dtype=torch.int32)
    e = 2 * world
    cases = [
        ("repeat", x, torch.tensor([[0, 0], [1, 0]], dtype=torch.int32), {}),
        ("moe_expert_num", x, torch.tensor([[0, -1], [1, 0]], dtype=torch.int32), {}),
        ("H must be", torch.zeros(2, 512, dtype=torch.bfloat16), ok, {}),
        ("BS must", torch.zeros(513, 1024, dtype=torch.bfloat16), torch.zeros(513, 2, dtype=torch.int32), {}),
        ("expert_scales", x, ok, {"expert_scales": torch.ones(2, 2)}),
        ("ep_world_size must be the size", x, ok, {"world": world + 1, "e": world * (world + 1)}),
    ]
    for words, xx, ids, kw in cases:
        args = {"world": world, "e": e} | kw
        size, experts = args.pop("world"), args.pop("e")
        with pytest.raises(torch_npu.DocumentedRejection, match=words):
            torch_npu.npu_moe_distribute_dispatch_v2(xx, ids, name, size, rank, experts, **args)
    with pytest.raises(torch_npu.NotEmulated):
        torch_npu.npu_moe_distribute_dispatch_v2(x, ok, name, world, rank, e, quant_mode=2)


SCENARIOS = {
    f.__name__.removeprefix("sc_"): f
    for f in (
        sc_normal_bf16,
        sc_normal_rounds_narrow,
        sc_normal_fp8,
        sc_normal_skewed_repeats,
        sc_normal_fp32_outputs_fall_back,
        sc_normal_many_experts,
        sc_ll_bf16,
        sc_ll_fp8_repeats,
        sc_ll_wide_combine,
        sc_all_empty,
        sc_declined_placement_runs_reference,
        sc_declined_small_buffer_runs_reference,
        sc_ll_overflow_raises,
        sc_ll_overflow_poisons,
        sc_double_rejects_undocumented_input,
    )
}
SMALL = ("normal_bf16", "normal_skewed_repeats", "ll_fp8_repeats", "declined_placement_runs_reference")


# ----------------------------------------------------------------------------------------------------------------
# Harness


CASES = [(2, name) for name in SCENARIOS] + [(4, name) for name in SMALL]  # 4 ranks: a few, to keep the run short
_RUNS: dict[int, dict] = {}


def _played(world: int) -> dict:
    """All scenarios of ``world`` ranks, played once per test session."""
    if world not in _RUNS:
        names = [name for w, name in CASES if w == world]
        _RUNS[world] = launch(__name__, world, names, seed=SEED, pg_timeout_s=RUN_TIMEOUT_S, deadline_s=RUN_DEADLINE_S)
    return _RUNS[world]


@pytest.mark.parametrize(("world", "scenario"), CASES, ids=[f"world{w}-{name}" for w, name in CASES])
def test_scenario(world, scenario):
    got = _played(world)
    for rank in range(world):
        if (rank, scenario) not in got:
            pytest.fail(f"rank {rank} never reported {scenario!r} (seed {SEED})")
        err, _, _ = got[(rank, scenario)]
        assert err is None, f"rank {rank} of {world}, seed {SEED}:\n{err}"
