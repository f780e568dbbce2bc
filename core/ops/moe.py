"""MoE ops: ``moe_route``, ``ep_dispatch``, ``ep_combine``, and the records they use.

``ep_dispatch`` sends each (token, chosen expert) pair as one row to a rank that holds the expert and returns, on
every rank, the rows of its local experts in a layout ``grouped_gemm`` takes; ``ep_combine`` brings the expert
outputs back and returns, per source token, the sum of its rows weighted by the routing weights. One process
(``group`` None or world size 1) is a permutation by expert; with a ``torch.distributed`` group of several ranks
both ops are collectives over that group. Which rank holds which experts is data: an ``ExpertPlacement``.
"""

from __future__ import annotations

import functools
import hashlib
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..dispatch import call
from ..qtensor import QTensor
from ..validation import FLOAT_DTYPES, Check, value_checks_enabled

SCORINGS = ("sigmoid", "softmax", "sqrtsoftplus")
EP_MODES = ("normal", "low_latency")


@dataclass(frozen=True)
class ExpertPlacement:
    """Which rank of an expert-parallel group holds which experts.

    num_experts: E; expert ids are global, in ``[0, E)``.
    local_experts: one tuple per rank (``world_size = len(local_experts)``): the global ids of the experts that rank
        holds, in its local order. Local expert ``i`` of rank ``r`` is ``local_experts[r][i]``: row group ``i`` of
        that rank's receive layout, and ``w[i]`` of its ``grouped_gemm``. A rank may hold no expert.

    Every expert is held by at least one rank and at most once per rank. An expert held by several ranks is
    replicated (a redundant copy of a hot expert): pair ``j`` of token ``t`` of source rank ``s`` goes to the copy on
    holder number ``(s + t) % n`` of the ``n`` ranks holding it, taken in ascending rank order (``route``). The rule
    needs nothing but the pair's own coordinates, so every rank computes the same destination without exchanging
    anything. The default placement is ``contiguous``. Validation happens in ``ep_dispatch`` (``InputError`` about
    ``placement``); ``problem()`` says what is wrong with a placement, if anything.

    table_slot: None, or an object naming persistent dispatch tables by its identity (any object that supports weak
    references; the tables live as long as it; not part of the placement's equality, hash or repr). The
    core's dispatch turns a placement into device tables; placements with the same ``table_slot`` (on one device)
    share one set of table buffers of a fixed shape, rewritten in place when a placement different from the one
    they hold is dispatched or passed to ``load_placement_tables``. A CUDA graph captured with one placement of a
    slot thus replays with the latest one loaded into that slot: give each MoE layer whose placement changes at run
    time a slot of its own, and load its new placement when it switches. Placements of one slot must keep the same
    ``num_experts``, world size and experts per rank (``InputError`` about ``placement`` otherwise).
    """

    num_experts: int
    local_experts: tuple[tuple[int, ...], ...]
    table_slot: object | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "local_experts", tuple(tuple(rank) for rank in self.local_experts))

    @classmethod
    def contiguous(cls, num_experts: int, world_size: int) -> ExpertPlacement:
        """Rank ``r`` holds experts ``[r * E // R, (r + 1) * E // R)`` in ascending order (equal blocks of E/R when
        R divides E)."""
        bounds = [r * num_experts // world_size for r in range(world_size + 1)]
        return cls(num_experts, tuple(tuple(range(bounds[r], bounds[r + 1])) for r in range(world_size)))

    @classmethod
    def from_expert_rank(cls, expert_rank: Sequence[int], world_size: int) -> ExpertPlacement:
        """One copy of each expert: expert ``e`` on rank ``expert_rank[e]``; local order is ascending expert id."""
        ranks = [int(r) for r in expert_rank]
        return cls(len(ranks), tuple(tuple(e for e, r in enumerate(ranks) if r == rank) for rank in range(world_size)))

    @property
    def world_size(self) -> int:
        return len(self.local_experts)

    @property
    def expert_ranks(self) -> tuple[tuple[int, ...], ...]:
        """For each expert, the ranks holding it, ascending."""
        holders: list[list[int]] = [[] for _ in range(self.num_experts)]
        for rank, experts in enumerate(self.local_experts):
            for e in experts:
                if 0 <= e < self.num_experts:
                    holders[e].append(rank)
        return tuple(tuple(h) for h in holders)

    def route(self, expert: int, src_rank: int, token: int) -> tuple[int, int]:
        """``(rank, local expert index)`` receiving a pair of ``expert`` from token ``token`` of rank ``src_rank``."""
        holders = self.expert_ranks[expert]
        rank = holders[(src_rank + token) % len(holders)]
        return rank, self.local_experts[rank].index(expert)

    def problem(self) -> str | None:
        """What is wrong with this placement, or None."""
        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int) or self.num_experts < 1:
            return f"num_experts {self.num_experts!r} is not a positive int"
        if not self.local_experts:
            return "no rank"
        for rank, experts in enumerate(self.local_experts):
            if any(isinstance(e, bool) or not isinstance(e, int) for e in experts):
                return f"rank {rank} lists a non-int expert id"
            bad = [e for e in experts if not 0 <= e < self.num_experts]
            if bad:
                return f"rank {rank} lists expert {bad[0]} outside [0, {self.num_experts})"
            if len(set(experts)) != len(experts):
                return f"rank {rank} lists an expert twice"
        missing = [e for e, h in enumerate(self.expert_ranks) if not h]
        if missing:
            return f"expert {missing[0]} is held by no rank ({len(missing)} unheld)"
        return None


