"""Expert-parallel load balancing (EPLB): redundant copies of hot experts, placed from measured load, re-placed
while serving.

**Placement** (``rebalance_experts``), DeepSeek's published policy: from the load of each logical expert of each MoE
layer (tokens routed to it over a window of steps) to a physical-to-logical map of ``num_physical = E + R`` slots,
``num_physical / num_ranks`` per rank, slots ``[r * S, (r + 1) * S)`` on rank ``r``.

- *Hierarchical* (the expert groups of group-limited routing divide evenly over the nodes): the groups are packed to
  nodes, each node ``G / N`` groups, balancing the nodes' loads; within each node the node's ``P / N`` slots go to
  its experts, every extra slot to the expert with the highest load per copy; the node's copies (each carrying
  ``load / copies``) are packed to its ranks, ``S`` per rank, balancing the ranks' loads. A token's experts are
  then held within few nodes, as group-limited routing intends.
- *Global* otherwise: the same with one node and one group.

Packing is greedy (heaviest first, each to the lightest rank with a free slot), with one rule DeepSeek's code does
not have: two copies of one expert never share a rank (``ExpertPlacement`` holds an expert at most once per rank), so
an expert gets at most as many copies as its node has ranks. Ties break by index, so every rank computes the same
placement from the same load. Given the previous map, the result is relabelled (packs to nodes and ranks, experts to
slots within a rank) to keep as many experts where they are as the greedy matching finds, which is what a rebalance
has to move.

**Measurement and rebalancing** (``ExpertLoadBalancer``): each MoE layer counts, on the device, the (token, expert)
pairs of the tokens it routes (``MoE.load``, DeepSeek-V4's ``V4MoE.load`` alike, one ``index_add_`` per layer: no host
synchronisation, captured into CUDA graphs like the rest of the step; padding rows of a graph batch are not counted;
DeepSeek-V4's hash-routed layers count too: a token's experts are fixed, but their copies share its rows). After each
step the counts move into a ring of ``window_size`` steps, on the device. Every ``step_interval`` steps a rebalance
starts and is spread over the following steps so that none pauses for the whole of it: the ranks' windows are summed
(an all-reduce issued without waiting), the new placement is computed on a worker thread, and once every rank's thread
is done (agreed over the host group) the layers whose placement changes move their expert weights between ranks in
place (``torch.distributed`` point-to-point over the expert-parallel group, staged so that no weight is overwritten
before it is sent), a few layers per step, each switching to its new placement as its weights arrive, at the same step
on every rank. Each layer's dispatch tables live in buffers of its own (``ExpertPlacement.table_slot``), rewritten in
place on a switch, so CUDA graphs captured before read the new placement.

Tokens of an expert held by several ranks are spread over its copies by ``ExpertPlacement``'s replica rule: pair
``(source rank s, token t)`` goes to holder ``(s + t) % copies``, deterministic and the same on every rank. Every
copy holds the same weights, so where a row is computed changes nothing but the order in which ``ep_combine`` adds
per-rank partial sums (fp32 reassociation; none in batch-invariant mode).
"""

from __future__ import annotations

import heapq
import logging
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch

from deepinfer import FP4Tensor, QTensor
from deepinfer.errors import InputError
from deepinfer.ops.moe import ExpertPlacement, load_placement_tables

from .moe import ExpertParallel

log = logging.getLogger("deepinfer.eplb")

# ----------------------------------------------------------------------------------------------------------------
# The placement algorithm


@dataclass(frozen=True)
class Rebalanced:
    """The result of ``rebalance_experts`` for ``L`` layers, ``E`` logical experts, ``P`` physical slots.

    phy2log: ``[L, P]`` int64, the logical expert in each slot (rank ``r`` holds slots ``[r * S, (r + 1) * S)``).
    log2phy: ``[L, E, max_copies]`` int64, the slots holding each expert, ascending, -1 padded.
    logcnt: ``[L, E]`` int64, the copies of each expert.
    """

    phy2log: torch.Tensor
    log2phy: torch.Tensor
    logcnt: torch.Tensor

    def placements(self, num_ranks: int) -> list[ExpertPlacement]:
        """One ``ExpertPlacement`` per layer."""
        experts = self.logcnt.shape[1]
        return [placement_of(row, num_ranks, experts) for row in self.phy2log]


