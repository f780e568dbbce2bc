"""TEST DOUBLE of torch_npu's MC2 expert all-to-all: ``npu_moe_distribute_dispatch_v2`` / ``combine_v2``.

Nothing here touches an NPU or HCCL. The two functions run in plain torch on the CPU and exchange data between real
processes over a **Gloo** process group, following the op-plugin docs (``torch_npu-npu_moe_distribute_dispatch_v2.md``
and ``..._combine_v2.md``) for the Atlas A3 rules, which the ascend backend assumes the Ascend 950 follows.

Communicator names. On hardware, ``group_ep`` is the HCCL communicator name that
``group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)`` returns. This double installs an equivalent
method, ``get_hccl_comm_name(rank)``, on torch's ``ProcessGroupGloo`` (the object ``group._get_backend(cpu)`` returns
for a Gloo group): it returns ``"hccl-test-double/<group_name>"`` and records which process group the name stands
for, so the two functions can resolve ``group_ep`` back to a Gloo group. That is the double's only hook into
torch.distributed; the backend calls the method exactly as it would on hardware (with the CPU device the probe
reports under the double).

What the double emulates, and what it rejects (``DocumentedRejection``):
- dispatch: x ``(BS, H)`` bf16/fp16, ``0 < BS <= 512``, ``1024 <= H <= 8192``; expert_ids ``(BS, K)`` int32,
  ``0 < K <= 16``, values in ``[0, moe_expert_num)`` and unique per row (so no -1); ``2 <= ep_world_size <= 768``
  and equal to the group's size; ``ep_rank_id`` this process's rank in it; ``moe_expert_num`` in ``[1, 1024]`` and
  a multiple of ``ep_world_size``; ``global_bs`` 0 (then every rank must have the same BS) or at least
  ``max BS * ep_world_size``, and the same in every call on one communicator ("the same in every layer");
  ``quant_mode`` 0 or 2 (2 is not emulated); ``scales`` absent in mode 0; ``expert_scales`` unsupported on A3.
- combine: expand_x ``(A, H)`` bf16/fp16 with the dispatch's A, ``1024 <= H <= 8192``; ``expert_ids`` and
  ``ep_send_counts`` exactly the dispatch's; ``expert_scales`` ``(BS, K)`` fp32; ``ep_world_size <= 768``,
  ``moe_expert_num <= 1024``; ``expand_scales`` unsupported on A3.
- Shared experts, a TP domain, ``x_active_mask``, elastic scaling, special (zero / copy / const) experts and
  communication quantisation raise ``NotEmulated``: the backend must not use them.

Outputs. ``expand_x`` has ``A = global_bs * min(local_expert_num, K)`` rows (``BS * ep_world_size * ...`` when
``global_bs`` is 0). Its first ``sum(expert_token_nums)`` rows are the received rows grouped by local expert in
ascending order; **within a local expert their order is not documented, so the double shuffles them** (a fixed
pseudo-random order per call), and rows past the received count are NaN. ``assist_info_for_combine``,
``ep_recv_counts`` and ``tp_recv_counts`` are opaque by the docs: here they carry the double's own bookkeeping.
``dynamic_scales`` and ``expand_scales`` are None (quant_mode 0, A3). Combine returns, per source token,
``sum_j expert_scales[t, j] * row(t, j)`` accumulated in fp32 in slot order, in expand_x's dtype.
"""

from __future__ import annotations

import itertools

import torch

from ._common import dtype_in, is_950, not_emulated, poison, record, require, soc

DISPATCH = "npu_moe_distribute_dispatch_v2"
COMBINE = "npu_moe_distribute_combine_v2"
NAME_PREFIX = "hccl-test-double/"
ASSIST_WIDTH = 128  # int32 entries of assist_info_for_combine per expand_x row (the doc's A * 128)
_MAGIC = 0x6D633264  # marks an assist_info record written by this double

_groups: dict[str, object] = {}  # communicator name -> the Gloo process group it stands for
_global_bs: dict[str, int] = {}  # communicator name -> the global_bs of its first call
_dispatches: dict[int, dict] = {}  # serial -> what combine needs to route rows back
_serial = itertools.count(1)


