"""Reference ``ep_dispatch`` / ``ep_combine`` across the ranks of a ``torch.distributed`` process group.

Everything crosses ranks through ``torch.distributed`` collectives (``all_to_all_single``, ``all_gather_single``),
so the same code runs over Gloo (CPU), NCCL (CUDA) or any backend that implements them. Rows travel as raw bits
(an FP8 row carries its scales in the same row), viewed as the widest integer word (``int64``, ``int32`` or
``uint8``) that divides the row's parts, so the collective needs no support for bf16 or float8 dtypes and the row
gathers move whole words. Index work runs on the device of the inputs.

normal mode
    1. Each pair gets its destination (rank, local expert) from the placement. A token travels once to each rank
       that holds any of its experts (one "copy" per (token, rank)), however many of its pairs go there, with a
       record of them: per slot, the local expert (-1 where the pair goes elsewhere), the weight, and the pair's
       rank among the pairs for its (destination, local expert) and among those for its destination, both in
       (token, slot) order. One ``all_to_all_single`` exchanges the pair counts per (destination, local expert)
       and the copy counts per destination; while it runs the device packs the copies with their records in send
       order (destination, token); then the host reads the counts (the one synchronisation).
    2. One ``all_to_all_single`` moves the copies. From the counts each receiver knows where every source's pairs
       of each local expert start in the contiguous layout (local expert, source rank, token, slot); a pair's
       rank puts its row there, copied from its copy.
    3. ``ep_combine`` sums on each rank, per received copy, ``weight * row`` over the copy's pairs in fp32, and one
       ``all_to_all_single`` returns those partial sums to the sources, which add them in fp32 (the copies cross
       in the reverse direction of step 2: at EP=2 with top-8 that is half the bytes of one bf16 row per pair).
       In batch-invariant mode, or where fp32 partial sums could be more bytes than the pair rows, each output row
       goes back to its source instead, in receive order (source, token, slot), and the source sums ``weight *
       row`` over the k slots with the arithmetic of the one-process reference (``sums_per_rank`` decides). A
       backend may pass a fused kernel for the sums: ``combine_normal``'s ``weighted_sum``.
    A backend may replace the index work and row copies of steps 1 and 2 with its own kernels
    (``dispatch_normal``'s ``count`` / ``pack`` / ``unpack``); the exchanges stay here.

low_latency mode
    Every rank places its tokens (payload, ids, weights) in ``capacity`` fixed rows and one ``all_gather_single``
    gives every rank the whole routing. Each rank computes the same destination and slot for every pair of every
    rank (so capacity overflow is known everywhere alike) and scatters its own pairs into ``[E_local, world *
    capacity, H]`` (a backend may do that with its own kernels: ``dispatch_low_latency``'s ``place``).
    ``ep_combine`` sums, per source token, the weighted rows of the local experts (fp32) and one
    ``all_to_all_single`` of fixed size returns those partial sums; the source adds them in rank order. In
    batch-invariant mode the exchange of fixed size returns each pair's row instead, and the source sums ``weight *
    row`` over the k slots with the arithmetic of the one-process reference. No host synchronisation and no
    data-dependent shape anywhere. One process runs the same code without the exchanges.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch

from ..dispatch import batch_invariant_enabled
from ..ops.moe import DispatchHandle, ExpertLayout, ExpertPlacement
from ..qtensor import QTensor


def group_rank_size(group) -> tuple[int, int]:
    """``(rank, world size)`` of ``group``; ``(0, 1)`` for None."""
    if group is None:
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


def weighted_rows_sum(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_j weights[t, j] * rows[t, j]`` in fp32: ``rows [T, k, H]`` (any float dtype, zero where a slot is
    unused), ``weights [T, k]`` fp32 (zero where unused). Each product is rounded to fp32, then the k products are
    summed in fp32; in batch-invariant mode strictly in slot order, one slot at a time, so a row's result cannot
    depend on how many rows are summed together."""
    products = rows * weights.unsqueeze(-1).float()
    if not batch_invariant_enabled():
        return products.sum(dim=1, dtype=torch.float32)
    out = torch.zeros(rows.shape[0], rows.shape[2], dtype=torch.float32, device=rows.device)
    for j in range(rows.shape[1]):
        out += products[:, j]
    return out


