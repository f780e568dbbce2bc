"""The Triton kernels of ``moe_route``, ``moe_route_hash``, ``ep_dispatch`` and ``ep_combine``: the fused routing,
the one-process dispatch's row layout and copies, the multi-rank index work (counting, packing, unpacking and placing
pairs) and the weighted sum of the combine. ``moe.py`` launches them (its docstring describes the protocols)."""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton import cast, pdl_wait


@triton.jit
def sqrt_softplus(x):
    """DeepSeek-V4's router score ``sqrt(log(1 + exp(x)))``, as ``max(x, 0) + log1p(exp(-|x|))`` with log1p taken
    from ``log(1 + t)`` corrected for the rounding of ``1 + t`` (exact to a few ulps where ``t`` is tiny)."""
    t = tl.exp(-tl.abs(x))
    u = 1.0 + t
    exact = u == 1.0
    log1p = tl.where(exact, t, tl.log(u) * (t / tl.where(exact, 1.0, u - 1.0)))
    return tl.sqrt_rn(tl.maximum(x, 0.0) + log1p)


@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    w_ptr,
    ids_ptr,
    E,
    scaling,
    HAS_BIAS: tl.constexpr,
    SOFTMAX: tl.constexpr,
    SQRTSOFTPLUS: tl.constexpr,
    RENORM: tl.constexpr,
    N_GROUP: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)[:, None]
    j = tl.arange(0, BLOCK_S)[None, :]
    expert = g * GROUP_SIZE + j
    valid = (g < N_GROUP) & (j < GROUP_SIZE)
    x = tl.load(logits_ptr + t * E + expert, mask=valid, other=float("-inf"))
    if SOFTMAX:
        e = tl.exp(x - tl.max(tl.max(x, axis=1), axis=0))
        scores = e / tl.sum(tl.sum(e, axis=1), axis=0)
    elif SQRTSOFTPLUS:
        scores = sqrt_softplus(x)
    else:
        scores = 1.0 / (1.0 + tl.exp(-x))
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + expert, mask=valid, other=0.0)
    choice = tl.where(valid, choice, float("-inf"))
    if N_GROUP > 1:
        best = tl.max(choice, axis=1)
        if SOFTMAX:
            group_score = best
        else:  # sum of the two best experts of each group
            first = tl.argmax(choice, axis=1)
            second = tl.max(tl.where(j == first[:, None], float("-inf"), choice), axis=1)
            group_score = best + second
        group_score = tl.where(tl.arange(0, BLOCK_G) < N_GROUP, group_score, float("-inf"))
        keep = tl.zeros((BLOCK_G,), tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            pick = tl.argmax(group_score, axis=0)
            keep = tl.where(tl.arange(0, BLOCK_G) == pick, 1, keep)
            group_score = tl.where(tl.arange(0, BLOCK_G) == pick, float("-inf"), group_score)
        choice = tl.where(keep[:, None] != 0, choice, float("-inf"))
    flat_choice = tl.reshape(choice, (BLOCK_G * BLOCK_S,))
    flat_scores = tl.reshape(scores, (BLOCK_G * BLOCK_S,))
    flat_expert = tl.reshape(expert, (BLOCK_G * BLOCK_S,))
    k = tl.arange(0, BLOCK_K)
    ids = tl.zeros((BLOCK_K,), tl.int32)
    weights = tl.zeros((BLOCK_K,), tl.float32)
    for i in tl.static_range(TOP_K):
        pick = tl.argmax(flat_choice, axis=0)
        hit = tl.arange(0, BLOCK_G * BLOCK_S) == pick
        ids = tl.where(k == i, tl.sum(tl.where(hit, flat_expert, 0), axis=0), ids)
        weights = tl.where(k == i, tl.sum(tl.where(hit, flat_scores, 0.0), axis=0), weights)
        flat_choice = tl.where(hit, float("-inf"), flat_choice)
    if RENORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    tl.store(w_ptr + t * TOP_K + k, weights * scaling, mask=k < TOP_K)
    tl.store(ids_ptr + t * TOP_K + k, ids, mask=k < TOP_K)


@triton.jit
def _gather_rows_kernel(src_ptr, dst_ptr, src_rows_ptr, dst_rows_ptr, H, BLOCK: tl.constexpr):
    """dst[dst_rows[p]] = src[src_rows[p]] for each pair p with dst_rows[p] >= 0."""
    pdl_wait()
    p = tl.program_id(0).to(tl.int64)
    dst_row = tl.load(dst_rows_ptr + p).to(tl.int64)
    if dst_row < 0:
        return
    src_row = tl.load(src_rows_ptr + p).to(tl.int64)
    for c0 in range(0, H, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = cols < H
        tl.store(dst_ptr + dst_row * H + cols, tl.load(src_ptr + src_row * H + cols, mask=mask), mask=mask)


@triton.jit
def _expert_rows_kernel(
    ids_ptr,
    w_ptr,
    pair_rows_ptr,
    recv_ids_ptr,
    recv_w_ptr,
    masked_m_ptr,
    overflow_ptr,
    P,
    capacity,
    LOST_ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program e: the pairs naming expert e, in (token, slot) order, take its rows ``e * capacity + 0, 1, ...``;
    pairs past ``capacity`` are lost (``LOST_ROW``, and the overflow flag is set). Writes the pairs' rows, the ids and
    weights of expert e's rows (-1 and 0 where unused) and ``masked_m[e]``; program 0 also marks skipped pairs -1."""
    pdl_wait()
    e = tl.program_id(0)
    count = tl.full((), 0, tl.int32)
    for p0 in range(0, P, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + p, mask=p < P, other=-1)
        hit = ids == e
        slot = count + tl.cumsum(hit.to(tl.int32), axis=0) - 1
        delivered = hit & (slot < capacity)
        row = e * capacity + slot
        tl.store(pair_rows_ptr + p, tl.where(delivered, row, LOST_ROW), mask=hit)
        if e == 0:
            tl.store(pair_rows_ptr + p, -1, mask=(p < P) & (ids < 0))
        tl.store(recv_ids_ptr + row, e, mask=delivered)
        tl.store(recv_w_ptr + row, tl.load(w_ptr + p, mask=delivered, other=0.0), mask=delivered)
        count += tl.sum(hit.to(tl.int32), axis=0)
    kept = tl.minimum(count, capacity)
    tl.store(masked_m_ptr + e, kept)
    for s0 in range(kept, capacity, BLOCK):
        s = s0 + tl.arange(0, BLOCK)
        tl.store(recv_ids_ptr + e * capacity + s, -1, mask=s < capacity)
        tl.store(recv_w_ptr + e * capacity + s, 0.0, mask=s < capacity)
    if count > capacity:
        tl.store(overflow_ptr, 1)


@triton.jit
def _send_rows_kernel(
    x_ptr,
    scale_ptr,
    recv_ptr,
    recv_scale_ptr,
    pair_rows_ptr,
    H,
    S,
    K: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Program p (pair): copies token ``p // K``'s row (and scale row) to its received row, if it has one."""
    pdl_wait()
    p = tl.program_id(0).to(tl.int64)
    row = tl.load(pair_rows_ptr + p).to(tl.int64)
    if row < 0:
        return
    t = p // K
    for c0 in range(0, H, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        tl.store(recv_ptr + row * H + cols, tl.load(x_ptr + t * H + cols, mask=cols < H), mask=cols < H)
    if HAS_SCALE:
        cols = tl.arange(0, BLOCK_S)
        tl.store(recv_scale_ptr + row * S + cols, tl.load(scale_ptr + t * S + cols, mask=cols < S), mask=cols < S)


@triton.jit
def _pair_keys(ids_ptr, holders_ptr, rank_ptr, local_ptr, t, T, me, W, COPIES, K: tl.constexpr, KP: tl.constexpr):
    """Per pair of tokens ``t`` [BT] and slots [KP]: destination rank (W for a skipped or padding pair), local
    expert, validity, by the placement's replica rule."""
    j = tl.arange(0, KP)
    m = (t[:, None] < T) & (j[None, :] < K)
    e = tl.load(ids_ptr + t[:, None] * K + j[None, :], mask=m, other=-1)
    valid = e >= 0
    e = tl.where(valid, e, 0).to(tl.int64)
    copy = (t[:, None] + me) % tl.load(holders_ptr + e)
    d = tl.load(rank_ptr + e * COPIES + copy)
    local = tl.load(local_ptr + e * COPIES + copy)
    return tl.where(valid, d, W), local, valid


@triton.jit
def _count_kernel(
    ids_ptr, holders_ptr, rank_ptr, local_ptr, sent_ptr, stats_ptr, T, me, W, WIDTH, COPIES,
    K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BW: tl.constexpr, NK: tl.constexpr,
):  # fmt: skip
    """Pairs per (destination, local expert) and copies per destination into ``sent`` (atomics); this program's
    copies per destination and pairs per key (destination * WIDTH + local expert) into its row of ``stats``."""
    pdl_wait()
    pid = tl.program_id(0)
    t = pid * BT + tl.arange(0, BT)
    d, local, valid = _pair_keys(ids_ptr, holders_ptr, rank_ptr, local_ptr, t, T, me, W, COPIES, K, KP)
    tl.atomic_add(sent_ptr + d * (WIDTH + 1) + local, tl.full(local.shape, 1, tl.int64), mask=valid)
    w = tl.arange(0, BW)
    copies = tl.sum(tl.max((d[:, :, None] == w[None, None, :]).to(tl.int32), axis=1), axis=0)
    row = stats_ptr + pid * (W + W * WIDTH)
    tl.store(row + w, copies, mask=w < W)
    tl.atomic_add(sent_ptr + w * (WIDTH + 1) + WIDTH, copies.to(tl.int64), mask=w < W)
    keys = tl.reshape(tl.where(valid, d * WIDTH + local, -1), (BT * KP,))
    nk = tl.arange(0, NK)
    tl.store(row + W + nk, tl.sum((keys[:, None] == nk[None, :]).to(tl.int32), axis=0), mask=nk < W * WIDTH)


@triton.jit
def _pack_kernel(
    ids_ptr, holders_ptr, rank_ptr, local_ptr, w_ptr, x_ptr, send_ptr, pair_pos_ptr, copy_pos_ptr, stats_ptr, cum_ptr,
    T, me, W, WIDTH, COPIES, NPROG, ROW, SEND_ROW, K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr,
    BW: tl.constexpr, NK: tl.constexpr, BWID: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """Writes each copy (x's row, then its record) at its place in send order (destination, token), that place per
    (token, destination) (-1: no copy), and each pair's position in (destination, token, slot) order. ``cum`` is
    ``stats`` summed over programs (inclusive); rows are int32 words. A record is 4 x K int32: local expert (-1: not
    this copy's), weight bits, rank within the pair's (destination, local expert), rank within its destination."""
    pdl_wait()
    pid = tl.program_id(0)
    t = pid * BT + tl.arange(0, BT)
    d, local, valid = _pair_keys(ids_ptr, holders_ptr, rank_ptr, local_ptr, t, T, me, W, COPIES, K, KP)
    S = W + W * WIDTH
    mine, last = cum_ptr + pid * S, cum_ptr + (NPROG - 1) * S
    own = stats_ptr + pid * S
    # Copies and pairs of earlier programs, and of all programs, per destination and per key.
    w = tl.arange(0, BW)
    wm = w < W
    before_c = tl.load(mine + w, mask=wm, other=0) - tl.load(own + w, mask=wm, other=0)
    total_c = tl.load(last + w, mask=wm, other=0)
    start_c = tl.cumsum(total_c, axis=0) - total_c + before_c
    nk = tl.arange(0, NK)
    km = nk < W * WIDTH
    before_k = tl.load(mine + W + nk, mask=km, other=0) - tl.load(own + W + nk, mask=km, other=0)
    kw = W + w[:, None] * WIDTH + tl.arange(0, BWID)[None, :]
    kwm = wm[:, None] & (tl.arange(0, BWID)[None, :] < WIDTH)
    before_p = tl.sum(tl.load(mine + kw, mask=kwm, other=0) - tl.load(own + kw, mask=kwm, other=0), axis=1)
    total_p = tl.sum(tl.load(last + kw, mask=kwm, other=0), axis=1)
    start_p = tl.cumsum(total_p, axis=0) - total_p

    flat_valid = tl.reshape(valid, (BT * KP,))
    hit = (d[:, :, None] == w[None, None, :]).to(tl.int32)  # [BT, KP, BW]
    by_dest = tl.reshape(hit, (BT * KP, BW))
    dest_rank = tl.sum(by_dest * (before_p[None, :] + tl.cumsum(by_dest, axis=0) - by_dest), axis=1)
    pair_pos = tl.where(flat_valid, tl.sum(by_dest * start_p[None, :], axis=1) + dest_rank, tl.sum(total_p, axis=0))
    keys = tl.reshape(tl.where(valid, d * WIDTH + local, -1), (BT * KP,))
    by_key = (keys[:, None] == nk[None, :]).to(tl.int32)
    key_rank = tl.sum(by_key * (before_k[None, :] + tl.cumsum(by_key, axis=0) - by_key), axis=1)
    j = tl.arange(0, KP)
    jk = (t[:, None] < T) & (j[None, :] < K)
    tj = t[:, None] * K + j[None, :]
    tl.store(pair_pos_ptr + tj, tl.reshape(pair_pos, (BT, KP)).to(tl.int64), mask=jk)

    present = tl.max(hit, axis=1)  # [BT, BW]
    pos_c = start_c[None, :] + tl.cumsum(present, axis=0) - present
    weight_bits = tl.load(w_ptr + tj, mask=jk, other=0.0).to(tl.int32, bitcast=True)
    key_rank = tl.reshape(key_rank, (BT, KP))
    dest_rank = tl.reshape(dest_rank, (BT, KP))
    tm = t < T
    for dd in range(0, W):
        here = (tl.sum(tl.where(w[None, :] == dd, present, 0), axis=1) > 0) & tm
        pos = tl.sum(tl.where(w[None, :] == dd, pos_c, 0), axis=1).to(tl.int64)
        tl.store(copy_pos_ptr + t * W + dd, tl.where(here, pos, -1), mask=tm)
        row = pos * SEND_ROW
        mine_j = d == dd
        rec = send_ptr + row[:, None] + ROW + j[None, :]
        rm = here[:, None] & (j[None, :] < K)
        tl.store(rec, tl.where(mine_j, local, -1).to(tl.int32), mask=rm)
        tl.store(rec + K, tl.where(mine_j, weight_bits, -1), mask=rm)
        tl.store(rec + 2 * K, tl.where(mine_j, key_rank, -1), mask=rm)
        tl.store(rec + 3 * K, tl.where(mine_j, dest_rank, -1), mask=rm)
        for c0 in range(0, ROW, BC):
            cols = c0 + tl.arange(0, BC)
            cm = cols[None, :] < ROW
            v = tl.load(x_ptr + t[:, None].to(tl.int64) * ROW + cols[None, :], mask=tm[:, None] & cm)
            tl.store(send_ptr + row[:, None] + cols[None, :], v, mask=here[:, None] & cm)


@triton.jit
def _unpack_kernel(
    buf_ptr, gid_ptr, expert_base_ptr, source_base_ptr, copy_start_ptr, out0_ptr, out1_ptr, ids_ptr, w_ptr,
    final_ptr, copy_rows_ptr, copy_w_ptr, C, W, E_LOCAL, BUF_ROW, ROW, SPLIT, K: tl.constexpr, BCP: tl.constexpr,
    BW: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """Slot ``program_id(1)`` of received copies ``c``: the pair's layout row from its record and its source's
    bases; its copy's words go to that row of ``out0`` (the first SPLIT) and ``out1`` (the rest), with its id and
    weight; ``final[receive index] = row``, ``copy_rows[c, slot] = row`` and ``copy_w[c, slot]`` its weight (-1 and 0
    for a slot not sent here)."""
    pdl_wait()
    c = tl.program_id(0) * BCP + tl.arange(0, BCP)
    j = tl.program_id(1)
    cm = c < C
    rec = buf_ptr + c.to(tl.int64) * BUF_ROW + ROW + j
    local = tl.load(rec, mask=cm, other=-1)
    mask = cm & (local >= 0)
    w = tl.arange(0, BW)
    ends = tl.load(copy_start_ptr + 1 + w, mask=w < W, other=2**62)
    source = tl.sum((c[:, None] >= ends[None, :]).to(tl.int32), axis=1)
    row = tl.load(expert_base_ptr + source * E_LOCAL + local, mask=mask, other=0) + tl.load(rec + 2 * K, mask=mask)
    weight = tl.load(rec + K, mask=mask, other=0).to(tl.float32, bitcast=True)
    tl.store(copy_rows_ptr + c.to(tl.int64) * K + j, tl.where(mask, row, -1).to(tl.int64), mask=cm)
    tl.store(copy_w_ptr + c.to(tl.int64) * K + j, weight, mask=cm)
    tl.store(final_ptr + tl.load(source_base_ptr + source, mask=mask, other=0) + tl.load(rec + 3 * K, mask=mask), row,
             mask=mask)  # fmt: skip
    tl.store(ids_ptr + row, tl.load(gid_ptr + local, mask=mask), mask=mask)
    tl.store(w_ptr + row, weight, mask=mask)
    src = buf_ptr + c.to(tl.int64)[:, None] * BUF_ROW
    for c0 in range(0, ROW, BC):
        cols = c0 + tl.arange(0, BC)[None, :]
        v = tl.load(src + cols, mask=mask[:, None] & (cols < ROW))
        tl.store(out0_ptr + row[:, None] * SPLIT + cols, v, mask=mask[:, None] & (cols < SPLIT))
        rest = mask[:, None] & (cols >= SPLIT) & (cols < ROW)
        tl.store(out1_ptr + row[:, None] * (ROW - SPLIT) + cols - SPLIT, v, mask=rest)


@triton.jit
def _gathered_keys(ids_ptr, holders_ptr, rank_ptr, local_ptr, p, P, per_rank, WIDTH, COPIES, K: tl.constexpr):
    """Per flat pair ``p`` of the gathered routing (slot ``p // K`` holds token ``slot % per_rank`` of rank ``slot //
    per_rank``): its key, destination * WIDTH + local expert by the placement's replica rule (-1 for a skipped or
    padding pair), and its expert id."""
    e = tl.load(ids_ptr + p, mask=p < P, other=-1)
    valid = e >= 0
    e64 = tl.where(valid, e, 0).to(tl.int64)
    slot = p // K
    copy = (slot % per_rank + slot // per_rank) % tl.load(holders_ptr + e64, mask=valid, other=1)
    d = tl.load(rank_ptr + e64 * COPIES + copy, mask=valid, other=0)
    local = tl.load(local_ptr + e64 * COPIES + copy, mask=valid, other=0)
    return tl.where(valid, d * WIDTH + local, -1), e


@triton.jit
def _place_kernel(
    ids_ptr, w_ptr, holders_ptr, rank_ptr, local_ptr, rows_ptr, mine_ptr, lost_ptr, recv_ids_ptr, recv_w_ptr,
    masked_m_ptr, overflow_ptr, P, per_rank, me, WIDTH, COPIES, N_LOCAL, max_m, K: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program ``key`` (destination * WIDTH + local expert): its pairs, in flat order, take ranks 0, 1, ...; those
    below ``max_m`` are delivered. Writes each of its pairs' ``rows`` (layout row where held here, else -1) and
    ``mine``, marks the slots of pairs past ``max_m`` in ``lost`` and sets ``overflow``; for a key of this rank, the
    ids and weights of its rows (-1 and 0 where unused) and its ``masked_m``. Program 0 also writes the skipped
    pairs (-1, not mine)."""
    pdl_wait()
    key = tl.program_id(0)
    lidx = key % WIDTH
    own = (key // WIDTH == me) & (lidx < N_LOCAL)
    count = tl.full((), 0, tl.int32)
    for p0 in range(0, P, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        keys, e = _gathered_keys(ids_ptr, holders_ptr, rank_ptr, local_ptr, p, P, per_rank, WIDTH, COPIES, K)
        hit = keys == key
        rank = count + tl.cumsum(hit.to(tl.int32), axis=0) - 1
        delivered = hit & (rank < max_m) & (tl.zeros((BLOCK,), tl.int32) + own.to(tl.int32) > 0)  # own, per lane
        row = lidx * max_m + rank
        tl.store(rows_ptr + p, tl.where(delivered, row, -1).to(tl.int64), mask=hit)
        tl.store(mine_ptr + p, delivered.to(tl.int8), mask=hit)
        tl.store(lost_ptr + p // K, tl.full((BLOCK,), 1, tl.int8), mask=hit & (rank >= max_m))
        if key == 0:
            skipped = (p < P) & (keys < 0)
            tl.store(rows_ptr + p, tl.full((BLOCK,), -1, tl.int64), mask=skipped)
            tl.store(mine_ptr + p, tl.zeros((BLOCK,), tl.int8), mask=skipped)
        tl.store(recv_ids_ptr + row, e, mask=delivered)
        tl.store(recv_w_ptr + row, tl.load(w_ptr + p, mask=delivered, other=0.0), mask=delivered)
        count += tl.sum(hit.to(tl.int32), axis=0)
    if own:
        kept = tl.minimum(count, max_m)
        tl.store(masked_m_ptr + lidx, kept)
        for s0 in range(kept, max_m, BLOCK):
            s = s0 + tl.arange(0, BLOCK)
            tl.store(recv_ids_ptr + lidx * max_m + s, tl.full((BLOCK,), -1, tl.int32), mask=s < max_m)
            tl.store(recv_w_ptr + lidx * max_m + s, tl.zeros((BLOCK,), tl.float32), mask=s < max_m)
    if count > max_m:
        tl.store(overflow_ptr, 1)


@triton.jit
def _place_rows_kernel(src_ptr, out0_ptr, out1_ptr, rows_ptr, SRC_ROW, ROW, SPLIT, K: tl.constexpr, BC: tl.constexpr):
    """Program p (pair): if held here, its slot's payload words (``ROW`` int32, the first ``SPLIT`` to ``out0``, the
    rest to ``out1``) go to its layout row."""
    pdl_wait()
    p = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + p)
    if row < 0:
        return
    src = src_ptr + (p // K) * SRC_ROW
    for c0 in range(0, ROW, BC):
        cols = c0 + tl.arange(0, BC)
        v = tl.load(src + cols, mask=cols < ROW)
        tl.store(out0_ptr + row * SPLIT + cols, v, mask=cols < SPLIT)
        tl.store(out1_ptr + row * (ROW - SPLIT) + cols - SPLIT, v, mask=(cols >= SPLIT) & (cols < ROW))


@triton.jit
def _combine_kernel(y_ptr, rows_ptr, w_ptr, out_ptr, H, K: tl.constexpr, BLOCK: tl.constexpr):
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(K):  # slot order: the sum never depends on other tokens
        row = tl.load(rows_ptr + t * K + j).to(tl.int64)
        if row >= 0:
            w = tl.load(w_ptr + t * K + j)
            acc += w * tl.load(y_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
        elif row == -2:  # a row lost to capacity overflow: the token's result is NaN, never silently short
            acc += float("nan")
    tl.store(out_ptr + t * H + cols, cast(acc, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _route_hash_kernel(
    logits_ptr,
    ids_ptr,
    w_ptr,
    out_ids_ptr,
    E,
    stride_t,
    stride_ids,
    stride_k,
    scaling,
    SCORING: tl.constexpr,
    RENORM: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One token: the scores of its given experts (SCORING 0 sigmoid, 1 softmax over all E, 2 sqrt-softplus)."""
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    ids = tl.load(ids_ptr + t * stride_ids + k * stride_k, mask=k < TOP_K, other=0)
    x = tl.load(logits_ptr + t * stride_t + ids, mask=k < TOP_K, other=0.0)
    if SCORING == 0:
        scores = 1.0 / (1.0 + tl.exp(-x))
    elif SCORING == 1:
        row_max = float("-inf")
        for start in range(0, E, 1024):
            cols = start + tl.arange(0, 1024)
            row_max = tl.maximum(
                row_max, tl.max(tl.load(logits_ptr + t * stride_t + cols, mask=cols < E, other=float("-inf")), axis=0)
            )
        total = 0.0
        for start in range(0, E, 1024):
            cols = start + tl.arange(0, 1024)
            v = tl.load(logits_ptr + t * stride_t + cols, mask=cols < E, other=float("-inf"))
            total += tl.sum(tl.exp(v - row_max), axis=0)
        scores = tl.exp(x - row_max) / total
    else:
        scores = sqrt_softplus(x)
    scores = tl.where(k < TOP_K, scores, 0.0)
    if RENORM:
        scores = scores / (tl.sum(scores, axis=0) + 1e-20)
    tl.store(w_ptr + t * TOP_K + k, scores * scaling, mask=k < TOP_K)
    tl.store(out_ids_ptr + t * TOP_K + k, ids, mask=k < TOP_K)