# ---------------------------------------------------------------------------------------------------------------
# communicator names


def _install_comm_name_hook() -> None:
    """Gives torch's Gloo backend object the ``get_hccl_comm_name(rank)`` method HCCL's backend object has."""
    try:
        from torch.distributed import ProcessGroupGloo
    except ImportError:  # torch built without distributed support: nothing to hook
        return

    def get_hccl_comm_name(self, rank: int) -> str:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        require(rank == dist.get_rank(), "get_hccl_comm_name", "rank must be this process's global rank")
        for pg in distributed_c10d._world.pg_map:
            try:
                backend = pg._get_backend(torch.device("cpu"))
            except (RuntimeError, ValueError):
                continue
            if backend is self:
                name = NAME_PREFIX + pg.group_name
                _groups[name] = pg
                return name
        raise RuntimeError("get_hccl_comm_name (torch_npu test double): this Gloo backend belongs to no process group")

    ProcessGroupGloo.get_hccl_comm_name = get_hccl_comm_name


_install_comm_name_hook()


def _resolve(op: str, name: str, world: int, rank: int):
    import torch.distributed as dist

    require(isinstance(name, str) and 1 <= len(name) < 128, op, "group_ep must be a string of length [1, 128)")
    require(name in _groups, op, f"group_ep {name!r} is not a communicator name (get_hccl_comm_name)")
    group = _groups[name]
    require(world == dist.get_world_size(group), op, "ep_world_size must be the size of the EP communicator")
    require(rank == dist.get_rank(group), op, "ep_rank_id must be this card's rank in the EP communicator")
    return group


def _not_emulated_common(op: str, **kw) -> None:
    not_emulated(not (is_950() or soc().startswith("Ascend910_93")), op, f"the rules of {soc()} (A2 differ)")
    not_emulated(kw["group_tp"] != "" or kw["tp_world_size"] not in (0, 1), op, "a TP communication domain")
    require(kw["tp_rank_id"] == 0, op, "tp_rank_id must be 0 without a TP domain")
    require(kw["expert_shard_type"] == 0, op, "expert_shard_type supports only 0")
    require(0 <= kw["shared_expert_num"] <= 4, op, "shared_expert_num must be in [0, 4]")
    not_emulated(kw["shared_expert_rank_num"] != 0, op, "shared-expert cards (shared_expert_rank_num > 0)")
    not_emulated(kw.get("x_active_mask") is not None, op, "x_active_mask")
    not_emulated(kw.get("elastic_info") is not None, op, "elastic scaling (elastic_info)")


# ---------------------------------------------------------------------------------------------------------------
# exchanges (Gloo moves bytes; every rank sees every rank's block)


def _all_gather_rows(t: torch.Tensor, group, world: int) -> list[torch.Tensor]:
    """Every rank's ``t`` ([n_r, ...], any dtype, n_r may differ): a list indexed by rank."""
    import torch.distributed as dist

    n = torch.tensor([t.shape[0]], dtype=torch.int64)
    sizes = torch.empty(world, dtype=torch.int64)
    dist.all_gather_into_tensor(sizes, n, group=group)
    most = int(sizes.max())
    width = t.element_size() * (t[0].numel() if t.shape[0] else int(torch.Size(t.shape[1:]).numel()))
    padded = torch.zeros(most, width, dtype=torch.uint8)
    if t.shape[0]:
        padded[: t.shape[0]] = t.contiguous().view(torch.uint8).reshape(t.shape[0], width)
    out = torch.empty(world * most, width, dtype=torch.uint8)
    dist.all_gather_into_tensor(out, padded, group=group)
    blocks = out.view(world, most, width)
    return [
        blocks[r, : int(sizes[r])].contiguous().view(t.dtype).reshape(int(sizes[r]), *t.shape[1:]) for r in range(world)
    ]


# ---------------------------------------------------------------------------------------------------------------
# dispatch


