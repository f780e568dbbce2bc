"""MoE ops: ``moe_route``, ``ep_dispatch``, ``ep_combine``.

``ep_dispatch`` sends each (token, chosen expert) pair as one row to the expert's owner and returns the rows in a
layout ``grouped_gemm`` takes; ``ep_combine`` brings the expert outputs back and returns, per source token, the
sum of its rows weighted by the routing weights. This file covers one process (``group`` None or world size 1:
a permutation by expert).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..dispatch import call
from ..qtensor import QTensor
from ..validation import FLOAT_DTYPES, Check, value_checks_enabled

SCORINGS = ("sigmoid", "softmax")
EP_MODES = ("normal", "low_latency")


@dataclass
class ExpertLayout:
    """How received rows are grouped by local expert: exactly one field is set.

    expert_offsets: ``[E_local+1]`` int32 (``normal`` mode, contiguous rows); masked_m: ``[E_local]`` int32
    (``low_latency`` mode, ``[E_local, capacity, H]`` rows). Pass both to ``grouped_gemm`` as keywords.
    """

    expert_offsets: torch.Tensor | None = None
    masked_m: torch.Tensor | None = None


@dataclass
class DispatchHandle:
    """What ``ep_combine`` needs to bring rows back; opaque to callers. Backends subclass it.

    num_tokens: T of the dispatched ``x``; mode: the dispatch mode; recv_shape: leading dims of the received rows
    (``[M]`` or ``[E_local, capacity]``).
    """

    num_tokens: int
    mode: str
    recv_shape: tuple[int, ...]


def moe_route(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    scoring: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 group-limited routing, with the semantics of Hugging Face transformers' DeepseekV3 router.

    logits: ``[T, E]`` fp32 router logits; bias: ``[E]`` fp32 ``e_score_correction_bias`` or None.
    ``s = sigmoid(logits)`` (``softmax`` over E for ``scoring="softmax"``); ``b = s + bias`` is used for
    selection only. Experts form ``n_group`` equal groups; a group scores the sum of its top-2 ``b`` (its max for
    softmax scoring); the ``topk_group`` best groups stay, the others are masked out; the ``top_k`` best ``b``
    among the kept experts are chosen. Weights are the unbiased ``s`` of the chosen experts, divided by their sum
    (+1e-20) when ``renormalize``, then times ``routed_scaling_factor``.

    Returns ``weights [T, top_k]`` fp32 and ``ids [T, top_k]`` int32. The order of the k entries of a row is
    unspecified (the (id, weight) pairs are the result).
    """
    c = Check("moe_route")
    c.tensor("logits", logits, dtypes=(torch.float32,), ndim=2)
    num_experts = logits.shape[1]
    if bias is not None:
        c.tensor("bias", bias, dtypes=(torch.float32,), shape=(num_experts,))
        c.same_device(logits=logits, bias=bias)
    c.choice("scoring", scoring, SCORINGS)
    c.positive_int("n_group", n_group)
    if num_experts % n_group:
        raise c.fail("n_group", f"a divisor of the {num_experts} experts", str(n_group))
    group_size = num_experts // n_group
    if scoring == "sigmoid" and n_group > 1 and group_size < 2:
        raise c.fail("n_group", "groups of at least 2 experts (a group scores its top-2)", f"{group_size} per group")
    c.positive_int("topk_group", topk_group)
    if topk_group > n_group:
        raise c.fail("topk_group", f"at most n_group = {n_group}", str(topk_group))
    c.positive_int("top_k", top_k)
    if top_k > topk_group * group_size:
        raise c.fail("top_k", f"at most topk_group * experts per group = {topk_group * group_size}", str(top_k))
    c.number("routed_scaling_factor", routed_scaling_factor, low=0.0)
    return call(
        "moe_route",
        logits=logits,
        bias=bias,
        top_k=top_k,
        n_group=n_group,
        topk_group=topk_group,
        renormalize=bool(renormalize),
        routed_scaling_factor=float(routed_scaling_factor),
        scoring=scoring,
    )


def _group_size(group) -> int:
    if group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(group)


