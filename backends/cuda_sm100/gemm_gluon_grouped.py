"""FP8 block-scaled ``grouped_gemm`` for Hopper (SM90) in Gluon, contiguous layout: the routed experts of a long prefill
chunk, where every expert holds hundreds of rows (``supports``: ``MIN_ROWS_PER_EXPERT`` on average).

The Triton kernel (``gemm_triton._grouped_gemm_kernel``) stays near 42% of the FP8 peak at any tile (NOTES.md,
grouped_gemm): each 128-deep product is waited for and scaled in the same warps that issue the next copy. This is
``gemm_gluon.fp8_gemm_ws`` (streamed schedule) over the experts' row blocks: one program per SM, a producer warp
copying K blocks by TMA into a ring of stages, consumer warpgroups of 64 rows each (``TILE_CONSUMERS``: three, as
the dense kernel), every 128-deep product from zero and then scaled into the accumulator by one FMA in K order, the
Triton kernel's arithmetic for each element.

What differs from the dense kernel:
- the row tiles: ``_tile_table_kernel`` lists, on the device (no host synchronisation), each tile of one expert's
  rows, 64 per consumer: (expert, first row, the expert's end row), and how many tiles there are. Tiles never cross
  experts; a consumer whose 64 rows start past its expert's end skips its products (still waiting for and releasing
  each stage, so the ring's phases stay in step);
- the weight's rows and scales are expert ``e``'s: B is read as ``[E * N, K]`` from row ``e * N``;
- a consumer's 64 rows are stored by TMA where they all belong to its expert; a block that runs past the expert's
  end is stored from shared memory in 16-byte runs under a row mask (a TMA store would overwrite the next expert's
  rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from deepinfer import Decline, QTensor

from ._gluon import BARRIER, TMA_LOAD, TMA_STORE
from ._triton import INTERPRET, PDL, hopper, num_sms, on_device, pdl_wait, tma_ready
from .gemm import FP8_BLOCK, _as_fp8
from .gemm_gluon import BK, BM, BN, WG_ROWS, _descriptors, _factor, _next_tile, _tile_coords, _tiles

# consumer warpgroups of 64 rows: a row tile's rows (an expert's last tile is part empty); the measured kernel has 3,
# 2 (128-row tiles: 256 rows per expert in whole tiles) compiles and has not run on a GPU
TILE_CONSUMERS = 3
GROUP_M = 8  # row tiles walked together down the column blocks
STAGES = 4
CONSUMER_REGS, PRODUCER_REGS = 152, 56  # as the dense kernel's streamed schedule
# At 512 and 1024 rows per expert it ran at 1.22-1.42x the Triton kernel's speed, at 128 1.03-1.07x, at 256 (tiles of
# 192 and 64 rows, a third of the consumers idle) 0.76-0.80x, with the same bits (H100, benchmarks/HISTORY.md)
MIN_ROWS_PER_EXPERT = 384
STORE_ROWS = gl.constexpr(16)  # rows per pass of a masked store
TABLE_BLOCK = 64  # row tiles listed per program of ``_tile_table_kernel``


@triton.jit
def _tile_table_kernel(offsets_ptr, table_ptr, E, MAX_TILES, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                       ROWS: tl.constexpr):  # fmt: skip
    """``table[0, t]``, ``table[1, t]``, ``table[2, t]``: row tile ``t``'s expert, first row and the expert's end row,
    tiles numbered expert by expert, ``ROWS`` rows each (the last of an expert part empty); ``table[3, 0]``: how many
    tiles there are. Entries past that count are not written."""
    pdl_wait()
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    starts = tl.load(offsets_ptr + experts, mask=experts < E, other=0)
    stops = tl.load(offsets_ptr + 1 + experts, mask=experts < E, other=0)
    tiles = tl.cdiv(stops - starts, ROWS)  # row tiles of each expert (0 past E)
    ends = tl.cumsum(tiles, axis=0)  # one past each expert's last tile
    e = tl.sum((tl.where(experts < E, ends, MAX_TILES + 1)[None, :] <= t[:, None]).to(tl.int32), axis=1)
    first_tile = tl.sum(tl.where(experts[None, :] == e[:, None], (ends - tiles)[None, :], 0), axis=1)
    valid = (t < tl.sum(tiles, axis=0)) & (e < E)
    row0 = tl.load(offsets_ptr + e, mask=valid, other=0) + (t - first_tile) * ROWS
    tl.store(table_ptr + t, e, mask=valid)
    tl.store(table_ptr + MAX_TILES + t, row0, mask=valid)
    tl.store(table_ptr + 2 * MAX_TILES + t, tl.load(offsets_ptr + e + 1, mask=valid, other=0), mask=valid)
    if tl.program_id(0) == 0:
        tl.store(table_ptr + 3 * MAX_TILES, tl.sum(tiles, axis=0))


@gluon.jit
def _producer(a_desc, b_desc, a_s, b_s, ready, empty, table_ptr, MAX_TILES, N, K_BLOCKS: gl.constexpr,
              GROUP_M: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr):  # fmt: skip
    """One warp: each K block of each of the program's tiles, A's three 64-row blocks and expert ``e``'s B block, into
    the stage ring once every consumer is done with the stage's previous block."""
    a_bytes: gl.constexpr = a_desc.block_type.nbytes
    b_bytes: gl.constexpr = b_desc.block_type.nbytes
    m_rows = gl.load(table_ptr + 3 * MAX_TILES) * BM  # the tiles, in the dense walk's rows (``_tiles``)
    first, stop, step, grid_n = _tiles(m_rows, N, GROUP_M)
    it = 0
    pid_m, pid_n = _tile_coords(gl.minimum(first, stop - 1), m_rows, grid_n, GROUP_M)  # (no tile: unused)
    for tile in range(first, stop, step):
        expert = gl.load(table_ptr + pid_m)
        row0 = gl.load(table_ptr + MAX_TILES + pid_m)
        for kb in range(K_BLOCKS):
            stage = it % STAGES
            bar = ready.index(stage)
            mbarrier.wait(empty.index(stage), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(bar, CONSUMERS * a_bytes + b_bytes)
            for c in gl.static_range(CONSUMERS):
                TMA_LOAD(a_desc, [row0 + c * WG_ROWS, kb * BK], bar, a_s.index(stage * CONSUMERS + c))
            TMA_LOAD(b_desc, [expert * N + pid_n * BN, kb * BK], bar, b_s.index(stage))
            it += 1
        pid_m, pid_n = _next_tile(tile, step, pid_m, pid_n, m_rows, grid_n, GROUP_M)


@gluon.jit
def _store(c_desc, c_s, c_ptr, acc, row, row_end, col, N):
    """Rows ``row + [0, 64)`` of ``acc`` that lie before ``row_end`` into C[:, col : col + BN], through the consumer's
    shared buffer once its previous copy has read it: by TMA where all 64 rows do, otherwise ``STORE_ROWS`` rows at a
    time in 16-byte runs under a row mask."""
    runs: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    tma.store_wait(0)
    BARRIER()
    c_s.store(acc.to(gl.bfloat16))
    fence_async_shared()
    BARRIER()  # every thread's part is in shared memory before it is copied out
    if row + WG_ROWS <= row_end:
        TMA_STORE(c_desc, [row, col], c_s)
    else:
        for i in gl.static_range(WG_ROWS // STORE_ROWS):
            vals = c_s.slice(i * STORE_ROWS, STORE_ROWS).load(runs)
            offs_m = row + i * STORE_ROWS + gl.arange(0, STORE_ROWS, layout=gl.SliceLayout(1, runs))
            cols = col + gl.arange(0, BN, layout=gl.SliceLayout(0, runs))
            ptrs = c_ptr + gl.expand_dims(offs_m.to(gl.int64) * N, 1) + gl.expand_dims(cols, 0)
            gl.store(ptrs, vals, mask=gl.expand_dims(offs_m < row_end, 1) & gl.expand_dims(cols < N, 0))


@gluon.jit
def _consumer(a_s, b_s, c_s, ready, empty, c_desc, c_ptr, as_ptr, bs_ptr, table_ptr, MAX_TILES, N,
              PART: gl.constexpr, K_BLOCKS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
              CONSUMERS: gl.constexpr):  # fmt: skip
    """One warpgroup: rows ``64 PART + [0, 64)`` of each tile, as ``gemm_gluon._consumer`` (streamed), its products
    skipped where those rows start past the expert's end."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
    zero = gl.zeros([WG_ROWS, BN], gl.float32, mma)
    rows = PART * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, mma))
    m_rows = gl.load(table_ptr + 3 * MAX_TILES) * BM
    first, stop, step, grid_n = _tiles(m_rows, N, GROUP_M)
    n_blocks = N // BN
    it = 0
    pid_m, pid_n = _tile_coords(gl.minimum(first, stop - 1), m_rows, grid_n, GROUP_M)  # (no tile: unused)
    for tile in range(first, stop, step):
        expert = gl.load(table_ptr + pid_m)
        row0 = gl.load(table_ptr + MAX_TILES + pid_m)
        row_end = gl.load(table_ptr + 2 * MAX_TILES + pid_m)
        active = row0 + PART * WG_ROWS < row_end
        offs_m = row0 + rows
        b_block = expert * n_blocks + pid_n
        factor = _factor(as_ptr, bs_ptr, offs_m, row_end, K_BLOCKS, 0, b_block)
        acc = zero
        for kb in range(K_BLOCKS):
            stage = it % STAGES
            mbarrier.wait(ready.index(stage), (it // STAGES) & 1)
            if active:
                a = a_s.index(stage * CONSUMERS + PART)
                part = warpgroup_mma(a, b_s.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)
                next_factor = _factor(as_ptr, bs_ptr, offs_m, row_end, K_BLOCKS, gl.minimum(kb + 1, K_BLOCKS - 1),
                                      b_block)  # fmt: skip
                part = warpgroup_mma_wait(0, deps=[part])
                mbarrier.arrive(empty.index(stage), count=1)
                acc = acc + part * factor
                factor = next_factor
            else:
                mbarrier.arrive(empty.index(stage), count=1)
            it += 1
        if active:
            _store(c_desc, c_s, c_ptr, acc, row0 + PART * WG_ROWS, row_end, pid_n * BN, n_blocks * BN)
        pid_m, pid_n = _next_tile(tile, step, pid_m, pid_n, m_rows, grid_n, GROUP_M)
    tma.store_wait(0)


@gluon.jit
def fp8_grouped_ws(a_desc, b_desc, c_desc, c_ptr, as_ptr, bs_ptr, table_ptr, MAX_TILES, N, K_BLOCKS: gl.constexpr,
                   GROUP_M: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                   PRODUCER_REGS: gl.constexpr, CONSUMERS: gl.constexpr):  # fmt: skip
    """C[rows, N] (bf16): each expert's rows of A[rows, K] against its weight B[e] ([E * N, K] in all), A scales
    [rows, K/128], B scales [E, N/128, K/128], K = 128 K_BLOCKS, N a multiple of 128, over the row tiles of
    ``64 CONSUMERS`` rows in ``table_ptr`` (``_tile_table_kernel``). Launched with 4 warps (the first consumer), to
    which each other consumer (2 or 3 in all) adds 4 and the producer 1; one program per SM."""
    a_s = gl.allocate_shared_memory(a_desc.dtype, [STAGES * CONSUMERS, WG_ROWS, BK], a_desc.layout)
    b_s = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
    c_s = gl.allocate_shared_memory(gl.bfloat16, [CONSUMERS, WG_ROWS, BN], c_desc.layout)  # a buffer per consumer
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)  # every consumer releases a stage
    fence_async_shared()
    if CONSUMERS == 3:
        gl.warp_specialize(
            [
                (_consumer, (a_s, b_s, c_s.index(0), ready, empty, c_desc, c_ptr, as_ptr, bs_ptr, table_ptr,
                             MAX_TILES, N, 0, K_BLOCKS, GROUP_M, STAGES, CONSUMERS)),
                (_consumer, (a_s, b_s, c_s.index(1), ready, empty, c_desc, c_ptr, as_ptr, bs_ptr, table_ptr,
                             MAX_TILES, N, 1, K_BLOCKS, GROUP_M, STAGES, CONSUMERS)),
                (_consumer, (a_s, b_s, c_s.index(2), ready, empty, c_desc, c_ptr, as_ptr, bs_ptr, table_ptr,
                             MAX_TILES, N, 2, K_BLOCKS, GROUP_M, STAGES, CONSUMERS)),
                (_producer, (a_desc, b_desc, a_s, b_s, ready, empty, table_ptr, MAX_TILES, N, K_BLOCKS, GROUP_M,
                             STAGES, CONSUMERS)),
            ],
            [4, 4, 1],
            [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip
    else:  # (Gluon builds the partitions from literal lists: one call per consumer count)
        gl.warp_specialize(
            [
                (_consumer, (a_s, b_s, c_s.index(0), ready, empty, c_desc, c_ptr, as_ptr, bs_ptr, table_ptr,
                             MAX_TILES, N, 0, K_BLOCKS, GROUP_M, STAGES, CONSUMERS)),
                (_consumer, (a_s, b_s, c_s.index(1), ready, empty, c_desc, c_ptr, as_ptr, bs_ptr, table_ptr,
                             MAX_TILES, N, 1, K_BLOCKS, GROUP_M, STAGES, CONSUMERS)),
                (_producer, (a_desc, b_desc, a_s, b_s, ready, empty, table_ptr, MAX_TILES, N, K_BLOCKS, GROUP_M,
                             STAGES, CONSUMERS)),
            ],
            [4, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip


def tile_table(expert_offsets: torch.Tensor, rows: int, tile_rows: int) -> tuple[torch.Tensor, int]:
    """``(table, max_tiles)``: ``_tile_table_kernel``'s int32 table of the row tiles of ``rows`` rows over
    ``expert_offsets`` (E + 1 ascending ints), for at most ``max_tiles = ceil(rows / tile_rows) + E`` tiles."""
    experts = expert_offsets.numel() - 1
    max_tiles = triton.cdiv(rows, tile_rows) + experts
    table = torch.empty(3 * max_tiles + 1, dtype=torch.int32, device=expert_offsets.device)
    _tile_table_kernel[(triton.cdiv(max_tiles, TABLE_BLOCK),)](
        expert_offsets, table, experts, max_tiles, BLOCK_T=TABLE_BLOCK, BLOCK_E=triton.next_power_of_2(experts),
        ROWS=tile_rows, launch_pdl=PDL,
    )  # fmt: skip
    return table, max_tiles


def grouped_gemm(a, w: QTensor, *, expert_offsets, masked_m, out_dtype, out=None) -> torch.Tensor:
    """``ops.grouped_gemm``, contiguous layout, bf16 result: a bf16 ``a`` is quantised first (as ``gemm.grouped_gemm``
    does)."""
    del out  # a new result: the op copies it into `out`
    if masked_m is not None or expert_offsets is None or out_dtype != torch.bfloat16:
        raise ValueError("gemm_gluon_grouped serves the contiguous layout with a bf16 result only (see supports)")
    qa = _as_fp8(a, w)
    rows, k = qa.data.shape
    experts, n, _ = w.shape
    out = torch.empty(rows, n, dtype=torch.bfloat16, device=qa.data.device)
    if rows == 0:
        return out
    table, max_tiles = tile_table(expert_offsets.to(torch.int32).contiguous(), rows, 64 * TILE_CONSUMERS)
    b = w.data.contiguous().view(experts * n, k)
    programs = min(max_tiles * (n // BN.value), num_sms(qa.data.device.index or 0))
    fp8_grouped_ws[(programs,)](
        *_descriptors(qa.data.contiguous(), b, out), out, qa.scale.contiguous(), w.scale.contiguous(), table,
        max_tiles, n, K_BLOCKS=k // FP8_BLOCK, GROUP_M=GROUP_M, STAGES=STAGES, CONSUMER_REGS=CONSUMER_REGS,
        PRODUCER_REGS=PRODUCER_REGS, CONSUMERS=TILE_CONSUMERS, num_warps=4,
        enable_fp_fusion=True,  # one FFMA per scaled block, as the Triton kernel
    )  # fmt: skip
    return out


def supports(a, w, *, expert_offsets, masked_m, out_dtype, out=None) -> bool | Decline:
    """An SM90 GPU; the contiguous layout with at least ``MIN_ROWS_PER_EXPERT`` rows per expert on average; a
    contiguous e4m3 (128, 128)-scaled weight [E, N, K] with N and K multiples of 128; a 2-D bf16 or (1, 128)-scaled
    e4m3 activation; a bf16 result."""
    a_data = a.data if isinstance(a, QTensor) else a
    e4m3 = torch.float8_e4m3fn
    if not isinstance(w, QTensor) or w.block != (FP8_BLOCK, FP8_BLOCK) or w.data.dtype != e4m3:
        return Decline(f"w is not an FP8 QTensor of e4m3 with ({FP8_BLOCK}, {FP8_BLOCK}) scale blocks")
    if masked_m is not None or expert_offsets is None:
        return Decline("the masked layout (masked_m), not the contiguous one")
    if INTERPRET:
        return Decline("Gluon does not run in the Triton interpreter")
    fp8_rows = isinstance(a, QTensor) and (a.block, a_data.dtype) == ((1, FP8_BLOCK), e4m3)
    if not (fp8_rows or a_data.dtype == torch.bfloat16) or a_data.dim() != 2:
        return Decline(f"a is not a 2-D bf16 or (1, {FP8_BLOCK})-scaled e4m3 matrix")
    experts, n, k = w.shape
    if n % BN.value or k % FP8_BLOCK:
        return Decline(f"w is {list(w.shape)}: N or K not a multiple of {FP8_BLOCK}")
    if out_dtype != torch.bfloat16:
        return Decline(f"out_dtype is {out_dtype}, expected torch.bfloat16")
    if a_data.shape[0] < MIN_ROWS_PER_EXPERT * experts:
        return Decline(f"{a_data.shape[0]} rows over {experts} experts: fewer than {MIN_ROWS_PER_EXPERT} per expert")
    if not on_device(a_data, w.data, expert_offsets) or not hopper(a_data.device.index or 0):
        return Decline("a, w and expert_offsets are not on an SM90 (Hopper) GPU")
    if not w.data.is_contiguous() or not tma_ready(a_data, w.data.view(experts * n, k)):
        return Decline("a or w cannot be read by TMA copies (w not contiguous, or rows not 16-byte aligned)")
    return True