def npu_moe_distribute_dispatch_v2(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    group_ep: str,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    *,
    scales: torch.Tensor | None = None,
    x_active_mask: torch.Tensor | None = None,
    expert_scales: torch.Tensor | None = None,
    elastic_info: torch.Tensor | None = None,
    group_tp: str = "",
    tp_world_size: int = 0,
    tp_rank_id: int = 0,
    expert_shard_type: int = 0,
    shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0,
    quant_mode: int = 0,
    global_bs: int = 0,
    expert_token_nums_type: int = 1,
    comm_alg: str = "",
    zero_expert_num: int = 0,
    copy_expert_num: int = 0,
    const_expert_num: int = 0,
) -> tuple[torch.Tensor, None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, None]:
    """MC2 dispatch (TEST DOUBLE, Gloo between processes). Returns ``(expand_x, dynamic_scales=None,
    assist_info_for_combine, expert_token_nums int64, ep_recv_counts int32, tp_recv_counts int32,
    expand_scales=None)``."""
    op = DISPATCH
    _not_emulated_common(
        op,
        group_tp=group_tp,
        tp_world_size=tp_world_size,
        tp_rank_id=tp_rank_id,
        expert_shard_type=expert_shard_type,
        shared_expert_num=shared_expert_num,
        shared_expert_rank_num=shared_expert_rank_num,
        x_active_mask=x_active_mask,
        elastic_info=elastic_info,
    )
    not_emulated(zero_expert_num or copy_expert_num or const_expert_num, op, "zero / copy / const experts")
    require(quant_mode in (0, 2), op, "quant_mode must be 0 (no quantisation) or 2 (dynamic int8)")
    not_emulated(quant_mode == 2, op, "quant_mode 2 (dynamic int8 quantisation)")
    require(scales is None, op, "scales is not passed without quantisation (quant_mode 0)")
    require(expert_scales is None, op, "expert_scales is not supported on A3 (pass None)")
    require(comm_alg in ("", "fullmesh_v1", "fullmesh_v2"), op, "comm_alg must be '', 'fullmesh_v1' or 'fullmesh_v2'")
    require(expert_token_nums_type in (0, 1), op, "expert_token_nums_type must be 0 or 1")
    dtype_in(x, (torch.bfloat16, torch.float16), op, "x")
    require(x.dim() == 2 and expert_ids.dim() == 2, op, "x and expert_ids must be 2-D")
    require(expert_ids.dtype == torch.int32, op, "expert_ids must be int32")
    bs, hidden = x.shape
    k = expert_ids.shape[1]
    require(expert_ids.shape[0] == bs, op, "x and expert_ids must have BS rows")
    require(0 < bs <= 512, op, "BS must satisfy 0 < BS <= 512")
    require(1024 <= hidden <= 8192, op, "H must be in [1024, 8192]")
    require(0 < k <= 16 and k <= moe_expert_num, op, "K must satisfy 0 < K <= 16 and K <= moe_expert_num")
    require(2 <= ep_world_size <= 768, op, "ep_world_size must be in [2, 768]")
    require(0 <= ep_rank_id < ep_world_size, op, "ep_rank_id must be in [0, ep_world_size)")
    require(1 <= moe_expert_num <= 1024, op, "moe_expert_num must be in [1, 1024]")
    require(moe_expert_num % ep_world_size == 0, op, "moe_expert_num % (ep_world_size - shared_expert_rank_num) == 0")
    ids = expert_ids.long()
    require(bool(((ids >= 0) & (ids < moe_expert_num)).all()), op, "expert_ids values must be in [0, moe_expert_num)")
    sorted_ids = ids.sort(dim=1).values
    require(bool((sorted_ids[:, 1:] != sorted_ids[:, :-1]).all()), op, "the K ids of a row must not repeat")
    group = _resolve(op, group_ep, ep_world_size, ep_rank_id)
    require(global_bs >= 0, op, "global_bs must be >= 0")
    require(_global_bs.setdefault(group_ep, global_bs) == global_bs, op, "global_bs must be the same in every call")

    world, me, local = ep_world_size, ep_rank_id, moe_expert_num // ep_world_size
    # Every rank sees every rank's tokens: BS, ids, rows (bytes).
    all_ids = _all_gather_rows(expert_ids.contiguous(), group, world)
    all_x = _all_gather_rows(x.contiguous(), group, world)
    sizes = [t.shape[0] for t in all_ids]
    require(all(t.shape[1] == k for t in all_ids), op, "K must be the same on every rank")
    if global_bs == 0:
        require(len(set(sizes)) == 1, op, "global_bs 0 needs the same BS on every rank (else max_bs * ep_world_size)")
        rows = bs * world * min(local, k)
    else:
        require(global_bs >= max(sizes) * world, op, "global_bs must be at least max_bs * ep_world_size")
        rows = global_bs * min(local, k)
    record(op, bs=bs, hidden=hidden, k=k, world=world, global_bs=global_bs, rows=rows, group_ep=group_ep)

    # The received (source rank, token, slot) triples, grouped by (local expert, source rank).
    lo = me * local
    per_expert: list[list[tuple[int, int, int]]] = [[] for _ in range(local)]
    counts = torch.zeros(local, world, dtype=torch.int64)
    for src, src_ids in enumerate(all_ids):
        hit = (src_ids >= lo) & (src_ids < lo + local)
        for t, j in torch.nonzero(hit).tolist():
            e = int(src_ids[t, j]) - lo
            per_expert[e].append((src, t, j))
            counts[e, src] += 1
    gen = torch.Generator().manual_seed(0xD15 + 7919 * me + next(_serial))
    order: list[tuple[int, int, int]] = []
    for triples in per_expert:  # the order within an expert is not documented: shuffle it
        perm = torch.randperm(len(triples), generator=gen).tolist()
        order.extend(triples[p] for p in perm)
    total = len(order)
    require(total <= rows, op, "more rows than A (the documented bound was violated)")

    expand_x = poison(torch.empty(rows, hidden, dtype=x.dtype))
    if total:
        expand_x[:total] = torch.stack([all_x[s][t] for s, t, _ in order])
    serial = next(_serial)
    assist = torch.full((rows * ASSIST_WIDTH,), 0x7B, dtype=torch.int32)
    view = assist.view(rows, ASSIST_WIDTH)
    view[:, 0] = _MAGIC
    view[:, 1] = serial
    if total:
        view[:total, 2:5] = torch.tensor(order, dtype=torch.int32)
    expert_token_nums = counts.sum(1)
    if expert_token_nums_type == 0:
        expert_token_nums = expert_token_nums.cumsum(0)
    ep_recv_counts = counts.flatten().cumsum(0).to(torch.int32)  # (world * local,): prefix sums, (expert, source)
    tp_recv_counts = torch.zeros(max(tp_world_size, 1), dtype=torch.int32)
    _dispatches[serial] = {
        "ids": expert_ids.clone(),
        "rows": rows,
        "total": total,
        "order": order,
        "ep_recv_counts": ep_recv_counts.clone(),
        "group_ep": group_ep,
        "global_bs": global_bs,
    }
    return expand_x, None, assist, expert_token_nums, ep_recv_counts, tp_recv_counts, None