def placement_of(
    phy2log: Sequence[int] | torch.Tensor, num_ranks: int, num_experts: int | None = None
) -> ExpertPlacement:
    """The ``ExpertPlacement`` of one layer's physical-to-logical map: rank ``r`` holds slots ``[r * S, (r + 1) *
    S)`` in that local order, ``S = len(phy2log) / num_ranks``; ``num_experts`` defaults to the largest id + 1."""
    ids = [int(e) for e in (phy2log.tolist() if isinstance(phy2log, torch.Tensor) else phy2log)]
    per = len(ids) // num_ranks
    experts = max(ids) + 1 if num_experts is None else num_experts
    return ExpertPlacement(experts, tuple(tuple(ids[r * per : (r + 1) * per]) for r in range(num_ranks)))


def phy2log_of(placement: ExpertPlacement) -> list[int]:
    """A placement with equal slots per rank as its physical-to-logical map (the inverse of ``placement_of``)."""
    return [e for experts in placement.local_experts for e in experts]


def _fail(arg: str, expected: str, actual: Any) -> InputError:
    return InputError("rebalance_experts", arg, expected, str(actual))


def _int(arg: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(arg, f"an int >= {minimum}", repr(value))
    return value


def hierarchical(num_groups: int, num_nodes: int) -> bool:
    """Whether ``rebalance_experts`` uses the hierarchical policy: several nodes over which the groups divide."""
    return num_nodes > 1 and num_groups % num_nodes == 0


def rebalance_experts(
    load: torch.Tensor,
    num_physical: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    *,
    previous: torch.Tensor | None = None,
) -> Rebalanced:
    """Places ``num_physical`` expert copies over ``num_ranks`` ranks for each layer of ``load``.

    load: ``[L, E]`` non-negative load per logical expert (tokens routed to it; any real dtype). num_groups: the
    expert groups of the router (``n_group``; dividing E); num_nodes: nodes the ranks are spread over (dividing
    num_ranks; consecutive ranks share a node). num_physical: a multiple of num_ranks, at least E, at most
    ``E * num_ranks`` so that no rank holds an expert twice; the policy is hierarchical where ``hierarchical(num_groups,
    num_nodes)`` and ``num_physical <= E * ranks per node``, global otherwise.
    previous: ``[L, num_physical]``, the map in use, or None; the result keeps experts in place where its
    relabelling can (see the module's doc); the balance is the same either way.

    Guarantees: every expert has at least one copy; every rank has ``num_physical / num_ranks`` slots and holds an
    expert at most once; hierarchical: a group's experts and all copies of an expert are on one node. Balance
    (checked on random problems, not proven): the heaviest rank carries at most the mean over the ranks (of its
    node, hierarchical) plus the largest load of one copy; hierarchical, the heaviest node at most the mean node plus
    the largest group. Raises ``InputError`` naming the argument that is out of range.
    """
    if not isinstance(load, torch.Tensor) or load.dim() != 2 or load.is_complex() or load.dtype == torch.bool:
        raise _fail("load", "a real [layers, experts] tensor", getattr(load, "shape", type(load).__name__))
    layers, experts = load.shape
    if experts < 1:
        raise _fail("load", "at least one expert", list(load.shape))
    w = load.detach().double().cpu()
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise _fail("load", "finite, non-negative values", "a negative or non-finite value")
    _int("num_ranks", num_ranks)
    _int("num_groups", num_groups)
    _int("num_nodes", num_nodes)
    _int("num_physical", num_physical)
    if experts % num_groups:
        raise _fail("num_groups", f"a divisor of the {experts} experts", num_groups)
    if num_ranks % num_nodes:
        raise _fail("num_nodes", f"a divisor of num_ranks ({num_ranks})", num_nodes)
    if num_physical % num_ranks:
        raise _fail("num_physical", f"a multiple of num_ranks ({num_ranks})", num_physical)
    if not hierarchical(num_groups, num_nodes) or num_physical > experts * (num_ranks // num_nodes):
        num_groups = num_nodes = 1  # the global policy (also where a node's ranks cannot hold its slots)
    per_node = num_ranks // num_nodes
    if not experts <= num_physical <= experts * per_node:
        raise _fail(
            "num_physical",
            f"in [{experts}, {experts * per_node}] (each of the {experts} experts at most once per rank of its node)",
            num_physical,
        )
    if previous is not None and tuple(previous.shape) != (layers, num_physical):
        raise _fail("previous", f"shape [{layers}, {num_physical}] or None", list(previous.shape))
    prev = previous.tolist() if previous is not None else [None] * layers
    rows = [_layer(w[i].tolist(), num_physical, num_groups, num_nodes, num_ranks, prev[i]) for i in range(layers)]
    phy2log = torch.tensor(rows, dtype=torch.int64).view(layers, num_physical)
    logcnt = torch.zeros(layers, experts, dtype=torch.int64)
    logcnt.scatter_add_(1, phy2log, torch.ones_like(phy2log))
    log2phy = torch.full((layers, experts, int(logcnt.max())), -1, dtype=torch.int64)
    for i, row in enumerate(rows):
        seen = [0] * experts
        for slot, e in enumerate(row):
            log2phy[i, e, seen[e]] = slot
            seen[e] += 1
    return Rebalanced(phy2log, log2phy, logcnt)


def _layer(
    load: list[float], num_physical: int, num_groups: int, num_nodes: int, num_ranks: int, previous: list | None
) -> list[int]:
    """One layer's physical-to-logical map (see ``rebalance_experts``)."""
    experts = len(load)
    group_size = experts // num_groups
    per_node, slots = num_ranks // num_nodes, num_physical // num_ranks
    # 1. groups to nodes
    group_load = [sum(load[g * group_size : (g + 1) * group_size]) for g in range(num_groups)]
    node_groups = _pack(group_load, list(range(num_groups)), num_nodes, num_groups // num_nodes)
    node_experts = [
        sorted(e for g in groups for e in range(g * group_size, (g + 1) * group_size)) for groups in node_groups
    ]
    if previous is not None:  # keep each node's experts where they were, as far as a greedy matching finds
        old = [set(previous[n * per_node * slots : (n + 1) * per_node * slots]) for n in range(num_nodes)]
        node_experts = _relabel(node_experts, old)
    out: list[int] = []
    for node, mine in enumerate(node_experts):
        # 2. copies within the node
        counts = _replicate([load[e] for e in mine], num_physical // num_nodes, per_node)
        # 3. copies to the node's ranks
        weights, labels = [], []
        for e, c in zip(mine, counts):
            weights += [load[e] / c] * c
            labels += [e] * c
        ranks = [[labels[i] for i in pack] for pack in _pack(weights, labels, per_node, slots)]
        old_ranks = None
        if previous is not None:
            base = node * per_node
            old_ranks = [previous[(base + r) * slots : (base + r + 1) * slots] for r in range(per_node)]
            ranks = _relabel(ranks, [set(r) for r in old_ranks])
        for r, held in enumerate(ranks):
            out += _slot_order(held, old_ranks[r] if old_ranks is not None else None)
    return out


def _replicate(load: list[float], num_slots: int, cap: int) -> list[int]:
    """Copies per expert: one each, then every extra slot to the expert with the highest load per copy (lowest index
    on ties) among those with fewer than ``cap`` copies."""
    counts = [1] * len(load)
    heap = [(-x, e) for e, x in enumerate(load)] if cap > 1 else []
    heapq.heapify(heap)
    for _ in range(num_slots - len(load)):
        _, e = heapq.heappop(heap)
        counts[e] += 1
        if counts[e] < cap:
            heapq.heappush(heap, (-load[e] / counts[e], e))
    return counts


def _pack(weights: list[float], labels: list[int], num_packs: int, per_pack: int) -> list[list[int]]:
    """Item indices per pack: ``per_pack`` items each, no two with the same label in one pack (each label may occur
    at most ``num_packs`` times). Greedy: heaviest item first (ties: lower label, then index) to the lightest pack
    with room that lacks its label (ties: fewer items, then lower index). When every pack with room already holds
    the label, an item of a full pack lacking the label whose own label the lightest pack with room lacks moves there
    (one exists: that full pack holds more distinct labels), and the item takes its place."""
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], labels[i], i))
    total = [0.0] * num_packs
    items: list[list[int]] = [[] for _ in range(num_packs)]
    held: list[set[int]] = [set() for _ in range(num_packs)]

    def put(p: int, i: int) -> None:
        items[p].append(i)
        held[p].add(labels[i])
        total[p] += weights[i]

    for i in order:
        lab = labels[i]
        room = [p for p in range(num_packs) if len(items[p]) < per_pack]
        free = [p for p in room if lab not in held[p]]
        if free:
            put(min(free, key=lambda p: (total[p], len(items[p]), p)), i)
            continue
        r = min(room, key=lambda p: (total[p], len(items[p]), p))
        swaps = [
            (max(total[r] + weights[x], total[q] - weights[x] + weights[i]), q, n)
            for q in range(num_packs)
            if lab not in held[q]
            for n, x in enumerate(items[q])
            if labels[x] not in held[r]
        ]
        _, q, n = min(swaps)
        x = items[q].pop(n)
        held[q].discard(labels[x])
        total[q] -= weights[x]
        put(r, x)
        put(q, i)
    return items


def _relabel(packs: list[list[int]], old: list[set[int]]) -> list[list[int]]:
    """``packs`` permuted so that pack ``j`` of the result shares as many labels with ``old[j]`` as a greedy
    matching (largest overlap first, ties by index) finds."""
    pairs = sorted(((-len(set(p) & o), i, j) for i, p in enumerate(packs) for j, o in enumerate(old)), key=lambda t: t)
    out: list[list[int] | None] = [None] * len(packs)
    used = set()
    for _, i, j in pairs:
        if i not in used and out[j] is None:
            out[j] = packs[i]
            used.add(i)
    return [p for p in out if p is not None] if len(used) == len(packs) else packs


def _slot_order(held: list[int], old: list[int] | None) -> list[int]:
    """A rank's experts in slot order: ascending, or, given its previous slots, each kept expert in its old slot and
    the new ones in the free slots in ascending order."""
    if old is None:
        return sorted(held)
    out: list[int | None] = [e if e in held else None for e in old]
    new = iter(sorted(set(held) - set(old)))
    return [e if e is not None else next(new) for e in out]


def rank_loads(
    phy2log: Sequence[int] | torch.Tensor, load: Sequence[float] | torch.Tensor, num_ranks: int
) -> list[float]:
    """Each rank's expected load under a layer's map: every copy of expert ``e`` takes ``load[e] / copies``."""
    ids = [int(e) for e in (phy2log.tolist() if isinstance(phy2log, torch.Tensor) else phy2log)]
    w = [float(x) for x in (load.tolist() if isinstance(load, torch.Tensor) else load)]
    copies = [0] * len(w)
    for e in ids:
        copies[e] += 1
    per = len(ids) // num_ranks
    return [sum(w[e] / copies[e] for e in ids[r * per : (r + 1) * per]) for r in range(num_ranks)]


def initial_placement(num_experts: int, num_redundant: int, num_ranks: int, num_groups: int, num_nodes: int):
    """The placement before any load is measured: ``rebalance_experts`` of a uniform load (with no redundant expert
    and the global policy, the contiguous placement)."""
    if num_redundant == 0 and not hierarchical(num_groups, num_nodes):
        return ExpertPlacement.contiguous(num_experts, num_ranks)
    uniform = torch.ones(1, num_experts)
    return rebalance_experts(uniform, num_experts + num_redundant, num_groups, num_nodes, num_ranks).placements(
        num_ranks
    )[0]


def nodes_of(world: int, env: dict | None = None) -> int:
    """Nodes a torchrun launch of ``world`` ranks spans: ``world / LOCAL_WORLD_SIZE`` where that divides evenly,
    else 1 (ranks of one node are consecutive under torchrun)."""
    env = os.environ if env is None else env
    try:
        local = int(env.get("LOCAL_WORLD_SIZE", world))
    except ValueError:
        return 1
    return world // local if 0 < local <= world and world % local == 0 else 1


# ----------------------------------------------------------------------------------------------------------------
# Measurement and rebalancing in the model


class _TableSlot:
    """The identity of one MoE layer's persistent dispatch tables (``ExpertPlacement.table_slot``)."""

    __slots__ = ("__weakref__", "layer")

    def __init__(self, layer: int):
        self.layer = layer

    def __repr__(self) -> str:
        return f"moe layer {self.layer}"


class ExpertLoadBalancer:
    """Measures the load of every MoE layer of ``model`` (``model.moe_layers()``, DeepSeek-V3's or V4's: its main
    layers; multi-token-prediction layers keep their load-time placement) and re-places their experts every
    ``step_interval`` steps, spread over several steps. A layer has ``load``, ``ep`` and its expert stacks ``w13``,
    ``w2`` (dense, FP8 ``QTensor`` or packed ``FP4Tensor``, ``[E_local, ...]``).

    window_size: steps whose load is kept (a ring on the device). step_interval: steps between rebalances (None:
    measure only). num_nodes: nodes the ranks span (``rebalance_experts``). layers_per_step: MoE layers whose experts
    move per step while a rebalance is applied (None: all in one step). Attaching sets each layer's ``load`` and
    gives each layer's placement a ``table_slot`` of its own, so that its dispatch tables are rewritten in place
    when it changes: CUDA graphs captured before read the new placement, and never need capturing again. The engine
    calls ``end_step`` after each step it launches. Over several ranks ``expert_load``, ``rebalance`` and
    ``end_step`` are collectives over the expert-parallel group: every rank calls them at the same point (the
    engine's steps are).

    A rebalance over several ranks, from the step that reaches the interval:

    1. that step starts the sum of the ranks' windows (an all-reduce issued without waiting; on a device, a copy
       into pinned host memory behind it, with an event) and hands the placement (``rebalance_experts``, host work
       of up to a second for a large model) to a worker thread, which waits for the event;
    2. each later step asks every rank whether its thread is done (``RankSync.min_int`` over the host group: the
       host never waits for the device or the thread); at the first step where all are, rank 0's plan is
       broadcast over the host group (every rank computes the same plan from the same summed load; the broadcast
       makes that so whatever the floats) and the layers whose placement changes are queued;
    3. that step and the next ones each move the weights of at most ``layers_per_step`` queued layers
       (``move_experts``) and switch those layers to their new placement at once, loading their tables in place.

    Every decision is taken at the same step on every rank, so the ranks switch each layer at the same step, and a
    layer's weights and its dispatch tables change together, between two steps. A step reaching the interval while
    a rebalance is under way starts none. When computing the placement fails on any rank, every rank drops that
    rebalance at the same step (``failed`` counts them), logs a warning and keeps serving on its placement.
    """

    def __init__(
        self,
        model: Any,
        *,
        window_size: int,
        step_interval: int | None,
        num_nodes: int = 1,
        layers_per_step: int | None = 1,
    ):
        self.model = model
        self.layers: list[Any] = model.moe_layers()
        ep: ExpertParallel = model.ep
        self.rank, self.group, self.world = ep.rank, ep.group, ep.world_size
        self.num_experts = model.cfg.n_routed_experts
        self.num_physical = len(phy2log_of(ep.placement))
        # the router's expert groups (DeepSeek-V4 has no group-limited routing)
        self.num_groups, self.num_nodes = getattr(model.cfg, "n_group", None) or 1, num_nodes
        self.window_size, self.step_interval = window_size, step_interval
        self.layers_per_step = layers_per_step
        shape = (len(self.layers), self.num_experts)
        self.current = torch.zeros(shape, dtype=torch.int64, device=model.device)  # the step being counted
        self.window = torch.zeros((window_size, *shape), dtype=torch.int64, device=model.device)
        self._slots = [_TableSlot(i) for i in range(len(self.layers))]
        for i, ffn in enumerate(self.layers):
            ffn.load = self.current[i]
            if self.world > 1:
                ffn.ep = ExpertParallel(replace(ffn.ep.placement, table_slot=self._slots[i]), ffn.ep.rank, ffn.ep.group)
        self.sync = None
        if self.world > 1:
            from .parallel import RankSync

            self.sync = RankSync(self.group, model.device)
        self._executor: ThreadPoolExecutor | None = None
        self._plan: Future | None = None  # the placement being computed off the step loop
        self._queue: list[tuple[int, ExpertPlacement]] = []  # (layer, new placement) still to apply
        self.steps = 0
        self.rebalances = 0  # rebalances completed (over several ranks: every layer switched)
        self.moved = 0  # expert copies this rank received from other ranks, over every rebalance
        self.failed = 0  # rebalances dropped because computing the placement failed on some rank

    @property
    def placements(self) -> list[ExpertPlacement]:
        """The placement of each MoE layer now."""
        return [ffn.ep.placement for ffn in self.layers]

    @property
    def in_progress(self) -> bool:
        """Whether a rebalance has started and not every layer has switched yet."""
        return self._plan is not None or bool(self._queue)

    def reset(self) -> None:
        """Forgets every count (after CUDA-graph capture, whose warm-up forwards count too)."""
        self.current.zero_()
        self.window.zero_()
        self.steps = 0

    def end_step(self) -> None:
        """Moves the step's counts into the window (device work only) and advances the rebalance: starts one when
        ``step_interval`` steps have passed since the last start, polls the placement being computed, or applies
        the next layers (see the class's doc)."""
        self.window[self.steps % self.window_size].copy_(self.current)
        self.current.zero_()
        self.steps += 1
        if self._queue:
            self._apply(self.layers_per_step)
        elif self._plan is not None:
            agreed = self.sync.min_int(self._plan_status())
            if agreed == 1:
                self._queue_plan()
                self._apply(self.layers_per_step)
            elif agreed < 0:
                self._drop_plan()
        elif self.step_interval and self.steps % self.step_interval == 0:
            if self.world == 1:
                self.rebalances += 1  # one process holding every expert once has nothing to move
            else:
                self._start()

    def expert_load(self) -> torch.Tensor:
        """``[moe layers, E]`` int64 on the host: tokens routed to each logical expert over the window, summed over
        the ranks (an all-reduce over several ranks). Waits for the device."""
        load = self.window.sum(0)
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(load, group=self.group)
        return load.cpu()

    def _previous(self) -> torch.Tensor:
        return torch.tensor([phy2log_of(p) for p in self.placements], dtype=torch.int64)

    def _plan_of(self, load: torch.Tensor, event: Any, previous: torch.Tensor) -> Rebalanced:
        if event is not None:
            event.synchronize()
        return rebalance_experts(
            load, self.num_physical, self.num_groups, self.num_nodes, self.world, previous=previous
        )

    def _start(self) -> None:
        """Step 1 of a rebalance: the windows' sum started, its placement handed to the worker thread."""
        import torch.distributed as dist

        load = self.window.sum(0)
        # on a device the reduction is queued on its stream and the host does not wait; on the CPU it is a host
        # collective of a few KB
        dist.all_reduce(load, group=self.group)
        host, event = load, None
        if load.device.type != "cpu":
            host = torch.empty(load.shape, dtype=load.dtype, pin_memory=True)
            host.copy_(load, non_blocking=True)
            event = torch.Event(device=load.device)
            event.record()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eplb")
        self._plan = self._executor.submit(self._plan_of, host, event, self._previous())

    def _plan_status(self) -> int:
        """This rank's placement: 0 still being computed, 1 ready, -1 failed (the smallest over the ranks wins)."""
        if not self._plan.done():
            return 0
        return -1 if self._plan.exception() is not None else 1

    def _drop_plan(self) -> None:
        """Some rank failed to compute the placement: every rank drops this rebalance at the same step and keeps
        serving on the placement it has (the failing rank logs why)."""
        error = self._plan.exception() if self._plan.done() else None
        if error is not None:
            log.warning("expert rebalance dropped: computing the placement failed: %r", error, exc_info=error)
        else:
            log.warning("expert rebalance dropped: computing the placement failed on another rank")
        self._plan = None
        self.failed += 1

    def _queue_plan(self, plan: Rebalanced | None = None) -> None:
        """Step 2: the plan (the thread's, waiting for it if not done; or ``plan``) made rank 0's, and the layers
        whose placement changes queued."""
        import torch.distributed as dist

        if plan is None:
            plan, self._plan = self._plan.result(), None
        phy2log = plan.phy2log.to(self.sync.device)
        dist.broadcast(phy2log, self.sync.src, group=self.sync.group)  # one plan, whatever the floats
        for i, (ffn, row) in enumerate(zip(self.layers, phy2log.cpu())):
            new = placement_of(row, self.world, self.num_experts)
            if new != ffn.ep.placement:
                self._queue.append((i, replace(new, table_slot=self._slots[i])))
        if not self._queue:
            self.rebalances += 1

    def _apply(self, count: int | None) -> None:
        """Step 3: moves the weights of the next ``count`` queued layers (None: all) and switches them."""
        todo = self._queue if count is None else self._queue[:count]
        self._queue = self._queue[len(todo) :]
        for i, new in todo:
            ffn = self.layers[i]
            self.moved += move_experts(ffn, ffn.ep.placement, new, self.rank, self.group)
            ffn.ep = ExpertParallel(new, self.rank, self.group)
            load_placement_tables(new, self.model.device)
        if todo and not self._queue:
            self.rebalances += 1

    def rebalance(self) -> bool:
        """Re-places every layer's experts now, from the load over the window, and moves the weights that change
        rank, all before returning (a rebalance under way is completed first). Returns whether any placement
        changed. CUDA graphs need nothing: the layers' dispatch tables are rewritten in place. One process holding
        every expert once has nothing to move. A collective: every rank calls it at the same point."""
        if self.world == 1:
            self.rebalances += 1
            return False
        if self._plan is not None:
            self._plan.exception()  # waits for it
            if self.sync.min_int(self._plan_status()) == 1:
                self._queue_plan()
            else:
                self._drop_plan()
        changed = bool(self._queue)
        self._apply(None)  # the rebalance under way
        load = self.expert_load()
        self._queue_plan(self._plan_of(load, None, self._previous()))
        changed = changed or bool(self._queue)
        self._apply(None)
        return changed

    def balancedness(self) -> list[float]:
        """Per MoE layer, mean / max of the ranks' expected loads under the current placement and the window's load
        (1.0: perfectly balanced). A collective over several ranks (``expert_load``)."""
        load = self.expert_load()
        out = []
        for p, row in zip(self.placements, load):
            ranks = rank_loads(phy2log_of(p), row, self.world)
            out.append(sum(ranks) / len(ranks) / max(ranks) if max(ranks) > 0 else 1.0)
        return out


def _stacks(ffn: Any) -> list[torch.Tensor]:
    """The tensors of a layer's routed experts, each ``[E_local, ...]`` (FP8 and packed FP4: data and scales)."""
    out = []
    for w in (ffn.w13, ffn.w2):
        out += [w.data, w.scale] if isinstance(w, (QTensor, FP4Tensor)) else [w]
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def move_experts(ffn: Any, old: ExpertPlacement, new: ExpertPlacement, rank: int, group: Any) -> int:
    """Rewrites this rank's expert weights of ``ffn`` in place from placement ``old`` to ``new`` (the same slots per
    rank). A slot keeping its expert is untouched; an expert this rank held in another slot is copied locally; any
    other comes from a rank holding it under ``old`` (holder ``(dst + slot) % copies``, spreading the sends), by
    point-to-point transfers of its bytes. Every rank enumerates the same transfers in the same order, so the sends
    and receives of each pair of ranks match. New slots are staged, so no old weight is overwritten before it is
    sent. A collective over ``group``; returns the copies this rank received."""
    import torch.distributed as dist

    stacks = _stacks(ffn)
    holders = old.expert_ranks
    mine_old, mine_new = old.local_experts[rank], new.local_experts[rank]
    changed = [i for i, e in enumerate(mine_new) if i >= len(mine_old) or mine_old[i] != e]
    staged = {i: [torch.empty(t.shape[1:], dtype=t.dtype, device=t.device) for t in stacks] for i in changed}
    ops, received = [], 0
    for dst, experts in enumerate(new.local_experts):
        for slot, e in enumerate(experts):
            if e in old.local_experts[dst]:
                continue  # kept or copied locally below
            src = holders[e][(dst + slot) % len(holders[e])]
            if src == rank:
                at = mine_old.index(e)
                ops += [dist.P2POp(dist.isend, _bytes(t[at]), group=group, group_peer=dst) for t in stacks]
            if dst == rank:
                ops += [dist.P2POp(dist.irecv, _bytes(b), group=group, group_peer=src) for b in staged[slot]]
                received += 1
    for i in changed:
        e = mine_new[i]
        if e in mine_old:
            for b, t in zip(staged[i], stacks):
                b.copy_(t[mine_old.index(e)])
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    for i in changed:
        for b, t in zip(staged[i], stacks):
            t[i].copy_(b)
    return received
