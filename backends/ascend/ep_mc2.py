"""Multi-rank ``ep_dispatch`` / ``ep_combine`` through torch_npu's MC2 operators (``npu_moe_distribute_dispatch_v2``
and ``npu_moe_distribute_combine_v2``, HCCL).

The operators' documented contract (op-plugin docs; Atlas A3 rules, which we assume the Ascend 950 follows) is
narrower than the core's, and the wiring closes the gap as follows (README "Multi-rank expert all-to-all"):

- **What travels.** Each token row is sent once per distinct expert it names, with ``quant_mode`` 0 (rows moved
  verbatim). Its bytes (bf16/fp16/fp32 values, or FP8 data followed by its fp32 scales) are bit-cast to bf16
  columns, followed by a metadata record bit-cast the same way: source rank, token index, the token's K original
  ids and its K fp32 routing weights. Columns are padded to a multiple of 32 and to at least 1024 (the documented
  H range is [1024, 8192]).
- **Order.** The docs group received rows by local expert (``expert_token_nums``) but do not define the order
  within one. The receiver sorts them by the metadata into the core's order (local expert, source rank, token,
  slot), keeps the mapping, and puts expert outputs back in the operator's order before ``combine_v2``.
- **-1 ids and repeated ids** (the operator takes neither): such a slot is sent to an unused expert id of the row
  (a dummy pair, dropped by the receiver, combined with scale 0). A token naming one expert twice is sent to it
  once; the receiver expands it into one row per slot (the original ids travel with it) and, at combine time,
  sends back the fp32 sum of its weighted rows with scale 1.
- **Batch size.** BS per call is at most ``DEEPINFER_ASCEND_MC2_MAX_BS`` (default 256, at most 512), and
  ``global_bs = max_bs * world`` is the same in every call (the docs require it to be the same in every layer).
  Larger batches go in rounds; a rank with nothing to send in a round sends one dummy token (BS must be > 0).
  ``normal`` mode learns the number of rounds from a one-integer all-reduce of T; ``low_latency`` derives it from
  ``capacity``, which the core requires to be the same on every rank.
- **Communicator.** The docs forbid other operators on the MC2 communicator, so the backend creates one
  communicator per expert-parallel group (the same ranks, ``new_group``) for the MC2 operators alone; the small
  exchanges above and any fallback use the caller's group. Its name comes from
  ``group._get_backend(device).get_hccl_comm_name(rank)``, the documented call.

Every decision to use MC2 is taken from arguments the core requires to be the same on every rank (world size,
expert count, placement, mode, capacity, hidden size, payload kind), plus k, assumed the same on every rank, so no
rank can take MC2 while another takes the reference collectives. The handles returned are the reference's
``NormalHandle`` / ``LowLatencyHandle`` filled from local information, so the reference ``ep_combine`` can take
over for expert outputs ``combine_v2`` cannot take (fp32, hidden size > 8192).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from deepinfer import Decline, QTensor
from deepinfer.ops import ExpertLayout
from deepinfer.ops.moe import ExpertPlacement
from deepinfer.reference import ep as ep_ref

from . import probe

MAX_BS_ENV = "DEEPINFER_ASCEND_MC2_MAX_BS"
DEFAULT_MAX_BS = 256
BUFFER_ENV = "HCCL_BUFFSIZE"  # MB per communicator (CANN); 200 when unset
DEFAULT_BUFFER_MB = 200

# Documented ranges (A3; dispatch_v2 and combine_v2 give the same ones from torch_npu 7.2.0 on).
BS_LIMIT = 512
K_LIMIT = 16
WORLD_RANGE = (2, 768)
EXPERT_LIMIT = 1024
H_MIN, H_MAX_DISPATCH, H_MAX_COMBINE = 1024, 8192, 8192
_INF = torch.iinfo(torch.int64).max


def max_bs() -> int:
    """Tokens per rank per MC2 call (``DEEPINFER_ASCEND_MC2_MAX_BS``, default 256); 0 if the setting is invalid."""
    raw = os.environ.get(MAX_BS_ENV, "")
    try:
        value = int(raw) if raw else DEFAULT_MAX_BS
    except ValueError:
        return 0
    return value if 0 < value <= BS_LIMIT else 0


def buffer_bytes() -> int:
    """The HCCL buffer of one communicator, from ``HCCL_BUFFSIZE`` (MB; 200 when unset)."""
    try:
        return int(os.environ.get(BUFFER_ENV, DEFAULT_BUFFER_MB)) * 2**20
    except ValueError:
        return 0


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def buffer_bytes_needed(local_experts: int, bs: int, world: int, columns: int, k: int) -> int:
    """The docs' A3 lower bound on ``HCCL_BUFFSIZE`` (``comm_alg`` "" / fullmesh_v1, no shared experts) for rows of
    ``columns`` 16-bit values: ``2 * (local * max_bs * world * Align512(Align32(2H) + 64) + K * max_bs *
    Align512(2H))`` bytes. Assumption: the formula's H counts 16-bit elements (its ``2 * H`` is bytes)."""
    row = _align(_align(2 * columns, 32) + 64, 512)
    return 2 * (local_experts * bs * world * row + k * bs * _align(2 * columns, 512))