# ---------------------------------------------------------------------------------------------------------------
# combine


def npu_moe_distribute_combine_v2(
    expand_x: torch.Tensor,
    expert_ids: torch.Tensor,
    assist_info_for_combine: torch.Tensor,
    ep_send_counts: torch.Tensor,
    expert_scales: torch.Tensor,
    group_ep: str,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    *,
    tp_send_counts: torch.Tensor | None = None,
    x_active_mask: torch.Tensor | None = None,
    expand_scales: torch.Tensor | None = None,
    shared_expert_x: torch.Tensor | None = None,
    group_tp: str = "",
    tp_world_size: int = 0,
    tp_rank_id: int = 0,
    expert_shard_type: int = 0,
    shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0,
    global_bs: int = 0,
    comm_quant_mode: int = 0,
) -> torch.Tensor:
    """MC2 combine (TEST DOUBLE, Gloo between processes): each expand_x row goes back to its source token, which
    sums ``expert_scales[t, j] * row`` over its K slots in fp32. Returns ``(BS, H)`` in expand_x's dtype."""
    op = COMBINE
    _not_emulated_common(
        op,
        group_tp=group_tp,
        tp_world_size=tp_world_size,
        tp_rank_id=tp_rank_id,
        expert_shard_type=expert_shard_type,
        shared_expert_num=shared_expert_num,
        shared_expert_rank_num=shared_expert_rank_num,
        x_active_mask=x_active_mask,
    )
    not_emulated(shared_expert_x is not None, op, "shared_expert_x")
    require(comm_quant_mode in (0, 2), op, "comm_quant_mode must be 0 or 2")
    not_emulated(comm_quant_mode == 2, op, "int8 communication quantisation (comm_quant_mode 2)")
    require(expand_scales is None, op, "expand_scales is not supported on A3 (pass None)")
    dtype_in(expand_x, (torch.bfloat16, torch.float16), op, "expand_x")
    require(expand_x.dim() == 2, op, "expand_x must be 2-D (A, H)")
    hidden = expand_x.shape[1]
    require(1024 <= hidden <= 8192, op, "H must be in [1024, 8192]")
    require(2 <= ep_world_size <= 768, op, "ep_world_size must be in [2, 768]")
    require(1 <= moe_expert_num <= 1024, op, "moe_expert_num must be in [1, 1024]")
    require(moe_expert_num % ep_world_size == 0, op, "moe_expert_num % (ep_world_size - shared_expert_rank_num) == 0")
    require(
        assist_info_for_combine.dtype == torch.int32 and assist_info_for_combine.dim() == 1,
        op,
        "assist_info_for_combine must be 1-D int32",
    )
    head = assist_info_for_combine.view(-1, ASSIST_WIDTH)[0] if assist_info_for_combine.numel() else None
    require(
        head is not None and int(head[0]) == _MAGIC and int(head[1]) in _dispatches,
        op,
        "assist_info_for_combine must be the output of npu_moe_distribute_dispatch_v2",
    )
    state = _dispatches.pop(int(head[1]))
    require(
        assist_info_for_combine.numel() == state["rows"] * ASSIST_WIDTH, op, "assist_info_for_combine is (A * 128,)"
    )
    require(tuple(expand_x.shape) == (state["rows"], hidden), op, "expand_x must be (A, H) with the dispatch's A")
    require(group_ep == state["group_ep"], op, "group_ep must be the dispatch's")
    require(global_bs == state["global_bs"], op, "global_bs must be the dispatch's")
    require(
        expert_ids.dtype == torch.int32 and torch.equal(expert_ids, state["ids"]),
        op,
        "expert_ids must be the expert_ids passed to npu_moe_distribute_dispatch_v2",
    )
    require(
        torch.equal(ep_send_counts, state["ep_recv_counts"]), op, "ep_send_counts must be dispatch's ep_recv_counts"
    )
    bs, k = expert_ids.shape
    require(
        expert_scales.dtype == torch.float32 and tuple(expert_scales.shape) == (bs, k),
        op,
        "expert_scales must be (BS, K) float32",
    )
    group = _resolve(op, group_ep, ep_world_size, ep_rank_id)
    record(op, bs=bs, hidden=hidden, k=k, rows=state["rows"], group_ep=group_ep)

    world, me = ep_world_size, ep_rank_id
    total = state["total"]
    triples = torch.tensor(state["order"], dtype=torch.int64).view(-1, 3)
    all_rows = _all_gather_rows(expand_x[:total].contiguous(), group, world)
    all_triples = _all_gather_rows(triples, group, world)
    slot_rows = torch.zeros(bs, k, hidden, dtype=torch.float32)
    seen = torch.zeros(bs, k, dtype=torch.bool)
    for rank in range(world):
        mine = all_triples[rank][:, 0] == me
        for (_, t, j), row in zip(all_triples[rank][mine].tolist(), all_rows[rank][mine]):
            slot_rows[t, j] = row.float()
            seen[t, j] = True
    require(bool(seen.all()), op, "every (token, slot) pair must come back (a row went missing)")
    out = torch.zeros(bs, hidden, dtype=torch.float32)
    for j in range(k):
        out += expert_scales[:, j : j + 1] * slot_rows[:, j]
    return out.to(expand_x.dtype)