def ep_dispatch(
    x: torch.Tensor | QTensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    *,
    num_experts: int,
    group=None,
    mode: str = "normal",
    capacity: int | None = None,
) -> tuple[torch.Tensor | QTensor, torch.Tensor, torch.Tensor, ExpertLayout, DispatchHandle]:
    """Sends each (token, expert) pair of ``ids`` to that expert as one row.

    x: ``[T, H]`` bf16, or an FP8 ``QTensor`` with ``(1, 128)`` scales (FP8 dispatch: rows keep their scales).
    ids: ``[T, k]`` int32 expert ids in ``[0, num_experts)``, or -1 for "no expert" (the pair is skipped);
    weights: ``[T, k]`` fp32 routing weights. group: a ``torch.distributed`` process group or None; this version
    runs the one-process case (None or world size 1).

    Modes (the received rows are exactly what ``grouped_gemm`` takes, through ``layout``):
    - ``normal``: ``recv_x [M, H]``, M = number of valid pairs, rows grouped by ascending expert id and, within an
      expert, in ascending source-token order; ``layout.expert_offsets [E+1]``.
    - ``low_latency``: fixed ``capacity`` rows per expert (default ``T``, which one process can never exceed),
      ``recv_x [E, capacity, H]``, ``layout.masked_m [E]``; rows past ``masked_m[e]`` are unspecified. More pairs
      for an expert than ``capacity`` is an ``InputError``, never a silent drop.

    Returns ``(recv_x, recv_ids, recv_weights, layout, handle)``: the expert id and routing weight of each received
    row (shaped like recv_x without H; unspecified on unused rows), the layout, and the handle for ``ep_combine``.
    """
    c = Check("ep_dispatch")
    if isinstance(x, QTensor):
        c.qtensor("x", x, block=(1, 128), ndim=2)
    else:
        c.tensor("x", x, dtypes=FLOAT_DTYPES, ndim=2)
    tokens = x.shape[0]
    c.index("ids", ids, ndim=2)
    if ids.shape[0] != tokens:
        raise c.fail("ids", f"{tokens} rows (the tokens of 'x')", f"shape {list(ids.shape)}")
    c.tensor("weights", weights, dtypes=(torch.float32,), shape=tuple(ids.shape))
    c.positive_int("num_experts", num_experts)
    c.choice("mode", mode, EP_MODES)
    if capacity is not None:
        if mode != "low_latency":
            raise c.fail("capacity", "None in normal mode", str(capacity))
        c.positive_int("capacity", capacity, minimum=0)
    x_data = x.data if isinstance(x, QTensor) else x
    c.same_device(x=x_data, ids=ids, weights=weights)
    world = _group_size(group)
    if world != 1:
        raise c.fail(
            "group",
            "None or a process group of world size 1 (multi-rank dispatch is not built yet)",
            f"world size {world}",
        )
    if value_checks_enabled(ids) and ids.numel():
        c.values_in_range("ids", ids, -1, num_experts - 1, what="expert ids (or -1)")
        if mode == "low_latency" and capacity is not None:
            most = int(torch.bincount(ids[ids >= 0].long(), minlength=num_experts).max()) if (ids >= 0).any() else 0
            if most > capacity:
                raise c.fail("capacity", f"at least {most} (the most rows one expert receives)", str(capacity))
    return call(
        "ep_dispatch",
        x=x,
        ids=ids,
        weights=weights,
        num_experts=num_experts,
        group=group,
        mode=mode,
        capacity=tokens if capacity is None and mode == "low_latency" else capacity,
    )


def ep_combine(y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Returns ``out [T, H]``: for each source token, the sum over its dispatched rows of ``weight * y[row]``,
    accumulated in fp32 and returned in y's dtype (zeros for a token with no valid expert).

    y: the expert outputs in the received layout of ``handle`` (``[M, H]`` or ``[E, capacity, H]``); its hidden
    size may differ from the dispatched one.
    """
    c = Check("ep_combine")
    if not isinstance(handle, DispatchHandle):
        raise c.fail("handle", "the DispatchHandle returned by ep_dispatch", type(handle).__name__)
    c.tensor("y", y, dtypes=FLOAT_DTYPES, shape=(*handle.recv_shape, None))
    return call("ep_combine", y=y, handle=handle)