def weighted_gather_sum(rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> None:
    """``out[t] = sum_j weights[t, j] * rows[index[t, j]]`` over the slots with ``index >= 0`` (-1 adds nothing),
    with the arithmetic of ``weighted_rows_sum``, rounded to out's dtype: rows ``[R, H]``, index ``[T, k]`` int64,
    weights ``[T, k]`` fp32, out ``[T, H]``. The contract of ``combine_normal``'s ``weighted_sum``."""
    if rows.shape[0] == 0:
        out.zero_()
        return
    valid = index >= 0
    # Rows no slot names may hold anything (even NaN): select, never multiply them by zero.
    picked = torch.where(valid.unsqueeze(-1), rows[index.clamp_min(0)], 0)
    out.copy_(weighted_rows_sum(picked, torch.where(valid, weights, 0.0)))


# ----------------------------------------------------------------------------------------------------------------
# Placement as device tables, and payload rows as words


@dataclass(frozen=True)
class Tables:
    holders: torch.Tensor  # [E] int64: how many ranks hold each expert
    rank: torch.Tensor  # [E, max_copies] int64: the ranks holding it, ascending
    local: torch.Tensor  # [E, max_copies] int64: its local index on each of them
    width: int  # the most experts one rank holds
    global_ids: tuple[torch.Tensor, ...]  # per rank, [E_local] int32 global id of each local expert


def _tables(placement: ExpertPlacement, device: torch.device) -> Tables:
    """The dispatch tables of ``placement``: persistent per ``table_slot`` (``placement_tables``), else cached by
    value."""
    if placement.table_slot is None:
        return _value_tables(placement, device)
    return placement_tables(placement, device)


# Per table_slot (weakly: the buffers live as long as the slot's key), per device: the placement whose tables the
# slot's buffers hold, and the buffers.
_SLOTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def placement_tables(placement: ExpertPlacement, device: torch.device) -> Tables:
    """The tables of ``placement`` (see ``ExpertPlacement.table_slot``). With a slot, the slot's buffers: made on
    first use with a copies dimension of the most copies any placement of the slot can give an expert (one per rank,
    and every expert holds a slot: ``min(world, slots - experts + 1)``; the columns past an expert's copies are never
    read), and rewritten in place with ``copy_`` when ``placement``
    differs from the one they hold, so that their addresses (captured by CUDA graphs) stay valid."""
    if placement.table_slot is None:
        return _value_tables(placement, device)
    device = _indexed(device)  # "cuda" and "cuda:0" must find the same buffers
    try:
        slot = _SLOTS.setdefault(placement.table_slot, {})
    except TypeError:
        from ..errors import InputError

        raise InputError(
            "ep_dispatch", "placement", "a table_slot that supports weak references", repr(placement.table_slot)
        ) from None
    held = slot.get(device)
    if held is not None and held[0] == placement:
        return held[1]
    slots = sum(len(e) for e in placement.local_experts)
    fresh = _build_tables(placement, device, copies=min(placement.world_size, slots - placement.num_experts + 1))
    if held is None:
        slot[device] = (placement, fresh)
        return fresh
    tab = held[1]
    if (
        tab.width != fresh.width
        or tab.rank.shape != fresh.rank.shape
        or [t.shape for t in tab.global_ids] != [t.shape for t in fresh.global_ids]
    ):
        from ..errors import InputError

        raise InputError(
            "ep_dispatch",
            "placement",
            f"a placement of table_slot {placement.table_slot!r} with the experts per rank of the one it replaces "
            f"({[len(e) for e in held[0].local_experts]})",
            str([len(e) for e in placement.local_experts]),
        )
    for old, new in zip(
        (tab.holders, tab.rank, tab.local, *tab.global_ids), (fresh.holders, fresh.rank, fresh.local, *fresh.global_ids)
    ):
        old.copy_(new)
    slot[device] = (placement, tab)
    return tab


def _indexed(device: torch.device) -> torch.device:
    """``device`` with its index: an accelerator named without one is the current one."""
    device = torch.device(device)
    if device.type == "cpu" or device.index is not None:
        return device
    return torch.device(device.type, torch.accelerator.current_device_index())


@functools.lru_cache(maxsize=256)
def _value_tables(placement: ExpertPlacement, device: torch.device) -> Tables:
    return _build_tables(placement, device)


def _build_tables(placement: ExpertPlacement, device: torch.device, copies: int | None = None) -> Tables:
    holders = placement.expert_ranks
    copies = max(len(h) for h in holders) if copies is None else copies
    rank = [list(h) + [h[0]] * (copies - len(h)) for h in holders]
    local = [[placement.local_experts[r].index(e) for r in row] for e, row in enumerate(rank)]

    def t(v, dtype=torch.int64):
        return torch.tensor(v, dtype=dtype, device=device)

    return Tables(
        holders=t([len(h) for h in holders]),
        rank=t(rank).view(placement.num_experts, copies),
        local=t(local).view(placement.num_experts, copies),
        width=max(len(e) for e in placement.local_experts),
        global_ids=tuple(t(list(e), torch.int32) for e in placement.local_experts),
    )


def _destinations(tab: Tables, ids: torch.Tensor, src_rank, token: torch.Tensor):
    """For flat int64 expert ids (-1 = none) of pairs from ``src_rank`` (int or tensor) and token index ``token``:
    ``(valid, rank, local expert)`` per the placement's replica rule ``(src_rank + token) % copies``."""
    valid = ids >= 0
    e = ids.clamp_min(0)
    copy = (token + src_rank) % tab.holders[e]
    return valid, tab.rank[e, copy], tab.local[e, copy]


WORDS = (torch.int64, torch.int32, torch.uint8)  # what rows travel as: integer dtypes every collective backend takes


def _word(*byte_offsets: int) -> torch.dtype:
    """The widest of ``WORDS`` whose size divides every one of ``byte_offsets``."""
    return next(w for w in WORDS if all(b % w.itemsize == 0 for b in byte_offsets))


def _words(t: torch.Tensor, word: torch.dtype = torch.uint8) -> torch.Tensor:
    """The bits of ``t [..., n]`` as ``[..., n * itemsize / word size]`` of dtype ``word``, whose size must divide the
    row's bytes: a view for a contiguous tensor whose start and strides are aligned to the word, else a copy (an
    empty tensor may have any strides, so it is remade; a single row sliced from a wider one counts as contiguous
    but keeps the wider row's stride)."""
    width = t.shape[-1] * t.element_size() // word.itemsize
    if t.numel() == 0:
        return torch.empty(*t.shape[:-1], width, dtype=word, device=t.device)
    raw = t.contiguous().view(torch.uint8)
    if any(offset % word.itemsize for offset in (raw.storage_offset(), *raw.stride()[:-1])):
        raw = raw.clone(memory_format=torch.contiguous_format)
    return raw.view(word)


@dataclass(frozen=True)
class Payload:
    """How a row of ``x`` is laid out as words: its parts (data, and scales for FP8) side by side, each a whole
    number of ``word``s."""

    parts: tuple[tuple[torch.dtype, int], ...]  # (dtype, elements per row)
    block: tuple[int, int] | None = None  # QTensor block and scale format, None for a plain tensor
    scale_format: str = "fp32"

    @staticmethod
    def of(x) -> Payload:
        if isinstance(x, QTensor):
            parts = ((x.data.dtype, x.data.shape[-1]), (x.scale.dtype, x.scale.shape[-1]))
            return Payload(parts, x.block, x.scale_format)
        return Payload(((x.dtype, x.shape[-1]),))

    @property
    def spans(self) -> list[tuple[int, int]]:
        out, at = [], 0
        for dtype, n in self.parts:
            width = n * dtype.itemsize
            out.append((at, at + width))
            at += width
        return out

    @property
    def width(self) -> int:
        """Bytes per row."""
        return self.spans[-1][1]

    @property
    def word(self) -> torch.dtype:
        """The dtype rows travel as: the widest of ``WORDS`` that divides every part's start and end."""
        return _word(*(b for span in self.spans for b in span))

    @property
    def words(self) -> int:
        """Words per row."""
        return self.width // self.word.itemsize

    def to_words(self, x) -> torch.Tensor:
        """``[T, words]`` of ``word`` (a view, without copying, for a contiguous aligned plain tensor)."""
        if isinstance(x, QTensor):
            return torch.cat([_words(x.data, self.word), _words(x.scale, self.word)], dim=1)
        return _words(x, self.word)

    def alloc(self, rows: int, device) -> list[torch.Tensor]:
        size = self.word.itemsize
        return [torch.empty(rows, (b - a) // size, dtype=self.word, device=device) for a, b in self.spans]

    def place(self, outs: list[torch.Tensor], index: torch.Tensor, src: torch.Tensor) -> None:
        """``outs[part][index[i]] = src[i]`` (the part's words) for each row ``i`` of ``src`` (``[n, words]``)."""
        size = self.word.itemsize
        for out, (a, b) in zip(outs, self.spans):
            out.index_copy_(0, index, src if len(self.parts) == 1 else src[:, a // size : b // size])

    def gather(self, src: torch.Tensor, index: torch.Tensor) -> list[torch.Tensor]:
        """Per part, the words of rows ``index`` of ``src`` (``[n, words]``), each part contiguous."""
        size = self.word.itemsize
        if len(self.parts) == 1:
            return [src.index_select(0, index)]
        return [src[:, a // size : b // size].index_select(0, index) for a, b in self.spans]

    def assemble(self, outs: list[torch.Tensor], rows: int, lead: tuple[int, ...]):
        """The first ``rows`` rows of the word buffers as ``[*lead, ...]`` tensors of the payload's dtypes."""
        parts = [o[:rows].view(dtype).view(*lead, n) for o, (dtype, n) in zip(outs, self.parts)]
        if self.block is None:
            return parts[0]
        return QTensor(parts[0], parts[1], self.block, self.scale_format)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


# ----------------------------------------------------------------------------------------------------------------
# normal mode


@dataclass
class NormalHandle(DispatchHandle):
    """group; send_splits / recv_splits: pairs sent to / received from each rank; final: ``[M]`` layout row of each
    received pair (receive order: by source rank); pair_pos: ``[T, k]`` position of each pair in the send order
    (``num_sent`` for a skipped pair); weights: ``[T, k]`` routing weights, 0 where skipped. Those serve a combine
    that returns one row per pair.

    For a combine by partial sums (None where the dispatch did not make them): copy_splits / copy_recv_splits: token
    copies sent to / received from each rank (the payload rows dispatch put on the wire); copy_rows: ``[C, k]``
    int64, the layout row of each slot of each received copy (receive order), -1 where the slot's pair went
    elsewhere; copy_weights: ``[C, k]`` fp32 their weights (0 at -1); copy_pos: ``[T, world]`` int64, the position
    of token t's copy for rank d in the send order (destination, token), -1 where it has none."""

    group: object = None
    send_splits: list[int] = None
    recv_splits: list[int] = None
    final: torch.Tensor = None
    pair_pos: torch.Tensor = None
    weights: torch.Tensor = None
    num_sent: int = 0
    copy_splits: list[int] = None
    copy_recv_splits: list[int] = None
    copy_rows: torch.Tensor = None
    copy_weights: torch.Tensor = None
    copy_pos: torch.Tensor = None


def _exclusive_cumsum(t: torch.Tensor) -> torch.Tensor:
    return t.cumsum(0) - t


@dataclass(frozen=True)
class Counted:
    """What ``count_pairs`` found, for ``pack_copies``: per pair (flat over ``[T, k]``) its destination (``world``
    for a skipped pair) and local expert, and per destination which pairs and tokens go there."""

    dest: torch.Tensor  # [T * k] int64
    local: torch.Tensor  # [T * k] int64
    to: torch.Tensor  # [world, T, k] bool: pair (t, j) goes to rank d
    present: torch.Tensor  # [world, T] bool: token t has a copy for rank d
    counts: torch.Tensor  # [(world + 1) * width] int64: pairs per (destination, local expert), spare row last


@dataclass(frozen=True)
class RecvTables:
    """Where the received pairs go, from the exchanged counts (device int64): expert_base ``[world, E_local]``, the
    layout row of the first pair from source s for local expert l; source_base ``[world]``, the receive-order index
    of the first pair from source s; copy_start ``[world + 1]``, the first received copy of each source."""

    expert_base: torch.Tensor
    source_base: torch.Tensor
    copy_start: torch.Tensor


RECORD_FIELDS = 4  # per slot of a copy's record: local expert, weight, rank within (source, expert), rank within source


def count_pairs(ids, tab: Tables, me: int, world: int):
    """The sender's counts, first of a normal-mode dispatch: ``(sent, counted)``. sent: ``[world, width + 1]``
    int64, the pairs for each (destination, local expert), then the copies for each destination. counted: whatever
    ``pack_copies`` (of the same implementation) needs next."""
    dev = ids.device
    tokens, k = ids.shape
    width = tab.width
    valid, dest, local = _destinations(tab, ids.reshape(-1).long(), me, torch.arange(tokens * k, device=dev) // k)
    dest = torch.where(valid, dest, world)  # skipped pairs go to a spare destination
    to = dest.view(1, tokens, k) == torch.arange(world, device=dev).view(world, 1, 1)
    counts = torch.zeros((world + 1) * width, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, dest * width + local, torch.ones_like(dest))
    present = to.any(2)
    sent = torch.cat([counts[: world * width].view(world, width), present.sum(1, keepdim=True)], dim=1)
    return sent, Counted(dest, local, to, present, counts)


def pack_copies(x, payload: Payload, ids, weights, tab: Tables, me: int, world: int, counted: Counted):
    """The sender's rows, while the counts travel: ``(send, pair_pos, copy_pos)``.

    send: ``[R, words + 4k * 4 / word size]`` of ``payload.word``, R at least the number of copies: the copies in
    send order (destination, token), each x's row words then its record, ``RECORD_FIELDS`` x k int32: per slot
    its local expert (-1 where the slot's pair goes elsewhere), its weight (fp32 bits), its rank among the pairs
    for its (destination, local expert) in (token, slot) order, and its rank among the pairs for its destination
    in that order. pair_pos: ``[T, k]`` int64, each pair's position in (destination, token, slot) order over the
    pairs not skipped; at least their number for a skipped pair. copy_pos: ``[T, world]`` int64, the row of send
    holding token t's copy for rank d, -1 where it has none."""
    dev = ids.device
    tokens, k = ids.shape
    dest, local, to, present = counted.dest, counted.local, counted.to, counted.present
    width = tab.width
    n = tokens * k
    key = dest * width + local
    by_key = torch.sort(key, stable=True).indices
    key_rank = torch.empty_like(key)
    counts = counted.counts
    key_rank[by_key] = torch.arange(n, device=dev) - _exclusive_cumsum(counts)[key[by_key]]
    dest_rank = (to.view(world, n).cumsum(1) - 1).gather(0, dest.clamp_max(world - 1).view(1, n)).view(-1)
    dest_pairs = counts.view(world + 1, width).sum(1)
    pair_pos = _exclusive_cumsum(dest_pairs)[dest] + dest_rank
    pair_pos = torch.where(dest < world, pair_pos, n)

    def per_copy(v):  # [T, k] -> [world, T, k]: the slot's value in each destination's copy, -1 elsewhere
        return torch.where(to, v.view(1, tokens, k), -1)

    record = torch.cat(
        [per_copy(local.int()), per_copy(weights.float().view(torch.int32)), per_copy(key_rank.int()),
         per_copy(dest_rank.int())],
        dim=2,
    )  # fmt: skip
    order = torch.sort(present.logical_not().view(-1).to(torch.uint8), stable=True).indices[: min(world, k) * tokens]
    rec_words = record.view(world * tokens, RECORD_FIELDS * k).index_select(0, order).view(payload.word)
    send = torch.cat([payload.to_words(x).index_select(0, order % tokens), rec_words], dim=1)
    flat = present.view(-1)
    copy_pos = torch.where(flat, flat.cumsum(0) - 1, -1).view(world, tokens).t().contiguous()
    return send, pair_pos.view(tokens, k), copy_pos


def unpack_pairs(buf, payload: Payload, k: int, num_recv: int, tables: RecvTables, global_ids):
    """The receiver's side of a normal-mode dispatch: ``buf [C, ...]`` holds the received copies (as ``pack_copies``
    sends them) by source rank, then token. Returns ``(parts, recv_ids, recv_w, final, copy_rows, copy_w)`` with
    the ``num_recv`` pairs in layout order: parts, per payload part (``payload.spans``), ``[num_recv, part words]``
    contiguous, the pair's copy's words; recv_ids int32 (``global_ids`` of the local expert); recv_w fp32; final
    ``[num_recv]`` int64, the layout row of each pair in receive order (source, token, slot); copy_rows ``[C, k]``
    int64, the layout row of slot j of copy c, -1 where that slot's pair went elsewhere; copy_w ``[C, k]`` fp32,
    its weight, 0 at -1. A pair from source s for local expert l with ranks (r_e, r_s) goes to layout row
    ``expert_base[s, l] + r_e``, receive index ``source_base[s] + r_s``."""
    dev = buf.device
    copies = buf.shape[0]
    rec = _words(buf[:, payload.words :], torch.int32).view(copies, RECORD_FIELDS, k).long()
    local = rec[:, 0]
    valid = local >= 0
    source = torch.searchsorted(tables.copy_start[1:], torch.arange(copies, device=dev), right=True).view(-1, 1)
    row = torch.where(valid, tables.expert_base[source, local.clamp_min(0)] + rec[:, 2], num_recv).view(-1)
    pair_of_row = torch.empty(num_recv + 1, dtype=torch.int64, device=dev)
    pair_of_row[row] = torch.arange(copies * k, device=dev)
    pair = pair_of_row[:num_recv]
    final = torch.empty(num_recv + 1, dtype=torch.int64, device=dev)
    final[torch.where(valid, tables.source_base[source] + rec[:, 3], num_recv).view(-1)] = row
    parts = payload.gather(buf[:, : payload.words], pair // k)
    weights = rec[:, 1].int().view(torch.float32)  # [C, k]
    copy_rows, copy_w = torch.where(valid, row.view(copies, k), -1), torch.where(valid, weights, 0.0)
    return parts, global_ids[local.reshape(-1)[pair]], weights.reshape(-1)[pair], final[:num_recv], copy_rows, copy_w


def dispatch_normal(
    x, ids, weights, *, group, placement: ExpertPlacement, count=count_pairs, pack=pack_copies, unpack=unpack_pairs
):
    """Normal-mode ``ep_dispatch`` over ``group``. A backend may pass its own ``count`` / ``pack`` / ``unpack``
    (all three together) with the contracts of ``count_pairs`` / ``pack_copies`` / ``unpack_pairs``: fused kernels
    for the index work and the row copies."""
    import torch.distributed as dist

    me, world = group_rank_size(group)
    tokens, k = ids.shape
    tab = _tables(placement, ids.device)
    width = tab.width
    payload = Payload.of(x)

    sent, counted = count(ids, tab, me, world)
    got = torch.empty_like(sent)
    counts_work = dist.all_to_all_single(got, sent, group=group, async_op=True)
    send, pair_pos, copy_pos = pack(x, payload, ids, weights, tab, me, world, counted)
    counts_work.wait()
    sent_host, got_host = torch.stack([sent, got]).cpu()  # the one host synchronisation
    recv_c = got_host[:, : len(placement.local_experts[me])]  # [source, local expert]
    send_splits, recv_splits = sent_host[:, :width].sum(1).tolist(), recv_c.sum(1).tolist()
    copy_send, copy_recv = sent_host[:, width].tolist(), got_host[:, width].tolist()
    num_sent, num_recv = sum(send_splits), sum(recv_splits)
    buf = torch.empty(sum(copy_recv), send.shape[1], dtype=payload.word, device=ids.device)
    dist.all_to_all_single(buf, send[: sum(copy_send)], copy_recv, copy_send, group=group)

    # Where each source's pairs go, from the counts; one host-to-device copy. offsets: the layout's expert offsets.
    offsets = torch.zeros(recv_c.shape[1] + 1, dtype=torch.int64)
    offsets[1:] = recv_c.sum(0).cumsum(0)
    expert_base = offsets[:-1] + _exclusive_cumsum(recv_c)
    source_base = _exclusive_cumsum(torch.tensor(recv_splits))
    copy_start = _exclusive_cumsum(torch.tensor([*copy_recv, 0]))
    on_dev = torch.cat([offsets, expert_base.flatten(), source_base, copy_start]).to(ids.device)
    offsets_d, *rest = on_dev.split([len(offsets), expert_base.numel(), world, world + 1])
    tables = RecvTables(rest[0].view(world, recv_c.shape[1]), rest[1], rest[2])
    parts, recv_ids, recv_w, final, copy_rows, copy_w = unpack(buf, payload, k, num_recv, tables, tab.global_ids[me])
    handle = NormalHandle(
        tokens,
        "normal",
        (num_recv,),
        group=group,
        send_splits=send_splits,
        recv_splits=recv_splits,
        final=final,
        pair_pos=pair_pos.clamp_max(num_sent),  # skipped pairs read the zero row
        weights=torch.where(ids >= 0, weights, 0.0),
        num_sent=num_sent,
        copy_splits=copy_send,
        copy_recv_splits=copy_recv,
        copy_rows=copy_rows,
        copy_weights=copy_w,
        copy_pos=copy_pos,
    )
    layout = ExpertLayout(expert_offsets=offsets_d.to(torch.int32))
    return payload.assemble(parts, num_recv, (num_recv,)), recv_ids, recv_w, layout, handle


def sums_per_rank(y: torch.Tensor, handle: NormalHandle) -> bool:
    """Whether ``combine_normal`` returns per-rank partial sums (true) or one row per pair: partial sums unless
    batch-invariant mode is on, the handle has no copy tables, or fp32 partial sums could be more bytes than y's
    rows, one per pair (``4 * min(world, k) > y.element_size() * k``: a token has at most min(world, k) copies).
    Every rank decides alike: the rule reads only what the ranks share (mode, world size, k, y's dtype)."""
    world, k = len(handle.send_splits), handle.weights.shape[1]
    return handle.copy_rows is not None and not batch_invariant_enabled() and 4 * min(world, k) <= y.element_size() * k


def combine_normal(y: torch.Tensor, handle: NormalHandle, weighted_sum=weighted_gather_sum) -> torch.Tensor:
    """``ep_combine`` of a normal-mode dispatch: ``y [M, H]`` in the received layout; returns ``[T, H]`` in y's dtype.

    Per-rank partial sums (``sums_per_rank``): each rank sums ``weight * row`` over each received copy's pairs in
    fp32, in slot order; the sums travel back as fp32 and the source adds its copies' sums in rank order, in fp32,
    then rounds to y's dtype. The result differs from one process by fp32 reassociation only. Otherwise each row
    goes back to its source, which adds the k products to a zero fp32 accumulator in slot order: the arithmetic of
    one process.

    weighted_sum: ``fn(rows, index, weights, out)`` with the contract of ``weighted_gather_sum`` (a backend's fused
    kernel): ``out[t] = sum_j weights[t, j] * rows[index[t, j]]`` over ``index >= 0``, each product rounded to fp32
    and added to a zero fp32 accumulator in slot order, then rounded to out's dtype. Arguments are contiguous:
    ``rows [R, H]``, ``index [T, k]`` int64, ``weights [T, k]`` fp32, ``out [T, H]`` (y's dtype, or fp32 for the
    partial sums)."""
    import torch.distributed as dist

    hidden, dev = y.shape[-1], y.device
    y = y.contiguous()
    out = torch.empty(handle.num_tokens, hidden, dtype=y.dtype, device=dev)
    if sums_per_rank(y, handle):
        partial = torch.empty(handle.copy_rows.shape[0], hidden, dtype=torch.float32, device=dev)
        weighted_sum(y, handle.copy_rows, handle.copy_weights, partial)
        back = torch.empty(sum(handle.copy_splits), hidden, dtype=torch.float32, device=dev)
        dist.all_to_all_single(back, partial, handle.copy_splits, handle.copy_recv_splits, group=handle.group)
        ones = torch.ones(handle.copy_pos.shape, dtype=torch.float32, device=dev)
        weighted_sum(back, handle.copy_pos, ones, out)
        return out
    word = _word(hidden * y.element_size())
    back = torch.empty(handle.num_sent + 1, hidden * y.element_size() // word.itemsize, dtype=word, device=dev)
    back[handle.num_sent].zero_()  # skipped pairs read this zero row
    send = _words(y, word).index_select(0, handle.final)
    dist.all_to_all_single(back[: handle.num_sent], send, handle.send_splits, handle.recv_splits, group=handle.group)
    weighted_sum(back.view(y.dtype), handle.pair_pos.contiguous(), handle.weights.contiguous(), out)
    return out


# ----------------------------------------------------------------------------------------------------------------
# low_latency mode


@dataclass
class LowLatencyHandle(DispatchHandle):
    """group; capacity: token slots per rank; rows: ``[S, k]`` layout row (flat over ``[E_local, max_m]``) of each
    pair of the gathered routing held here (any value elsewhere: never read); mine: ``[S, k]`` whether the pair is
    held here; weights: ``[S, k]`` its weight where held here, else 0; lost: ``[T]`` this rank's tokens that lost a
    row.

    For a combine that returns one row per pair (batch-invariant mode over several ranks; None where the dispatch did
    not make them): pair_rank ``[T, k]`` int64, the rank holding each pair of this rank's tokens (-1 for a skipped
    pair); pair_weights ``[T, k]`` fp32, their routing weights (0 where skipped)."""

    group: object = None
    capacity: int = 0
    rows: torch.Tensor = None
    mine: torch.Tensor = None
    weights: torch.Tensor = None
    lost: torch.Tensor = None
    pair_rank: torch.Tensor = None
    pair_weights: torch.Tensor = None


@dataclass(frozen=True)
class Placed:
    """A low-latency receiver's result (``place_pairs``), with ``L = E_local * max_m`` layout rows and ``S`` gathered
    token slots: parts, per payload part (``payload.spans``), ``[L, part words]`` (rows at or past ``masked_m`` of
    their expert unspecified); recv_ids ``[L]`` int32 global ids (-1 unused); recv_w ``[L]`` fp32 (0 unused);
    masked_m ``[E_local]`` int32; overflow, 0-d bool: some (destination, expert) of the whole group had more than
    ``max_m`` pairs; rows, mine ``[S, k]``: as ``LowLatencyHandle``'s; lost ``[S]`` bool: the slot's token lost a
    pair to overflow (on whichever rank)."""

    parts: list
    recv_ids: torch.Tensor
    recv_w: torch.Tensor
    masked_m: torch.Tensor
    overflow: torch.Tensor
    rows: torch.Tensor
    mine: torch.Tensor
    lost: torch.Tensor


def place_pairs(g_x, g_ids, g_w, payload: Payload, tab: Tables, me: int, world: int, per_rank: int, max_m: int):
    """The receiver's side of a low-latency dispatch, the same computation on every rank: each pair of the gathered
    routing (``g_ids`` / ``g_w`` ``[S, k]``, slot ``s`` holding token ``s % per_rank`` of rank ``s // per_rank``)
    gets its destination (rank, local expert) by the placement's replica rule and its rank among the pairs of that
    destination in (slot, j) order; those below ``max_m`` are delivered. This rank places the rows of its own pairs
    (``g_x [S, words]``, the payload words of each slot). Returns a ``Placed``."""
    dev = g_ids.device
    slots, k = g_ids.shape
    n = slots * k
    flat = g_ids.reshape(-1).long()
    pair = torch.arange(n, device=dev)
    token_row = pair // k
    valid, owner, local = _destinations(tab, flat, token_row // max(per_rank, 1), token_row % max(per_rank, 1))
    nkeys = world * tab.width
    key = torch.where(valid, owner * tab.width + local, nkeys)
    counts = torch.zeros(nkeys + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    order = torch.sort(key, stable=True).indices  # (owner, local expert), then (source, token, slot)
    slot = torch.empty_like(key)
    slot.scatter_(0, order, pair - _exclusive_cumsum(counts)[key[order]])
    kept = valid & (slot < max_m)
    mine = kept & (owner == me)
    n_local = len(tab.global_ids[me])
    spare = n_local * max_m + token_row  # one spare row per gathered token: indices stay distinct per slot j
    rows = torch.where(mine, local * max_m + slot, spare).view(slots, k)

    outs = payload.alloc(n_local * max_m + slots, dev)
    recv_ids = torch.full((n_local * max_m + slots,), -1, dtype=torch.int32, device=dev)
    recv_w = torch.zeros(n_local * max_m + slots, dtype=torch.float32, device=dev)
    for j in range(k):
        if slots:
            payload.place(outs, rows[:, j], g_x)
        recv_ids.index_copy_(0, rows[:, j], g_ids[:, j])
        recv_w.index_copy_(0, rows[:, j], g_w[:, j])
    size = n_local * max_m
    return Placed(
        parts=[o[:size] for o in outs],
        recv_ids=recv_ids[:size],
        recv_w=recv_w[:size],
        masked_m=counts[me * tab.width : me * tab.width + n_local].clamp(max=max_m).to(torch.int32),
        overflow=(counts[:nkeys] > max_m).any(),
        rows=rows,
        mine=mine.view(slots, k),
        lost=(valid & ~kept).view(slots, k).any(-1),
    )


def dispatch_low_latency(x, ids, weights, *, group, placement: ExpertPlacement, capacity: int, place=place_pairs):
    """Low-latency ``ep_dispatch``. A backend may pass its own ``place`` with the contract of ``place_pairs`` (fused
    kernels for the receiver's index work and row copies); the exchange stays here."""
    me, world = group_rank_size(group)
    dev = ids.device
    tokens, k = ids.shape
    tab = _tables(placement, dev)
    payload = Payload.of(x)
    pw = payload.width
    if world == 1:  # one process: the routing is already all here
        slots = tokens
        g_x = payload.to_words(x)
        g_ids, g_w = ids, weights
    else:
        slots = world * capacity
        row = torch.zeros(capacity, pw + 8 * k, dtype=torch.uint8, device=dev)
        row[:tokens, :pw] = _words(payload.to_words(x))
        row[:tokens, pw : pw + 4 * k] = _words(ids)
        row[tokens:, pw : pw + 4 * k] = 255  # id -1 in every padding slot
        row[:tokens, pw + 4 * k :] = _words(weights)
        gathered = torch.empty(slots, row.shape[1], dtype=torch.uint8, device=dev)
        _all_gather(gathered, row, group)
        g_x = gathered[:, :pw].view(payload.word)  # rows of pw + 8k bytes: aligned to the word
        g_ids = _words(gathered[:, pw : pw + 4 * k], torch.int32)
        g_w = _words(gathered[:, pw + 4 * k :], torch.float32)
    per_rank = capacity if world > 1 else tokens
    max_m = world * capacity
    placed = place(g_x, g_ids, g_w, payload, tab, me, world, per_rank, max_m)  # g_ids, g_w: [slots, k]
    n_local = len(placement.local_experts[me])
    lead = (n_local, max_m)
    token = torch.arange(tokens * k, device=dev) // k
    valid, owner, _ = _destinations(tab, ids.reshape(-1).long(), me, token)  # place's rule for this rank's pairs
    handle = LowLatencyHandle(
        tokens,
        "low_latency",
        lead,
        overflow=placed.overflow,
        group=group,
        capacity=capacity,
        rows=placed.rows,
        mine=placed.mine,
        weights=torch.where(placed.mine, g_w, 0.0),
        lost=placed.lost[me * per_rank : me * per_rank + tokens],
        pair_rank=torch.where(valid, owner, -1).view(tokens, k),
        pair_weights=torch.where(ids >= 0, weights, 0.0),
    )
    return (
        payload.assemble(placed.parts, n_local * max_m, lead),
        placed.recv_ids.view(lead),
        placed.recv_w.view(lead),
        ExpertLayout(masked_m=placed.masked_m),
        handle,
    )


def combine_low_latency(y: torch.Tensor, handle: LowLatencyHandle, weighted_sum=weighted_gather_sum) -> torch.Tensor:
    """``ep_combine`` of a low-latency dispatch (``weighted_sum``: as ``combine_normal``'s). Over several ranks each
    rank sums the weighted rows of its experts per source token (fp32) and the source adds those partial sums in
    rank order; in batch-invariant mode each row goes back to its source instead, which adds the k products in slot
    order with the arithmetic of one process (``combine_pairs_low_latency``)."""
    import torch.distributed as dist

    _, world = group_rank_size(handle.group)
    if world > 1 and batch_invariant_enabled() and handle.pair_rank is not None:
        return combine_pairs_low_latency(y, handle, weighted_sum)
    hidden, dev = y.shape[-1], y.device
    partial = torch.empty(handle.mine.shape[0], hidden, dtype=torch.float32, device=dev)  # this rank's share
    rows = torch.where(handle.mine, handle.rows, -1)
    weighted_sum(y.reshape(-1, hidden).contiguous(), rows, handle.weights.contiguous(), partial)
    if world > 1:
        back = torch.empty_like(partial)
        dist.all_to_all_single(back, partial, group=handle.group)  # block s (rank s's tokens) goes to rank s
        out = back.view(world, handle.capacity, hidden)[:, : handle.num_tokens].sum(0)
    else:
        out = partial
    out = torch.where(handle.lost.unsqueeze(-1), torch.nan, out)
    return out.to(y.dtype)


def combine_pairs_low_latency(y: torch.Tensor, handle: LowLatencyHandle, weighted_sum=weighted_gather_sum):
    """``ep_combine`` of a low-latency dispatch over several ranks that returns one row per pair: every rank sends
    each gathered slot's k rows (zero words for pairs held elsewhere) back to the slot's source in one fixed-size
    ``all_to_all_single``; the source takes each of its pairs' rows from the rank holding it (``pair_rank``) and sums
    ``weight * row`` over the k slots in slot order, as one process does. No host synchronisation."""
    import torch.distributed as dist

    _, world = group_rank_size(handle.group)
    hidden, dev = y.shape[-1], y.device
    slots, k = handle.mine.shape
    word = _word(hidden * y.element_size())
    rows = _words(y.reshape(-1, hidden), word)  # [E_local * max_m, words]
    send = torch.zeros(slots, k, rows.shape[1], dtype=word, device=dev)
    if rows.shape[0]:
        held = rows[torch.where(handle.mine, handle.rows, 0)]
        send = torch.where(handle.mine.unsqueeze(-1), held, send)
    back = torch.empty_like(send)
    dist.all_to_all_single(back, send, group=handle.group)  # block s (rank s's token slots) goes to rank s
    tokens = handle.num_tokens
    back = back.view(world, handle.capacity, k, rows.shape[1])[:, :tokens]
    owner = handle.pair_rank.clamp_min(0).view(1, tokens, k, 1).expand(1, tokens, k, rows.shape[1])
    pairs = back.gather(0, owner).view(tokens * k, rows.shape[1]).view(y.dtype)  # [T * k, H]
    index = torch.where(handle.pair_rank >= 0, torch.arange(tokens * k, device=dev).view(tokens, k), -1)
    out = torch.empty(tokens, hidden, dtype=y.dtype, device=dev)
    weighted_sum(pairs.contiguous(), index.contiguous(), handle.pair_weights.contiguous(), out)
    return torch.where(handle.lost.unsqueeze(-1), torch.nan, out)