# ---------------------------------------------------------------------------------------------------------------
# rows on the wire


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t [n, m]`` as ``[n, m * itemsize]`` uint8."""
    if t.numel() == 0:
        return torch.empty(t.shape[0], t.shape[-1] * t.element_size(), dtype=torch.uint8, device=t.device)
    return t.contiguous().view(torch.uint8)


def _as(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``raw [n, b]`` uint8 viewed as ``[n, b / itemsize]`` of ``dtype``."""
    if raw.numel() == 0:
        return torch.empty(raw.shape[0], raw.shape[1] // dtype.itemsize, dtype=dtype, device=raw.device)
    return raw.contiguous().view(dtype)


@dataclass(frozen=True)
class _Wire:
    """The byte layout of one row: payload parts side by side, then the metadata record (int32: source rank,
    token, K ids, K weight bits), padded; carried as ``columns`` bf16 values."""

    parts: tuple[tuple[torch.dtype, int], ...]
    block: tuple[int, int] | None
    scale_format: str
    k: int
    meta_at: int
    total: int

    @staticmethod
    def of(x, k: int) -> _Wire:
        if isinstance(x, QTensor):
            parts = ((x.data.dtype, x.data.shape[-1]), (x.scale.dtype, x.scale.shape[-1]))
            block, fmt = x.block, x.scale_format
        else:
            parts, block, fmt = ((x.dtype, x.shape[-1]),), None, "fp32"
        payload = sum(dtype.itemsize * n for dtype, n in parts)
        meta_at = _align(payload, 4)
        total = max(_align(meta_at + 4 * (2 + 2 * k), 64), 2 * H_MIN)  # columns: a multiple of 32, >= 1024
        return _Wire(parts, block, fmt, k, meta_at, total)

    @property
    def columns(self) -> int:
        return self.total // 2

    def pack(self, x, ids: torch.Tensor, weights: torch.Tensor, rank: int) -> torch.Tensor:
        """``[T, columns]`` bf16 rows: payload bytes and the metadata of each token."""
        tokens, dev = ids.shape[0], ids.device
        buf = torch.zeros(tokens, self.total, dtype=torch.uint8, device=dev)
        at = 0
        for t in (x.data, x.scale) if isinstance(x, QTensor) else (x,):
            b = _bytes(t)
            buf[:, at : at + b.shape[1]] = b
            at += b.shape[1]
        meta = torch.empty(tokens, 2 + 2 * self.k, dtype=torch.int32, device=dev)
        meta[:, 0] = rank
        meta[:, 1] = torch.arange(tokens, dtype=torch.int32, device=dev)
        meta[:, 2 : 2 + self.k] = ids
        meta[:, 2 + self.k :] = _as(_bytes(weights.float()), torch.int32)
        buf[:, self.meta_at : self.meta_at + 4 * meta.shape[1]] = _bytes(meta)
        return _as(buf, torch.bfloat16)

    def dummy(self, rank: int, device) -> torch.Tensor:
        """One padding token (token index -1, no ids): sent when a rank has no token in a round."""
        ids = torch.full((1, self.k), -1, dtype=torch.int32, device=device)
        raw = _bytes(self.pack(self._zeros(1, device), ids, torch.zeros(1, self.k, device=device), rank)).clone()
        raw[:, self.meta_at + 4 : self.meta_at + 8] = _bytes(torch.full((1, 1), -1, dtype=torch.int32, device=device))
        return _as(raw, torch.bfloat16)

    def _zeros(self, rows: int, device):
        made = [torch.zeros(rows, n, device=device).to(dtype) for dtype, n in self.parts]
        return made[0] if self.block is None else QTensor(made[0], made[1], self.block, self.scale_format)

    def meta(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(source rank, token, ids [n, K], weights [n, K] fp32)`` from rows as bytes."""
        m = _as(raw[:, self.meta_at : self.meta_at + 4 * (2 + 2 * self.k)], torch.int32)
        return m[:, 0].long(), m[:, 1].long(), m[:, 2 : 2 + self.k], m[:, 2 + self.k :].contiguous().view(torch.float32)

    def payload(self, raw: torch.Tensor, lead: tuple[int, ...]):
        """The payload of rows given as bytes ``[prod(lead), total]``, shaped ``[*lead, ...]``."""
        out, at = [], 0
        for dtype, n in self.parts:
            width = dtype.itemsize * n
            out.append(_as(raw[:, at : at + width], dtype).reshape(*lead, n))
            at += width
        return out[0] if self.block is None else QTensor(out[0], out[1], self.block, self.scale_format)


def _mc2_ids(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the operator may take: ``(mc2_ids [T, K] int32, keep [T, K], multi [T, K])``. A slot keeps its id when it
    is valid and not a repeat of an earlier slot; others get the smallest ids unused in the row, so every row holds
    K distinct ids in ``[0, E)``. ``multi``: a kept slot whose expert the token names again later."""
    tokens, k = ids.shape
    if tokens == 0:
        empty = torch.zeros(0, k, dtype=torch.bool, device=ids.device)
        return ids.clone(), empty, empty
    e = ids.long()
    valid = e >= 0
    same = (e.unsqueeze(2) == e.unsqueeze(1)) & valid.unsqueeze(1) & valid.unsqueeze(2)  # [T, j, i]
    earlier = torch.ones(k, k, dtype=torch.bool, device=ids.device).tril(-1)  # i < j
    keep = valid & ~(same & earlier).any(-1)
    multi = keep & (same.sum(-1) > 1)
    used = torch.zeros(tokens, num_experts + 1, dtype=torch.bool, device=ids.device)
    used.scatter_(1, torch.where(keep, e, num_experts), True)
    free_cum = (~used[:, :num_experts]).long().cumsum(1)
    nth = (~keep).long().cumsum(1)  # 1-based rank of a replaced slot among the row's replaced slots
    dummy = torch.searchsorted(free_cum, nth.clamp_min(1).contiguous())
    return torch.where(keep, e, dummy).to(torch.int32), keep, multi


# ---------------------------------------------------------------------------------------------------------------
# communicator

_COMMUNICATORS: dict = {}


def _communicator(group, bs: int | None = None) -> str:
    """The HCCL name of the MC2 communicator of ``group`` for ``bs`` tokens per call (default: the setting): a
    communicator over the same ranks that only the MC2 operators use, created on first use (every rank of the group
    gets here in the same call). The docs require ``global_bs`` to be the same in every call on a communicator, so a
    changed ``DEEPINFER_ASCEND_MC2_MAX_BS`` gets a communicator of its own."""
    import torch.distributed as dist

    bs = max_bs() if bs is None else bs
    name = _COMMUNICATORS.get((group, bs))
    if name is None:
        ranks = dist.get_process_group_ranks(group)
        mc2 = dist.new_group(ranks=ranks, backend=probe.collective_backend(), use_local_synchronization=True)
        name = mc2._get_backend(torch.device(probe.device_type())).get_hccl_comm_name(dist.get_rank())
        _COMMUNICATORS[(group, bs)] = name
    return name


# ---------------------------------------------------------------------------------------------------------------
# handles


@dataclass
class _Round:
    """One MC2 call: what combine_v2 needs back, and which source tokens it carried."""

    ids: torch.Tensor
    scales: torch.Tensor
    assist: torch.Tensor
    ep_recv_counts: torch.Tensor
    tp_recv_counts: torch.Tensor | None
    tokens: tuple[int, int]


@dataclass
class _Mc2State:
    """For the MC2 combine. Received operator rows are indexed flat over the rounds (``n = rounds * A``).
    first_dest [n]: layout row of a row's first placed slot; has_first [n]; multi [n]: the row stands for several
    slots; dest / placed / weights [n, K]: layout row, placed or not, weight of each slot; lost [n]: a slot of the
    row was not delivered (low_latency overflow), or None; any_multi: host bool when known."""

    name: str
    world: int
    rank: int
    num_experts: int
    global_bs: int
    rows_per_round: int
    layout_rows: int
    rounds: list[_Round]
    first_dest: torch.Tensor
    has_first: torch.Tensor
    multi: torch.Tensor
    dest: torch.Tensor
    placed: torch.Tensor
    weights: torch.Tensor
    lost: torch.Tensor | None
    any_multi: bool | None


@dataclass
class Mc2NormalHandle(ep_ref.NormalHandle):
    """``normal`` mode through MC2; a complete reference ``NormalHandle`` too."""

    mc2: _Mc2State | None = field(default=None, kw_only=True)


@dataclass
class Mc2LowLatencyHandle(ep_ref.LowLatencyHandle):
    """``low_latency`` mode through MC2; a complete reference ``LowLatencyHandle`` too."""

    mc2: _Mc2State | None = field(default=None, kw_only=True)


# ---------------------------------------------------------------------------------------------------------------
# ep_dispatch


def _group_world(group) -> int:
    if group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(group)


def ep_dispatch_mc2_supports(x, ids, weights, *, num_experts, group, mode, capacity, placement) -> bool | Decline:
    """MC2 runs for a group of 2 to 768 ranks on a chip with the ``ep_mc2`` capability, the contiguous placement
    with E a multiple of the world size and E <= 1024, 0 < k <= 16, rows of at most 8192 columns on the wire and an
    HCCL buffer the docs' formula accepts. Only arguments the same on every rank are read."""
    world = _group_world(group)
    if not WORLD_RANGE[0] <= world <= WORLD_RANGE[1]:
        return Decline(f"group of {world} ranks, expected {WORLD_RANGE[0]} to {WORLD_RANGE[1]}")
    import torch.distributed as dist

    k = ids.shape[1]
    bs = max_bs()
    if not (answer := probe.placed(x=x, ids=ids, weights=weights)) or not (answer := probe.capable("ep_mc2")):
        return answer
    if dist.get_backend(group) != probe.collective_backend():
        return Decline(f"group's backend is {dist.get_backend(group)}, expected {probe.collective_backend()}")
    if num_experts > EXPERT_LIMIT or num_experts % world:
        return Decline(f"num_experts {num_experts}: more than {EXPERT_LIMIT} or not a multiple of {world} ranks")
    if not 0 < k <= min(K_LIMIT, num_experts):
        return Decline(f"ids has {k} experts per token, expected 1 to {min(K_LIMIT, num_experts)}")
    if bs <= 0:
        return Decline(f"{MAX_BS_ENV} gives no rows per rank")
    if placement != ExpertPlacement.contiguous(num_experts, world):
        return Decline("placement is not the contiguous one")
    wire = _Wire.of(x, k)
    if wire.columns > H_MAX_DISPATCH:
        return Decline(f"x's rows take {wire.columns} columns on the wire > {H_MAX_DISPATCH}")
    if buffer_bytes() < buffer_bytes_needed(num_experts // world, bs, world, wire.columns, k):
        return Decline(f"the HCCL buffer ({BUFFER_ENV}) is smaller than the dispatch needs")
    return True


def ep_dispatch_mc2(x, ids, weights, *, num_experts, group, mode, capacity, placement) -> tuple:
    """``ep_dispatch`` over several ranks through ``npu_moe_distribute_dispatch_v2`` (see the module docstring)."""
    import torch.distributed as dist

    npu = probe.torch_npu()
    bs = max_bs()
    name = _communicator(group, bs)
    me, world = dist.get_rank(group), dist.get_world_size(group)
    tokens, k = ids.shape
    dev = ids.device
    wire = _Wire.of(x, k)
    if mode == "normal":
        t_max = torch.tensor([tokens], dtype=torch.int64, device=dev)
        dist.all_reduce(t_max, op=dist.ReduceOp.MAX, group=group)
        rounds = -(-int(t_max.item()) // bs)  # host synchronisation 1
    else:
        rounds = -(-capacity // bs)
    global_bs = bs * world

    # Source side: rows on the wire, the ids the operator may take, combine scales.
    wire_rows = wire.pack(x, ids, weights, me)
    mc2_ids, keep, multi_src = _mc2_ids(ids, num_experts)
    scales = torch.where(multi_src, 1.0, torch.where(keep, weights, 0.0)).float()
    plan: list[_Round] = []
    received: list[tuple[torch.Tensor, torch.Tensor]] = []
    for r in range(rounds):
        a, b = min(r * bs, tokens), min((r + 1) * bs, tokens)
        if b > a:
            send, send_ids, send_scales = wire_rows[a:b], mc2_ids[a:b].contiguous(), scales[a:b].contiguous()
        else:  # BS must be > 0: one padding token to k distinct experts, dropped by the receivers
            send = wire.dummy(me, dev)
            send_ids = torch.arange(k, dtype=torch.int32, device=dev).view(1, k)
            send_scales = torch.zeros(1, k, dtype=torch.float32, device=dev)
        expand_x, _, assist, counts, ep_recv, tp_recv, _ = npu.npu_moe_distribute_dispatch_v2(
            send,
            send_ids,
            name,
            world,
            me,
            num_experts,
            quant_mode=0,  # rows move verbatim (assumption: bit-exact, whatever the bf16 bit patterns)
            global_bs=global_bs,
            expert_token_nums_type=1,  # counts per local expert
            shared_expert_num=0,
            shared_expert_rank_num=0,
        )
        plan.append(_Round(send_ids, send_scales, assist, ep_recv, tp_recv, (a, b)))
        received.append((expand_x.contiguous(), counts.to(dev).long()))

    if mode == "normal":
        return _finish_normal(x, ids, weights, wire, received, plan, group, name, me, world, num_experts, bs)
    return _finish_low_latency(x, ids, wire, received, plan, group, name, me, world, num_experts, bs, capacity)


def _received_slots(wire: _Wire, received, me: int, world: int, num_experts: int, token_cap: int):
    """The received rows of all rounds as bytes ``[n, total]`` and, per (row, slot), whether it is a pair of a local
    expert and its sort key in the core's order (local expert, source rank, token, slot)."""
    local, k = num_experts // world, wire.k
    raw = torch.cat([_bytes(ex) for ex, _ in received])
    per_round = received[0][0].shape[0]
    dev = raw.device
    pos = torch.arange(per_round, device=dev)
    counts = torch.stack([c for _, c in received])  # [R, local]
    # Assumption (docs: expert_token_nums; vllm-ascend feeds expand_x to grouped matmul as is): the first
    # sum(counts) rows are grouped by local expert in ascending order. Rows past that are undefined: never read.
    valid = (pos.unsqueeze(0) < counts.sum(1, keepdim=True)).flatten()
    expert = torch.searchsorted(counts.cumsum(1), pos.expand(len(received), -1).contiguous(), right=True)
    expert = expert.clamp(max=local - 1).flatten()
    src, tok, oids, ow = wire.meta(raw)
    src = torch.where(valid, src, 0).clamp(0, world - 1)
    tok = torch.where(valid, tok, -1)
    glob = me * local + expert
    match = valid.unsqueeze(1) & (tok >= 0).unsqueeze(1) & (oids.long() == glob.unsqueeze(1))  # [n, K]
    slot = torch.arange(k, device=dev)
    key = ((expert * world + src) * token_cap + tok.clamp_min(0)).unsqueeze(1) * k + slot
    key = torch.where(match, key, _INF)
    ow = torch.where(match, ow, 0.0)
    return raw, expert, src, tok, glob, match, key, ow


def _layout_rank(key: torch.Tensor) -> torch.Tensor:
    """Each (row, slot)'s position in ascending key order (matched ones first)."""
    order = key.flatten().sort().indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=key.device)
    return rank.view(key.shape)


def _first_and_multi(dest: torch.Tensor, placed: torch.Tensor, match: torch.Tensor, scratch: int):
    first_j = placed.long().argmax(1, keepdim=True)
    has_first = placed.any(1)
    first_dest = torch.where(has_first, dest.gather(1, first_j).squeeze(1), scratch)
    return first_dest, has_first, match.sum(1) > 1


def _fill_layout(raw, glob, ow, dest, placed, size: int, k: int):
    """Row of origin and slot of each layout row (``size`` rows), by scattering every placed (row, slot)."""
    n, dev = raw.shape[0], raw.device
    row_of = torch.full((size + 1,), -1, dtype=torch.int64, device=dev)
    slot_of = torch.zeros(size + 1, dtype=torch.int64, device=dev)
    rows = torch.arange(n, device=dev)
    for j in range(k):
        at = torch.where(placed[:, j], dest[:, j], size)
        row_of.index_copy_(0, at, rows)
        slot_of.index_copy_(0, at, torch.full_like(rows, j))
    row_of, slot_of = row_of[:size], slot_of[:size]
    used = row_of >= 0
    take = row_of.clamp_min(0)
    recv_raw = raw[take]
    recv_ids = torch.where(used, glob[take], -1).to(torch.int32)
    recv_w = torch.where(used, ow[take, slot_of], 0.0)
    return recv_raw, recv_ids, recv_w


def _empty(wire: _Wire, lead: tuple[int, ...], device):
    raw = torch.zeros(math.prod(lead), wire.total, dtype=torch.uint8, device=device)
    return (
        wire.payload(raw, lead),
        torch.full(lead, -1, dtype=torch.int32, device=device),
        torch.zeros(lead, dtype=torch.float32, device=device),
    )


def _finish_normal(x, ids, weights, wire, received, plan, group, name, me, world, num_experts, bs):
    tokens, k = ids.shape
    dev, local = ids.device, num_experts // world
    valid = ids >= 0
    dest_rank = torch.where(valid, ids.long() // local, 0)
    send_per_dest = torch.zeros(world, dtype=torch.int64, device=dev).index_add_(
        0, dest_rank.flatten(), valid.flatten().long()
    )
    if received:
        raw, expert, src, tok, glob, match, key, ow = _received_slots(
            wire, received, me, world, num_experts, len(plan) * bs
        )
        per_src = torch.zeros(world, dtype=torch.int64, device=dev).index_add_(0, src, match.sum(1))
        per_expert = torch.zeros(local, dtype=torch.int64, device=dev).index_add_(0, expert, match.sum(1))
        multi_rows = match.sum(1) > 1
        host = torch.cat([match.sum().view(1), multi_rows.any().view(1).long(), per_src, send_per_dest]).cpu()
    else:
        per_expert = torch.zeros(local, dtype=torch.int64, device=dev)
        host = torch.cat([torch.zeros(2, dtype=torch.int64, device=dev), torch.zeros_like(send_per_dest),
                          send_per_dest]).cpu()  # fmt: skip
    # host synchronisation 2: rows received, whether a token named an expert twice, exchange sizes
    num_recv, any_multi = int(host[0]), bool(host[1])
    recv_splits, send_splits = host[2 : 2 + world].tolist(), host[2 + world :].tolist()
    offsets = torch.zeros(local + 1, dtype=torch.int32, device=dev)
    offsets[1:] = per_expert.cumsum(0).to(torch.int32)

    if received:
        dest = torch.where(match, _layout_rank(key), num_recv)
        recv_raw, recv_ids, recv_w = _fill_layout(raw, glob, ow, dest, match, num_recv, k)
        recv_x = wire.payload(recv_raw, (num_recv,))
        # Reference-handle order of received rows: by (source rank, local expert, token, slot).
        key2 = ((src * local + expert) * (len(plan) * bs) + tok.clamp_min(0)).unsqueeze(1) * k + torch.arange(
            k, device=dev
        )
        by_source = torch.full((num_recv + 1,), _INF, dtype=torch.int64, device=dev)
        by_source.index_copy_(0, dest.flatten(), torch.where(match, key2, _INF).flatten())
        final = by_source[:num_recv].sort().indices
        first_dest, has_first, multi = _first_and_multi(dest, match, match, num_recv)
    else:
        recv_x, recv_ids, recv_w = _empty(wire, (0,), dev)
        final = torch.zeros(0, dtype=torch.int64, device=dev)
        dest = match = ow = torch.zeros(0, k, device=dev)
        first_dest = has_first = multi = torch.zeros(0, device=dev)

    # Source side of the reference handle: pairs in (destination, local expert, token, slot) order.
    num_sent = int(sum(send_splits))
    pair = torch.arange(tokens * k, device=dev)
    send_key = torch.where(valid.flatten(), ids.flatten().long() * max(tokens, 1) * k + pair, _INF)
    order = send_key.sort().indices[:num_sent]
    pair_pos = torch.full((tokens * k,), num_sent, dtype=torch.int64, device=dev)
    pair_pos[order] = torch.arange(num_sent, device=dev)
    state = _Mc2State(
        name, world, me, num_experts, bs * world, received[0][0].shape[0] if received else 0, num_recv, plan,
        first_dest, has_first, multi, dest, match, ow, None, any_multi,
    )  # fmt: skip
    handle = Mc2NormalHandle(
        tokens,
        "normal",
        (num_recv,),
        group=group,
        send_splits=list(send_splits),
        recv_splits=list(recv_splits),
        final=final,
        pair_pos=pair_pos.view(tokens, k),
        weights=torch.where(valid, weights, 0.0),
        num_sent=num_sent,
        mc2=state,
    )
    return recv_x, recv_ids, recv_w, ExpertLayout(expert_offsets=offsets), handle


def _finish_low_latency(x, ids, wire, received, plan, group, name, me, world, num_experts, bs, capacity):
    import torch.distributed as dist

    tokens, k = ids.shape
    dev, local = ids.device, num_experts // world
    max_m = world * capacity
    lead = (local, max_m)
    size = local * max_m
    slots = world * capacity
    if not received:  # capacity 0: nobody has a token
        recv_x, recv_ids, recv_w = _empty(wire, lead, dev)
        masked = torch.zeros(local, dtype=torch.int32, device=dev)
        zeros = torch.zeros(slots, k, device=dev)
        state = _Mc2State(
            name, world, me, num_experts, bs * world, 0, size, plan, zeros[:, 0].long(), zeros[:, 0].bool(),
            zeros[:, 0].bool(), zeros.long(), zeros.bool(), zeros, None, False,
        )  # fmt: skip
        handle = Mc2LowLatencyHandle(
            tokens, "low_latency", lead, overflow=torch.zeros((), dtype=torch.bool, device=dev), group=group,
            capacity=capacity, rows=zeros.long(), mine=zeros.bool(), weights=zeros,
            lost=torch.zeros(tokens, dtype=torch.bool, device=dev), mc2=state,
        )  # fmt: skip
        return recv_x, recv_ids, recv_w, ExpertLayout(masked_m=masked), handle

    raw, expert, src, tok, glob, match, key, ow = _received_slots(wire, received, me, world, num_experts, slots)
    per_expert = torch.zeros(local, dtype=torch.int64, device=dev).index_add_(0, expert, match.sum(1))
    start = per_expert.cumsum(0) - per_expert
    pos = _layout_rank(key) - start[expert].unsqueeze(1)
    placed = match & (pos < max_m)
    lost_slot = match & ~placed
    dest = torch.where(placed, expert.unsqueeze(1) * max_m + pos, size)
    recv_raw, recv_ids, recv_w = _fill_layout(raw, glob, ow, dest, placed, size, k)
    masked = per_expert.clamp(max=max_m).to(torch.int32)
    overflow = lost_slot.any().to(torch.int32).view(1)
    dist.all_reduce(overflow, op=dist.ReduceOp.MAX, group=group)  # fixed size, no host synchronisation
    first_dest, has_first, multi = _first_and_multi(dest, placed, match, size)

    # The reference handle: per gathered (source rank, token) slot and k, the layout row; a lost pair is held
    # here with a NaN weight, so its source token comes back NaN as the contract says.
    flat = torch.where(match, (src * capacity + tok.clamp_min(0)).unsqueeze(1) * k + torch.arange(k, device=dev),
                       slots * k)  # fmt: skip
    rows_t = torch.zeros(slots * k + 1, dtype=torch.int64, device=dev)
    rows_t.index_copy_(0, flat.flatten(), torch.where(placed, dest, 0).flatten())
    mine_t = torch.zeros(slots * k + 1, dtype=torch.bool, device=dev)
    mine_t.index_copy_(0, flat.flatten(), match.flatten())
    w_t = torch.zeros(slots * k + 1, dtype=torch.float32, device=dev)
    w_t.index_copy_(0, flat.flatten(), torch.where(lost_slot, float("nan"), ow).flatten())
    state = _Mc2State(
        name, world, me, num_experts, bs * world, received[0][0].shape[0], size, plan, first_dest, has_first,
        multi, dest, placed, ow, lost_slot.any(1), None,
    )  # fmt: skip
    handle = Mc2LowLatencyHandle(
        tokens,
        "low_latency",
        lead,
        overflow=overflow[0] > 0,
        group=group,
        capacity=capacity,
        rows=rows_t[:-1].view(slots, k),
        mine=mine_t[:-1].view(slots, k),
        weights=w_t[:-1].view(slots, k),
        lost=torch.zeros(tokens, dtype=torch.bool, device=dev),
        mc2=state,
    )
    recv_x = wire.payload(recv_raw, lead)
    return recv_x, recv_ids.view(lead), recv_w.view(lead), ExpertLayout(masked_m=masked), handle


# ---------------------------------------------------------------------------------------------------------------
# ep_combine


def ep_combine_mc2_supports(y, handle) -> bool | Decline:
    """The handle came from the MC2 dispatch and ``combine_v2`` takes these rows: bf16/fp16, hidden size <= 8192
    (smaller ones are zero-padded to 1024), an HCCL buffer the docs' formula accepts."""
    if not isinstance(handle, (Mc2NormalHandle, Mc2LowLatencyHandle)) or handle.mc2 is None:
        return Decline("handle did not come from the MC2 dispatch")
    st = handle.mc2
    columns = max(y.shape[-1], H_MIN)
    k = st.dest.shape[1] if st.dest.dim() == 2 else 1
    if not (answer := probe.placed(y=y)):
        return answer
    if y.dtype not in (torch.bfloat16, torch.float16):
        return Decline(f"y is {y.dtype}, expected bfloat16 or float16")
    if y.shape[-1] > H_MAX_COMBINE:
        return Decline(f"y's rows of {y.shape[-1]} > {H_MAX_COMBINE}")
    if buffer_bytes() < buffer_bytes_needed(st.num_experts // st.world, st.global_bs // st.world, st.world, columns, k):
        return Decline(f"the HCCL buffer ({BUFFER_ENV}) is smaller than the combine needs")
    return True


def ep_combine_mc2(y, handle) -> torch.Tensor:
    """``ep_combine`` through ``npu_moe_distribute_combine_v2``: expert outputs go back into the operator's row
    order (a token that named an expert twice sends the fp32 sum of its weighted rows, with scale 1; a lost row
    sends NaN), zero-padded to 1024 columns when narrower, one call per dispatch round."""
    st = handle.mc2
    hidden, dev = y.shape[-1], y.device
    out = torch.zeros(handle.num_tokens, hidden, dtype=y.dtype, device=dev)
    if not st.rounds:
        return out
    npu = probe.torch_npu()
    flat = y.reshape(-1, hidden)

    def take(index: torch.Tensor) -> torch.Tensor:
        if flat.shape[0] == 0:
            return torch.zeros(index.shape[0], hidden, dtype=y.dtype, device=dev)
        return flat[index.clamp(0, flat.shape[0] - 1)]

    rows = torch.where(st.has_first.unsqueeze(1), take(st.first_dest), 0)
    if st.any_multi is None or st.any_multi:  # low_latency cannot know without a host synchronisation
        acc = torch.zeros(rows.shape[0], hidden, dtype=torch.float32, device=dev)
        for j in range(st.dest.shape[1]):
            picked = torch.where(st.placed[:, j : j + 1], take(st.dest[:, j]), 0)
            acc += picked * st.weights[:, j : j + 1]
        rows = torch.where(st.multi.unsqueeze(1), acc.to(y.dtype), rows)
    if st.lost is not None:
        rows = torch.where(st.lost.unsqueeze(1), torch.full((), float("nan"), dtype=y.dtype, device=dev), rows)
    if hidden < H_MIN:
        rows = torch.nn.functional.pad(rows, (0, H_MIN - hidden))
    per = st.rows_per_round
    for r, rd in enumerate(st.rounds):
        part = npu.npu_moe_distribute_combine_v2(
            rows[r * per : (r + 1) * per].contiguous(),
            rd.ids,
            rd.assist,
            rd.ep_recv_counts,
            rd.scales,
            st.name,
            st.world,
            st.rank,
            st.num_experts,
            tp_send_counts=rd.tp_recv_counts,
            shared_expert_num=0,
            shared_expert_rank_num=0,
            global_bs=st.global_bs,
        )
        a, b = rd.tokens
        if b > a:
            out[a:b] = part[: b - a, :hidden]
    return out