@dataclass
class ExpertLayout:
    """How received rows are grouped by local expert: exactly one field is set.

    expert_offsets: ``[E_local+1]`` int32 (``normal`` mode, contiguous rows); masked_m: ``[E_local]`` int32
    (``low_latency`` mode, ``[E_local, max_m, H]`` rows). Pass both to ``grouped_gemm`` as keywords.
    """

    expert_offsets: torch.Tensor | None = None
    masked_m: torch.Tensor | None = None


@dataclass
class DispatchHandle:
    """What ``ep_combine`` needs to bring rows back; opaque to callers. Backends subclass it.

    num_tokens: T of the dispatched ``x``; mode: the dispatch mode; recv_shape: leading dims of the received rows
    (``[M]`` or ``[E_local, max_m]``).
    overflow: ``low_latency`` only (else None): a 0-d bool tensor on the device, the same on every rank, true when
    some expert had more rows than its capacity. Those rows were not delivered and ``ep_combine`` returns NaN for
    their source tokens; with value checks on, ``ep_dispatch`` raises instead (see ``ep_dispatch``). Reading it
    synchronises with the device, so a CUDA-graph caller checks it after replay.
    """

    num_tokens: int
    mode: str
    recv_shape: tuple[int, ...]
    overflow: torch.Tensor | None = field(default=None, kw_only=True)


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
    ``s = sigmoid(logits)`` (``softmax`` over E for ``scoring="softmax"``; ``sqrt(softplus(logits))`` for
    ``scoring="sqrtsoftplus"``, DeepSeek-V4's router, which takes no groups: ``n_group`` 1); ``b = s + bias`` is used
    for selection only. Experts form ``n_group`` equal groups; a group scores the sum of its top-2 ``b`` (its max for
    softmax scoring); the ``topk_group`` best groups stay, the others are masked out; the ``top_k`` best ``b``
    among the kept experts are chosen. Weights are the unbiased ``s`` of the chosen experts, divided by their sum
    (+1e-20) when ``renormalize``, then times ``routed_scaling_factor`` (a finite number >= 0).

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
    if scoring == "sqrtsoftplus" and n_group != 1:
        raise c.fail("n_group", "1 with scoring='sqrtsoftplus' (DeepSeek-V4 routes without groups)", str(n_group))
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
    c.number("routed_scaling_factor", routed_scaling_factor, low=0.0, finite=True)
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


def moe_route_hash(
    logits: torch.Tensor,
    expert_ids: torch.Tensor,
    *,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    scoring: str = "sqrtsoftplus",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing to given experts: DeepSeek-V4's hash routing (transformers' DeepseekV4HashRouter), where a frozen
    token-id -> experts table chooses the experts (``expert_ids = tid2eid[input_ids]``) and the router only weights
    them.

    logits: ``[T, E]`` fp32 router logits; expert_ids: ``[T, k]`` int32 in ``[0, E)``, the experts of each token.
    ``s`` is the score of ``scoring`` as in ``moe_route`` (default ``sqrtsoftplus``); the weights are ``s`` at the
    given experts, divided by their sum (+1e-20) when ``renormalize``, then times ``routed_scaling_factor`` (a finite
    number >= 0). An expert listed twice in a row counts twice. There is no bias and no selection.

    Returns ``weights [T, k]`` fp32 and ``ids [T, k]`` int32: ``ids`` equals ``expert_ids`` entry for entry and
    ``weights[t, j]`` belongs to ``ids[t, j]``, so the order is the caller's and the result is fully determined.
    """
    c = Check("moe_route_hash")
    c.tensor("logits", logits, dtypes=(torch.float32,), ndim=2)
    tokens, num_experts = logits.shape
    c.index("expert_ids", expert_ids, ndim=2, length=tokens)
    if expert_ids.shape[1] < 1:
        raise c.fail("expert_ids", "at least one expert per token", f"shape {list(expert_ids.shape)}")
    c.same_device(logits=logits, expert_ids=expert_ids)
    c.choice("scoring", scoring, SCORINGS)
    c.number("routed_scaling_factor", routed_scaling_factor, low=0.0, finite=True)
    if value_checks_enabled(expert_ids):
        c.values_in_range("expert_ids", expert_ids, 0, num_experts - 1, what="expert ids")
    return call(
        "moe_route_hash",
        logits=logits,
        expert_ids=expert_ids,
        renormalize=bool(renormalize),
        routed_scaling_factor=float(routed_scaling_factor),
        scoring=scoring,
    )


MAX_EXPERTS = 1 << 16  # per MoE layer: DeepSeek's models route over 256


def _group_rank_size(c: Check, group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    import torch.distributed as dist

    if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise c.fail("group", "a torch.distributed ProcessGroup or None", repr(group))
    rank = dist.get_rank(group)
    if rank < 0:
        raise c.fail("group", "a process group this process belongs to", "a group without this process")
    return rank, dist.get_world_size(group)


@functools.lru_cache(maxsize=64)
def _default_placement(num_experts: int, world: int) -> ExpertPlacement:
    return ExpertPlacement.contiguous(num_experts, world)


@functools.lru_cache(maxsize=256)  # one placement per MoE layer under EPLB
def _placement_problem(placement: ExpertPlacement) -> str | None:
    return placement.problem()


def _check_placement(c: Check, placement, num_experts: int, world: int) -> None:
    if not isinstance(placement, ExpertPlacement):
        raise c.fail("placement", "an ExpertPlacement or None", type(placement).__name__)
    try:
        problem = _placement_problem(placement)
    except TypeError:  # unhashable contents: not a valid placement either
        problem = placement.problem() or "unhashable expert ids"
    if problem is not None:
        raise c.fail("placement", "every expert held by at least one rank, at most once per rank", problem)
    if placement.num_experts != num_experts:
        raise c.fail("placement", f"a placement of num_experts = {num_experts}", f"{placement.num_experts} experts")
    if placement.world_size != world:
        raise c.fail("placement", f"one entry per rank of the group ({world})", f"{placement.world_size} ranks")


def load_placement_tables(placement: ExpertPlacement, device: torch.device | str) -> None:
    """Makes the core's dispatch tables of ``placement`` on ``device`` current now, without dispatching: for a
    placement with a ``table_slot``, rewrites that slot's buffers in place (ordered on the device's current stream
    after the work already queued), so that CUDA graphs captured over the slot replay with ``placement`` from then
    on. Validates the placement (``InputError`` about ``placement``)."""
    c = Check("load_placement_tables")
    if not isinstance(placement, ExpertPlacement):
        raise c.fail("placement", "an ExpertPlacement", type(placement).__name__)
    _check_placement(c, placement, placement.num_experts, placement.world_size)
    from ..reference.ep import placement_tables

    placement_tables(placement, torch.device(device))


# Per process group, the argument sets of ``ep_dispatch`` whose agreement across its ranks has been checked.
_AGREED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _stable_code(text: str) -> int:
    """A 63-bit digest of ``text``, the same in every process (``hash`` of a str is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def _gather_texts(text: str, group, world: int, device: torch.device) -> list[str]:
    """``text`` of every rank of ``group``, in rank order (two small collectives)."""
    import torch.distributed as dist

    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([data.numel()], dtype=torch.int64, device=device), group=group)
    longest = max(int(n) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    rows = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(rows, padded, group=group)
    return [bytes(row[: int(n)].tolist()).decode() for row, n in zip(rows, lengths)]


def _check_ranks_agree(c: Check, group, world: int, fields: list[tuple[str, str, object]], device) -> None:
    """Raises the same ``InputError`` on every rank of ``group`` when its ranks passed different values for one of
    ``fields`` (``(argument, what it is, value)``), naming the first such argument and every rank's value.

    A collective the first time this process uses this set of values on this group (one all-gather of a digest per
    field; on a difference, two more to show the values); later calls with the same set exchange nothing. Ranks that
    pass the same values reach the check together, so it never desynchronises a correct program. Skipped while a
    CUDA graph is captured (the exchange would be captured too); the first call outside capture checks."""
    key = tuple(value for _, _, value in fields)
    try:
        agreed = _AGREED.setdefault(group, set())
        if key in agreed:
            return
    except TypeError:  # a group that cannot be weakly referenced or hashed: check every call
        agreed = None
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    import torch.distributed as dist

    codes = torch.tensor([_stable_code(repr(value)) for _, _, value in fields], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(codes) for _ in range(world)]
    dist.all_gather(everyone, codes, group=group)
    table = torch.stack(everyone).cpu()
    differs = (table != table[0]).any(dim=0).tolist()
    if True in differs:
        arg, what, value = fields[differs.index(True)]
        values = _gather_texts(repr(value), group, world, device)
        ranks: dict[str, list[int]] = {}
        for rank, v in enumerate(values):
            ranks.setdefault(v, []).append(rank)
        got = "; ".join(f"{v} on rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}" for v, r in ranks.items())
        raise c.fail(arg, f"the same {what} on every rank of the group ({world} ranks)", got)
    if agreed is not None:
        agreed.add(key)


def _payload_kind(x) -> str:
    if isinstance(x, QTensor):
        return f"FP8 {x.data.dtype} with {x.scale_format} scales"
    return str(x.dtype)


def ep_dispatch(
    x: torch.Tensor | QTensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    *,
    num_experts: int,
    group=None,
    mode: str = "normal",
    capacity: int | None = None,
    placement: ExpertPlacement | None = None,
) -> tuple[torch.Tensor | QTensor, torch.Tensor, torch.Tensor, ExpertLayout, DispatchHandle]:
    """Sends each (token, expert) pair of ``ids`` as one row to a rank holding that expert.

    x: ``[T, H]`` bf16 (or fp16 / fp32), or an FP8 ``QTensor`` with ``(1, 128)`` scales (FP8 dispatch: rows travel
    with their scales). num_experts: at most ``MAX_EXPERTS`` (65536). ids: ``[T, k]`` int32 global expert ids in
    ``[0, num_experts)``, or -1 for "no expert" (the pair is skipped); weights: ``[T, k]`` fp32 routing weights.
    group: a ``torch.distributed`` process group, or None for one process (None never means the default group).
    placement: which rank holds which experts (``ExpertPlacement``); default ``ExpertPlacement.contiguous(num_experts,
    world size)``. In one process the placement may only reorder the experts (local order); by default local expert
    ``i`` is expert ``i``.

    Received rows, on each rank, cover only that rank's ``E_local`` experts, grouped by ascending local expert index;
    within a local expert they are ordered by (source rank, source token, slot ``j`` of ``ids``) ascending. One
    process is the case of one source rank. Replicated experts are routed by ``ExpertPlacement.route``.

    Modes (the received rows are exactly what ``grouped_gemm`` takes, through ``layout``):
    - ``normal``: ``recv_x [M, H]``, ``layout.expert_offsets [E_local+1]`` ending at M. One process: ``M = T * k``
      and no host synchronisation: the received pairs, then one row for each skipped pair (-1 in ``ids``), counted
      in the last local expert's range; those rows hold unspecified data, id -1 and weight 0 (``grouped_gemm``
      multiplies them to no use; ``ep_combine`` never reads them). Several ranks: M = the pairs this rank receives;
      the counts go first (one fixed-size exchange), then the rows; sizing the receive buffer synchronises with the
      host once. Rows may differ per rank (T may be 0 on some, M may be 0 on some).
    - ``low_latency``: fixed capacity, no host synchronisation, fixed-size exchanges (usable under CUDA graphs once
      warmed up, with value checks off as they are during capture). ``recv_x [E_local, max_m, H]`` with
      ``max_m = world * capacity``, ``layout.masked_m [E_local]``; rows at or past ``masked_m[e]`` are unspecified.
      One process: ``capacity`` rows per expert, default ``T`` (may be smaller than T). Several ranks: every rank
      sends its tokens in ``capacity`` fixed slots, so ``capacity`` is required, must be the same on every rank and
      at least T on every rank (``InputError`` otherwise); an expert then receives at most ``capacity`` rows from
      each source rank unless a token names it more than once.

    Capacity overflow (more rows for an expert than ``max_m``) never loses a token silently: with value checks on
    (``DEEPINFER_VALUE_CHECKS``, the default outside CUDA-graph capture) ``ep_dispatch`` raises ``InputError`` about
    ``capacity``, on every rank alike (each rank decides from the same exchanged routing, so none is left waiting in
    a collective). With value checks off the rows past ``max_m`` (the last in the order above) are not delivered,
    ``handle.overflow`` is true on every rank, and ``ep_combine`` returns NaN for each source token that lost a row.

    Several ranks: both ops are collectives; every rank of ``group`` calls them in the same order with the same
    ``num_experts``, ``placement``, ``mode``, ``capacity``, hidden size, payload kind (dtype, or FP8 and its scale
    format) and top-k (columns of ``ids``), and calls ``ep_combine`` on each handle. The first time a process
    dispatches with a given set of those over a group, the ranks compare them (one small all-gather; nothing on later
    calls with the same set, nor while a CUDA graph is captured): if they differ, every rank raises the same
    ``InputError`` naming the first differing argument and each rank's value. Ranks whose values differ only on a
    later call, after agreeing on both sets before, are not caught. A rank that dies or never calls surfaces on the
    others as the process group's error after its timeout (``timeout=`` of ``init_process_group`` / ``new_group``).
    An ``InputError`` about a rank's own arguments is raised before any exchange, on the ranks whose arguments are
    wrong.

    Returns ``(recv_x, recv_ids, recv_weights, layout, handle)``: the global expert id and routing weight of each
    received row (shaped like recv_x without H; unused low-latency rows hold -1 and 0), the layout, and the handle
    for ``ep_combine``.
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
    if num_experts > MAX_EXPERTS:  # the placement tables grow with it: refuse before building them
        raise c.fail("num_experts", f"an int in [1, {MAX_EXPERTS}]", repr(num_experts))
    c.choice("mode", mode, EP_MODES)
    x_data = x.data if isinstance(x, QTensor) else x
    c.same_device(x=x_data, ids=ids, weights=weights)
    _, world = _group_rank_size(c, group)
    if placement is None:
        placement = _default_placement(num_experts, world)
    _check_placement(c, placement, num_experts, world)
    if capacity is not None:
        if mode != "low_latency":
            raise c.fail("capacity", "None in normal mode", str(capacity))
        c.positive_int("capacity", capacity, minimum=0)
    if mode == "low_latency" and world > 1:
        if capacity is None:
            raise c.fail("capacity", f"an int >= T, the same on every rank (a group of {world} ranks)", "None")
        if capacity < tokens:
            raise c.fail(
                "capacity", f"at least T = {tokens} (a rank sends its tokens in capacity slots)", str(capacity)
            )
    if world > 1:
        fields = [
            ("num_experts", "number of experts", num_experts),
            ("placement", "expert placement", placement),
            ("mode", "mode", mode),
            ("capacity", "capacity", capacity),
            ("x", "hidden size (columns of x)", x.shape[1]),
            ("x", "payload kind", _payload_kind(x)),
            ("ids", "top-k (columns of ids)", ids.shape[1]),
        ]
        _check_ranks_agree(c, group, world, fields, x_data.device)
    checks = value_checks_enabled(ids)
    if checks and ids.numel():
        c.values_in_range("ids", ids, -1, num_experts - 1, what="expert ids (or -1)")
        if mode == "low_latency" and world == 1 and capacity is not None:
            most = int(torch.bincount(ids[ids >= 0].long(), minlength=num_experts).max()) if (ids >= 0).any() else 0
            if most > capacity:
                raise c.fail("capacity", f"at least {most} (the most rows one expert receives)", str(capacity))
    if mode == "low_latency" and capacity is None:
        capacity = tokens
    out = call(
        "ep_dispatch",
        x=x,
        ids=ids,
        weights=weights,
        num_experts=num_experts,
        group=group,
        mode=mode,
        capacity=capacity,
        placement=placement,
    )
    overflow = out[4].overflow
    if checks and overflow is not None and bool(overflow):
        raise c.fail(
            "capacity",
            f"room for every expert's rows ({world} x capacity = {world * capacity} rows per local expert)",
            f"capacity {capacity} and more rows than that for some expert (a token naming an expert twice?)",
        )
    return out


def ep_combine(y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Returns ``out [T, H']``: for each source token, the sum over its dispatched rows of ``weight * y[row]``,
    accumulated in fp32 and returned in y's dtype (zeros for a token with no valid expert).

    y: the expert outputs in the received layout of ``handle`` (``[M, H']`` or ``[E_local, max_m, H']``); rows past
    ``masked_m``, and the skipped pairs' rows of one process's normal mode, are never read. Its hidden size may
    differ from the dispatched one (the same on every rank).

    Several ranks: a collective over the dispatch's group (every rank calls it, in dispatch order, with y of the same
    dtype and hidden size, in the same batch-invariant mode). Each rank sums, per source token, the weighted rows of
    its own experts (fp32) and sends that fp32 partial sum back; the source adds the partial sums in rank order, so
    the result differs from one process by fp32 reassociation only. Exception, batch-invariant mode (either mode),
    or in ``normal`` mode where the fp32 partial sums could be more bytes than y's rows (bf16 y with more than k/2
    ranks): each row goes back to its source, which forms ``weight * row`` in fp32 and sums the k products in fp32
    with the arithmetic of one process. A source token that lost a row to capacity overflow gets NaN (see
    ``ep_dispatch``).

    """
    c = Check("ep_combine")
    if not isinstance(handle, DispatchHandle):
        raise c.fail("handle", "the DispatchHandle returned by ep_dispatch", type(handle).__name__)
    c.tensor("y", y, dtypes=FLOAT_DTYPES, shape=(*handle.recv_shape, None))
    return call("ep_combine", y=y, handle=handle)
