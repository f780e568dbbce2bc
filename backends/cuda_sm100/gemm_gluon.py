"""FP8 block-scaled ``gemm`` for Hopper (SM90) in Gluon: a warp-specialized, persistent kernel with 192 x 128 tiles.
``plugin`` registers it ahead of cuBLAS where ``supports`` says so: short K (at most 1024; in DeepSeek-V3 ``wkv_b``,
(N, K) = (32768, 512)) from 384 rows on, where it measured 1.14-1.29x cuBLAS's speed (benchmarks/RESULTS.md).

Why there: at short K a tile's product is over in a few blocks, and copies from L2 set the pace when A and B blocks
stream in for every tile (Nsight Compute: the L2 at 76% of its throughput, NOTES.md). Two schedules:
- ``RESIDENT`` (K <= 512, the one ``gemm`` takes): a row block's whole A, [192, K], stays in shared memory while
  the program walks a contiguous run of tiles along N, so only B streams: 0.0026 bytes from L2 per FLOP instead of
  0.0065: 1.07-1.14x the streamed schedule at 2048-4096 rows, even at 8192;
- ``STREAMED`` (K up to 1024): the A blocks stream beside B, tiles walked ``GROUP_M`` row blocks at a time.

In both, one program per SM walks its tiles:
- a producer warp streams the K blocks into a ring of ``STAGES`` shared-memory stages by TMA, running ahead across
  tile boundaries;
- three consumer warpgroups each own 64 of the tile's rows: per K block a 128-deep product from zero (``wgmma``),
  waited for, then ``acc + part * (a_scale * b_scale)``;
- each consumer stores its 64 x 128 bf16 result by TMA from its own shared buffer.

The arithmetic of every element is the unsplit ``tl`` kernel's (``gemm_triton._gemm_kernel``): the K-ordered sum of
128-deep products, each from zero and scaled; the bits are the same (``benchmarks/gluon_gemm_ws.py`` checks each
launch, conformance checks rows alone against the batch), so batch-invariant mode takes it too.

``fp8_gemm_few_rows`` serves up to 192 rows with the operands swapped (the weight's rows as wgmma's M, as
``gemm_triton._gemm_swapped_kernel`` does): one program per 64 weight rows and 16, 32 or 64 rows of A, a warp copying
the K blocks by TMA eight stages ahead, one warpgroup multiplying two K blocks at a time (both products in flight, then
each scaled and added in K order), every block's scale factor computed first into shared memory. Without a split over
K it gives the unsplit bits in both modes; it serves where its grid fits the SMs once and fills enough of them
(``few_rows_supports``; benchmarks/HISTORY.md, 2026-12-04 — the few-row Gluon FP8 ``gemm`` up to 192 rows). Up to 8
rows, where few weight tiles leave most SMs idle, batch-invariant mode runs it in K groups: each group's program
multiplies a quarter of the K blocks and stores the products, then chains a quarter of the tile's weight rows over
all of them in K order (the same bits; benchmarks/HISTORY.md, 2026-12-04 — the few-row Gluon FP8 ``gemm`` in K
groups).

The few-row kernel also serves ``gemm_cublas.gemm_fp8_cublas_waves``: cuBLAS over the rows of whole waves of tiles,
this kernel over the rest.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import triton
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
from deepinfer.dispatch import batch_invariant_enabled

from ._gluon import BARRIER, TMA_LOAD, TMA_STORE, launch_dependents, plain_rows, tma_descriptor, wait_previous
from ._triton import INTERPRET, PDL, hopper, num_sms, on_device, tma_ready
from .gemm import FP8_BLOCK, _as_fp8

BK = gl.constexpr(128)  # K blocks of 128: one activation scale and one weight scale each
BN = gl.constexpr(128)  # tile columns: one weight scale block
WG_ROWS = gl.constexpr(64)  # rows per consumer warpgroup (wgmma's M)
CONSUMERS = gl.constexpr(3)  # consumer warpgroups: 192-row tiles
BM = gl.constexpr(192)


@gluon.jit
def _tiles(M, N, GROUP_M: gl.constexpr):
    """This program's walk over the output tiles: (first, stop, step, column blocks). ``GROUP_M`` 0: a contiguous run
    in row-major order, so that the program changes row blocks (and, with resident A, reloads A) once or twice;
    otherwise every ``num_programs``-th tile."""
    grid_n = gl.cdiv(N, BN)
    tiles = gl.cdiv(M, BM) * grid_n
    pid, programs = gl.program_id(0), gl.num_programs(0)
    first, stop, step = pid, tiles, programs
    if GROUP_M == 0:
        first, stop, step = pid * tiles // programs, (pid + 1) * tiles // programs, 1
    return first, stop, step, grid_n


@gluon.jit
def _tile_coords(tile, M, grid_n, GROUP_M: gl.constexpr):
    """Tile ``tile``'s (row block, column block): row-major for ``GROUP_M`` 0; otherwise grouped ``GROUP_M`` row
    blocks at a time, so that the tiles the programs hold at once share their A and B blocks in L2."""
    if GROUP_M == 0:
        pid_m = tile // grid_n
        pid_n = tile % grid_n
    else:
        group = GROUP_M * grid_n
        first_m = tile // group * GROUP_M
        rows = gl.minimum(gl.cdiv(M, BM) - first_m, GROUP_M)
        pid_m = first_m + (tile % group) % rows
        pid_n = (tile % group) // rows
    return pid_m, pid_n


@gluon.jit
def _next_tile(tile, step, pid_m, pid_n, M, grid_n, GROUP_M: gl.constexpr):
    """The coordinates of the program's tile after ``tile``. In a run, the next column block: stepping instead of
    dividing by ``grid_n`` (an ``MUFU.RCP`` sequence on each tile's path) measured 1.02-1.12x (NOTES.md)."""
    if GROUP_M == 0:
        pid_n += 1
        if pid_n == grid_n:
            pid_n = 0
            pid_m += 1
    else:
        pid_m, pid_n = _tile_coords(tile + step, M, grid_n, GROUP_M)
    return pid_m, pid_n


@gluon.jit
def _producer(a_desc, b_desc, a_s, b_s, a_ready, a_empty, ready, empty, M, N, K_BLOCKS: gl.constexpr,
              RESIDENT: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """One warp: every K block of B of every tile this program owns into the stage ring, once every consumer is done
    with the stage's previous block. Streamed A: each consumer's 64 rows of A into the same stage. Resident A: the
    row block's whole [192, K] A once per row block, after the tile's B blocks are on their way and every consumer
    is done with the previous row block."""
    a_bytes: gl.constexpr = a_desc.block_type.nbytes
    b_bytes: gl.constexpr = b_desc.block_type.nbytes
    first, stop, step, grid_n = _tiles(M, N, GROUP_M)
    it = 0
    resident = -1  # the row block whose A is in shared memory
    loads = 0  # how many row blocks of A were loaded
    pid_m, pid_n = _tile_coords(first, M, grid_n, GROUP_M)
    for tile in range(first, stop, step):
        for kb in range(K_BLOCKS):
            stage = it % STAGES
            bar = ready.index(stage)
            mbarrier.wait(empty.index(stage), ((it // STAGES) & 1) ^ 1)
            if RESIDENT:
                mbarrier.expect(bar, b_bytes)
            else:
                mbarrier.expect(bar, CONSUMERS * a_bytes + b_bytes)
                for c in gl.static_range(CONSUMERS):
                    TMA_LOAD(a_desc, [pid_m * BM + c * WG_ROWS, kb * BK], bar, a_s.index(stage * CONSUMERS + c))
            TMA_LOAD(b_desc, [pid_n * BN, kb * BK], bar, b_s.index(stage))
            it += 1
        if RESIDENT:  # noqa: SIM102 (resolved at compile time; the inner test at run time)
            if pid_m != resident:
                mbarrier.wait(a_empty, (loads & 1) ^ 1)
                mbarrier.expect(a_ready, CONSUMERS * K_BLOCKS * a_bytes)
                for c in gl.static_range(CONSUMERS):
                    for j in gl.static_range(K_BLOCKS):
                        TMA_LOAD(a_desc, [pid_m * BM + c * WG_ROWS, j * BK], a_ready, a_s.index(c * K_BLOCKS + j))
                resident = pid_m
                loads += 1
        pid_m, pid_n = _next_tile(tile, step, pid_m, pid_n, M, grid_n, GROUP_M)


@gluon.jit
def _factor(as_ptr, bs_ptr, offs_m, M, num_k, kb, b_block):
    """``a_scale[m, kb] * b_scale[b_block, kb]`` per row: the factor of K block ``kb``'s product."""
    sa = gl.load(as_ptr + offs_m * num_k + kb, mask=offs_m < M, other=0.0)
    return gl.expand_dims(sa * gl.load(bs_ptr + b_block * num_k + kb), 1)


@gluon.jit
def _stamp(trace_ptr, slot, traced, TRACE_TILES: gl.constexpr):
    """``trace_ptr[slot]`` = the SM's cycle counter, where ``traced``, in traced builds (``launch(..., trace=...)``);
    nothing in the others."""
    if TRACE_TILES > 0:  # noqa: SIM102 (resolved at compile time; the inner test at run time)
        if traced:
            one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
            dummy = gl.full([1], 0, gl.int32, one)
            now = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [dummy], dtype=gl.int64, is_pure=False,
                                            pack=1)  # fmt: skip
            gl.store(trace_ptr + slot + gl.arange(0, 1, one), now)


@gluon.jit
def _store(c_desc, c_s, acc, row, col, trace_ptr, slot, traced, TRACE_TILES: gl.constexpr):
    """A result tile out through shared memory by TMA, once the buffer's previous copy has read it. Traced builds
    stamp ``slot`` + 0 ... 4: on entry, after the wait for the previous copy, after the copy into shared memory, after
    the fence, and once the store is issued."""
    _stamp(trace_ptr, slot, traced, TRACE_TILES)
    tma.store_wait(0)
    BARRIER()
    _stamp(trace_ptr, slot + 1, traced, TRACE_TILES)
    c_s.store(acc.to(gl.bfloat16))
    _stamp(trace_ptr, slot + 2, traced, TRACE_TILES)
    fence_async_shared()
    BARRIER()  # every thread's part is in shared memory before the copy starts
    _stamp(trace_ptr, slot + 3, traced, TRACE_TILES)
    TMA_STORE(c_desc, [row, col], c_s)
    _stamp(trace_ptr, slot + 4, traced, TRACE_TILES)


@gluon.jit
def _consumer(a_s, b_s, c_s, a_ready, a_empty, ready, empty, c_desc, as_ptr, bs_ptr, M, N, PART: gl.constexpr,
              K_BLOCKS: gl.constexpr, RESIDENT: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
              trace_ptr, TRACE_TILES: gl.constexpr):  # fmt: skip
    """One warpgroup: rows ``64 PART + [0, 64)`` of each tile. Each 128-deep product (from zero) is waited for before
    it is scaled and added (``acc + part * factor``, in K order); the other warpgroups' products keep the tensor
    cores busy meanwhile. (A product left in flight while the previous one's registers are read makes ptxas
    serialize every wgmma instruction: C7514; benchmarks/NOTES.md, gemm: 2026-12-02 — a warp-specialized Gluon FP8
    gemm.) The next block's factor loads while this block's product runs."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
    zero = gl.zeros([WG_ROWS, BN], gl.float32, mma)
    rows = PART * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, mma))
    first, stop, step, grid_n = _tiles(M, N, GROUP_M)
    it = 0
    resident = -1
    loads = 0
    pid_m, pid_n = _tile_coords(first, M, grid_n, GROUP_M)
    steps_slot = TRACE_TILES * K_BLOCKS * CONSUMERS * 2 + PART * 6  # traced: each tile's epilogue steps, tile start
    for tile in range(first, stop, step):
        traced = (gl.program_id(0) == 0) & (it < TRACE_TILES * K_BLOCKS)
        if RESIDENT:  # noqa: SIM102 (resolved at compile time; the inner test at run time)
            if pid_m != resident:
                mbarrier.wait(a_ready, loads & 1)
                resident = pid_m
                loads += 1
        offs_m = pid_m * BM + rows
        b_block = pid_n * BN // BK
        factor = _factor(as_ptr, bs_ptr, offs_m, M, K_BLOCKS, 0, b_block)
        acc = zero
        # the previous tile's last stamp: this tile's start, up to its first stage's wait
        _stamp(trace_ptr, steps_slot + (it // K_BLOCKS - 1) * CONSUMERS * 6 + 5, traced & (it > 0), TRACE_TILES)
        for kb in range(K_BLOCKS):
            stage = it % STAGES
            mbarrier.wait(ready.index(stage), (it // STAGES) & 1)
            _stamp(trace_ptr, (it * CONSUMERS + PART) * 2, traced, TRACE_TILES)
            if RESIDENT:
                a = a_s.index(PART * K_BLOCKS + kb)
            else:
                a = a_s.index(stage * CONSUMERS + PART)
            part = warpgroup_mma(a, b_s.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)
            next_factor = _factor(as_ptr, bs_ptr, offs_m, M, K_BLOCKS, gl.minimum(kb + 1, K_BLOCKS - 1), b_block)
            part = warpgroup_mma_wait(0, deps=[part])
            _stamp(trace_ptr, (it * CONSUMERS + PART) * 2 + 1, traced, TRACE_TILES)
            mbarrier.arrive(empty.index(stage), count=1)
            acc = acc + part * factor
            factor = next_factor
            it += 1
        if RESIDENT:  # done with this row block's A (its last column block): the producer may load the next one
            mbarrier.arrive(a_empty, count=1, pred=pid_n == grid_n - 1)
        store_slot = steps_slot + (it // K_BLOCKS - 1) * CONSUMERS * 6
        _store(c_desc, c_s, acc, pid_m * BM + PART * WG_ROWS, pid_n * BN, trace_ptr, store_slot, traced, TRACE_TILES)
        pid_m, pid_n = _next_tile(tile, step, pid_m, pid_n, M, grid_n, GROUP_M)
    tma.store_wait(0)


@gluon.jit
def fp8_gemm_ws(a_desc, b_desc, c_desc, as_ptr, bs_ptr, M, N, trace_ptr, K_BLOCKS: gl.constexpr,
                RESIDENT: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                PRODUCER_REGS: gl.constexpr, TRACE_TILES: gl.constexpr):  # fmt: skip
    """C[M, N] (bf16) = A[M, K] @ B[N, K]^T, A scales [M, K/128], B scales [ceil(N/128), K/128], K = 128 K_BLOCKS, in
    192 x 128 tiles. ``RESIDENT``: each row block's A stays in shared memory (K_BLOCKS x 24 KB) while the program
    walks its tiles, and only B streams through the ``STAGES`` ring; otherwise A streams beside B. Launched with 4
    warps (the first consumer), to which the two other consumers add 4 each and the producer 1; one program per SM
    (or per tile, if fewer). ``TRACE_TILES`` > 0: cycle stamps into ``trace_ptr`` (``launch``'s ``trace``)."""
    if RESIDENT:
        a_s = gl.allocate_shared_memory(a_desc.dtype, [CONSUMERS * K_BLOCKS, WG_ROWS, BK], a_desc.layout)
    else:
        a_s = gl.allocate_shared_memory(a_desc.dtype, [STAGES * CONSUMERS, WG_ROWS, BK], a_desc.layout)
    b_s = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
    c_s = gl.allocate_shared_memory(gl.bfloat16, [CONSUMERS, WG_ROWS, BN], c_desc.layout)  # a buffer per consumer
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    a_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    a_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)  # every consumer releases a stage
    mbarrier.init(a_ready, count=1)
    mbarrier.init(a_empty, count=CONSUMERS)
    fence_async_shared()
    gl.warp_specialize(
        [
            (_consumer, (a_s, b_s, c_s.index(0), a_ready, a_empty, ready, empty, c_desc, as_ptr, bs_ptr, M, N, 0,
                         K_BLOCKS, RESIDENT, GROUP_M, STAGES, trace_ptr, TRACE_TILES)),
            (_consumer, (a_s, b_s, c_s.index(1), a_ready, a_empty, ready, empty, c_desc, as_ptr, bs_ptr, M, N, 1,
                         K_BLOCKS, RESIDENT, GROUP_M, STAGES, trace_ptr, TRACE_TILES)),
            (_consumer, (a_s, b_s, c_s.index(2), a_ready, a_empty, ready, empty, c_desc, as_ptr, bs_ptr, M, N, 2,
                         K_BLOCKS, RESIDENT, GROUP_M, STAGES, trace_ptr, TRACE_TILES)),
            (_producer, (a_desc, b_desc, a_s, b_s, a_ready, a_empty, ready, empty, M, N, K_BLOCKS, RESIDENT, GROUP_M,
                         STAGES)),
        ],
        [4, 4, 1],
        [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS],
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class WsSchedule:
    """``fp8_gemm_ws``'s schedule (its compile-time constants). Registers per consumer thread and per producer thread:
    3 x 128 x 152 + 32 x 56 of an SM's 64K. Shared memory: 208 KB streamed (4 stages), 224 KB resident at K = 512
    (5 stages)."""

    resident: bool = False  # a row block's whole A stays in shared memory while the program walks a run of tiles
    group_m: int = 8  # row blocks walked together down the column blocks (0: each program a contiguous run of tiles)
    stages: int = 4  # K blocks in the shared-memory ring
    consumer_regs: int = 152  # registers per thread of the three consumer warpgroups
    producer_regs: int = 56  # registers per thread of the producer warp

    def constexprs(self) -> dict[str, int | bool]:
        """The kernel's constants: ``RESIDENT``, ``GROUP_M``, ``STAGES``, ``CONSUMER_REGS``, ``PRODUCER_REGS``."""
        return {k.upper(): v for k, v in dataclasses.asdict(self).items()}


STREAMED = WsSchedule()
RESIDENT = WsSchedule(resident=True, group_m=0, stages=5)
MIN_M, MAX_K, MAX_RESIDENT_K = 384, 1024, 512  # where it was measured faster than cuBLAS (streamed, 256 rows: 1.02x)


def _descriptors(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple:
    """TMA descriptors of the FP8 activation [M, K] (64-row blocks), weight [N, K] and bf16 output [M, N]."""
    return (
        tma_descriptor(a, [64, 128], gl.float8e4nv),
        tma_descriptor(b, [128, 128], gl.float8e4nv),
        tma_descriptor(c, [64, 128], gl.bfloat16),
    )


def launch(
    a: QTensor, w: QTensor, schedule: WsSchedule | None = None, trace: torch.Tensor | None = None
) -> torch.Tensor:
    """``a`` [M, K] FP8 with (1, 128) scales, ``w`` [N, K] FP8 with (128, 128) scales; a new bf16 [M, N]. The
    schedule: ``RESIDENT`` A up to ``MAX_RESIDENT_K``, else ``STREAMED``. ``trace`` (a benchmark's instrument, int64 on
    the GPU): the first program's consumers write the SM's cycle counter into it as they go, for its first
    ``trace.numel() // (3 (2 K/128 + 6))`` tiles: per K block (in order) and consumer, when its stage was ready and
    when its product was done, then per tile and consumer six steps: the store entered, the previous store waited for,
    the result copied into shared memory, fenced, its store issued, and the next tile started up to its first wait."""
    m, k = a.shape
    n = w.shape[0]
    schedule = schedule or (RESIDENT if k <= MAX_RESIDENT_K else STREAMED)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=a.data.device)
    programs = min(triton.cdiv(m, BM.value) * triton.cdiv(n, BN.value), num_sms(a.data.device.index or 0))
    k_blocks = k // FP8_BLOCK
    trace_tiles = 0 if trace is None else trace.numel() // (2 * k_blocks + 6) // CONSUMERS.value
    fp8_gemm_ws[(programs,)](
        *_descriptors(a.data.contiguous(), w.data.contiguous(), out), a.scale.contiguous(), w.scale.contiguous(),
        m, n, out if trace is None else trace,  # (untraced, the pointer is not used)
        K_BLOCKS=k_blocks, **schedule.constexprs(), TRACE_TILES=trace_tiles, num_warps=4,
        enable_fp_fusion=True,  # one FFMA per scaled block, as the unsplit kernel (Triton 3.10 turns fusion off)
    )  # fmt: skip
    return out


def gemm_fp8(a, w: QTensor, *, out_dtype, bias) -> torch.Tensor:
    """``gemm`` with an FP8 block-scaled weight: a bf16 ``a`` is quantised first (as ``gemm.gemm_fp8`` does)."""
    return launch(_as_fp8(a, w), w)


def _fp8_operands(a, w, out_dtype, bias) -> bool | Decline:
    """An SM90 GPU, a (128, 128)-scaled e4m3 weight [N, K] with K a multiple of 128 and N a multiple of 8 (TMA's
    16-byte rows), an e4m3 (1, 128)-scaled or bf16 [M, K] activation, a bf16 result, no bias."""
    a_data = a.data if isinstance(a, QTensor) else a
    e4m3, bf16 = torch.float8_e4m3fn, torch.bfloat16
    if INTERPRET:
        return Decline("Gluon does not run in the Triton interpreter")
    if not isinstance(w, QTensor) or w.block != (FP8_BLOCK, FP8_BLOCK) or w.data.dtype != e4m3:
        return Decline(f"w is not e4m3 with ({FP8_BLOCK}, {FP8_BLOCK}) scale blocks")
    a_kind = (a.block, a_data.dtype) == ((1, FP8_BLOCK), e4m3) if isinstance(a, QTensor) else a_data.dtype == bf16
    if not a_kind or a_data.dim() != 2:
        return Decline(f"a is not a 2-D bf16 or (1, {FP8_BLOCK})-scaled e4m3 matrix")
    if w.shape[1] % FP8_BLOCK or w.shape[0] % 8:
        return Decline(f"w is {list(w.shape)}: K not a multiple of {FP8_BLOCK} or N of 8")
    if bias is not None:
        return Decline("a bias is given")
    if out_dtype != bf16:
        return Decline(f"out_dtype is {out_dtype}, expected torch.bfloat16")
    if not on_device(a_data, w.data) or not hopper(a_data.device.index or 0):
        return Decline("a and w are not on an SM90 (Hopper) GPU")
    if not tma_ready(a_data, w.data):
        return Decline("a or w cannot be read by TMA copies (rows not 16-byte aligned)")
    return True


def supports(a, w, *, out_dtype, bias) -> bool | Decline:
    """``_fp8_operands``, at least ``MIN_M`` rows and K at most ``MAX_K``."""
    a_data = a.data if isinstance(a, QTensor) else a
    answer = _fp8_operands(a, w, out_dtype, bias)
    if not answer:
        return answer
    if a_data.shape[0] < MIN_M:
        return Decline(f"{a_data.shape[0]} rows < {MIN_M}")
    if w.shape[1] > MAX_K:
        return Decline(f"K = {w.shape[1]} > {MAX_K}")
    return True


# --- a few rows: the weight's rows as wgmma's M ---------------------------------------------------------------------

W_ROWS = gl.constexpr(64)  # weight rows per program (wgmma's M)
ARRIVALS = gl.constexpr(4)  # what a launch with K groups adds to each tile's counter: K_GROUPS must divide it


@gluon.jit
def _few_a_row(M, A_ROWS: gl.constexpr):
    """The first row of A of this program's tile: A_ROWS q, except that the last tile ends at row M (overlapping the
    one before, whose rows it computes again to the same bits) where M is at least A_ROWS. With a part-empty last
    tile, (4096, 7168) at 96 rows took 19.5 us against 14.1 at 128; ending it at row M, 14.5 (benchmarks/HISTORY.md,
    2026-12-04 — the few-row Gluon FP8 ``gemm`` up to 192 rows). The likely cause: reading fewer rows of A, that tile
    runs ahead of the one before it over the same weight rows, which then no longer meet in L2."""
    return gl.minimum(gl.program_id(1) * A_ROWS, gl.maximum(M - A_ROWS, 0))


@gluon.jit
def _few_producer(a_desc, b_desc, a_s, b_s, ready, empty, M, GROUP_BLOCKS: gl.constexpr, STAGES: gl.constexpr):
    """One warp: the program's rows of A and its 64 weight rows, K block by K block of its group, into the ring of
    stages."""
    row = gl.program_id(0) * W_ROWS
    a_row = _few_a_row(M, a_desc.block_type.shape[0])
    k0 = gl.program_id(2) * GROUP_BLOCKS
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    for i in range(GROUP_BLOCKS):
        stage = i % STAGES
        mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)
        bar = ready.index(stage)
        mbarrier.expect(bar, nbytes)
        TMA_LOAD(a_desc, [a_row, (k0 + i) * BK], bar, a_s.index(stage))
        TMA_LOAD(b_desc, [row, (k0 + i) * BK], bar, b_s.index(stage))


@gluon.jit
def _few_products(a_s, b_s, ready, first, BLOCKS: gl.constexpr, STAGES: gl.constexpr, zero):
    """The program's K blocks ``first + [0, BLOCKS)`` (counted from its group's first): their 128-deep products of
    the weight rows and rows of A, each from zero, issued once their stages are ready (not waited for)."""
    parts = ()
    for j in gl.static_range(BLOCKS):
        stage = (first + j) % STAGES
        mbarrier.wait(ready.index(stage), ((first + j) // STAGES) & 1)
        part = warpgroup_mma(b_s.index(stage), a_s.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)
        parts = parts + (part,)  # noqa: RUF005 (no * in Gluon)
    return parts


@gluon.jit
def _few_done(parts, empty, first, BLOCKS: gl.constexpr, STAGES: gl.constexpr):
    """``parts`` waited for together (no product is in flight while another's registers are read, so ptxas keeps
    the wgmma instructions asynchronous), their stages freed."""
    parts = warpgroup_mma_wait(0, deps=parts)
    if BLOCKS == 1:
        parts = (parts,)
    for j in gl.static_range(BLOCKS):
        mbarrier.arrive(empty.index((first + j) % STAGES), count=1)
    return parts


@gluon.jit
def _few_blocks(a_s, b_s, f_s, ready, empty, acc, first, BLOCKS: gl.constexpr, STAGES: gl.constexpr, zero, cols):
    """``acc`` plus K blocks ``first + [0, BLOCKS)``: their products issued together, waited for together, then each
    scaled and added in K order."""
    parts = _few_products(a_s, b_s, ready, first, BLOCKS, STAGES, zero)
    factors = ()
    for j in gl.static_range(BLOCKS):
        factors = factors + (gl.expand_dims(f_s.index(first + j).load(cols), 0),)  # noqa: RUF005
    parts = _few_done(parts, empty, first, BLOCKS, STAGES)
    for j in gl.static_range(BLOCKS):
        acc = acc + parts[j] * factors[j]
    return acc


@gluon.jit
def _few_hand_over(a_s, b_s, ready, empty, parts_ptr, first, BLOCKS: gl.constexpr, STAGES: gl.constexpr, zero,
                   offs, mask):  # fmt: skip
    """The group's K blocks ``first + [0, BLOCKS)``: their products, unscaled, to ``parts_ptr`` (one [A_ROWS, 64]
    fp32 block each, from the group's first)."""
    parts = _few_done(_few_products(a_s, b_s, ready, first, BLOCKS, STAGES, zero), empty, first, BLOCKS, STAGES)
    for j in gl.static_range(BLOCKS):
        gl.store(parts_ptr + (first + j) * (W_ROWS * zero.shape[1]) + offs, parts[j], mask=mask)


@gluon.jit
def _few_take_over(f_s, parts_ptr, acc, kb, PULL: gl.constexpr, offs, mask):
    """``acc`` plus K blocks ``kb + [0, PULL)`` of the stored products (``parts_ptr``): loaded together, then each
    scaled and added in K order."""
    parts = ()
    for j in gl.static_range(PULL):
        ptr = parts_ptr + (kb + j) * (W_ROWS * acc.shape[0]) + offs
        parts = parts + (gl.load(ptr, mask=mask, other=0.0, cache_modifier=".cg"),)  # noqa: RUF005
    for j in gl.static_range(PULL):
        factor = f_s.index(kb + j).load(gl.SliceLayout(1, acc.type.layout))
        acc = acc + parts[j] * gl.expand_dims(factor, 1)
    return acc


@gluon.jit
def _few_chain(a_s, b_s, f_s, ready, empty, c_ptr, M, N, stride_cm, K_BLOCKS: gl.constexpr, STAGES: gl.constexpr,
               IN_FLIGHT: gl.constexpr, zero, a_row):  # fmt: skip
    """One K group: every K block's product chained in registers, in K order; C stored."""
    mma: gl.constexpr = zero.type.layout
    cols: gl.constexpr = gl.SliceLayout(0, mma)
    acc = zero
    for kb in range(0, K_BLOCKS - K_BLOCKS % IN_FLIGHT, IN_FLIGHT):
        acc = _few_blocks(a_s, b_s, f_s, ready, empty, acc, kb, IN_FLIGHT, STAGES, zero, cols)
    if K_BLOCKS % IN_FLIGHT > 0:
        acc = _few_blocks(a_s, b_s, f_s, ready, empty, acc, K_BLOCKS - K_BLOCKS % IN_FLIGHT, K_BLOCKS % IN_FLIGHT,
                          STAGES, zero, cols)  # fmt: skip
    offs_n = gl.program_id(0) * W_ROWS + gl.arange(0, W_ROWS, layout=gl.SliceLayout(1, mma))
    offs_m = a_row + gl.arange(0, zero.shape[1], layout=cols)
    mask = gl.expand_dims(offs_n < N, 1) & gl.expand_dims(offs_m < M, 0)
    out = c_ptr + gl.expand_dims(offs_m, 0) * stride_cm + gl.expand_dims(offs_n, 1)
    gl.store(out, acc.to(c_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _few_share(a_s, b_s, f_s, ready, empty, parts_ptr, count_ptr, c_ptr, M, N, stride_cm, K_BLOCKS: gl.constexpr,
               STAGES: gl.constexpr, IN_FLIGHT: gl.constexpr, K_GROUPS: gl.constexpr, PULL: gl.constexpr, zero,
               a_row):  # fmt: skip
    """K group g of ``K_GROUPS``: its blocks' products to the tile's stored products ([K_BLOCKS, A_ROWS, 64] fp32,
    weight rows inner), counted in at the tile's counter; once every group has counted in, weight rows
    64 g / K_GROUPS + [0, 64 / K_GROUPS) chained over every K block in K order from the stored products, ``PULL``
    blocks loaded at once, and stored to C. The counter only grows: each launch adds ``ARRIVALS`` to it, so the
    groups wait for the next multiple of it above the count they found."""
    mma: gl.constexpr = zero.type.layout
    A_ROWS: gl.constexpr = zero.shape[1]
    GROUP_BLOCKS: gl.constexpr = K_BLOCKS // K_GROUPS
    SHARE: gl.constexpr = W_ROWS // K_GROUPS
    g = gl.program_id(2)
    tile = gl.program_id(0) * gl.num_programs(1) + gl.program_id(1)
    parts_ptr += tile * (K_BLOCKS * W_ROWS * A_ROWS)
    count = count_ptr + tile
    cols = gl.arange(0, A_ROWS, layout=gl.SliceLayout(0, mma))
    offs = gl.expand_dims(cols, 0) * W_ROWS + gl.expand_dims(gl.arange(0, W_ROWS, layout=gl.SliceLayout(1, mma)), 1)
    valid = gl.expand_dims(a_row + cols < M, 0)
    mine = parts_ptr + g * (GROUP_BLOCKS * W_ROWS * A_ROWS)
    for i in range(0, GROUP_BLOCKS - GROUP_BLOCKS % IN_FLIGHT, IN_FLIGHT):
        _few_hand_over(a_s, b_s, ready, empty, mine, i, IN_FLIGHT, STAGES, zero, offs, valid)
    if GROUP_BLOCKS % IN_FLIGHT > 0:
        _few_hand_over(a_s, b_s, ready, empty, mine, GROUP_BLOCKS - GROUP_BLOCKS % IN_FLIGHT,
                       GROUP_BLOCKS % IN_FLIGHT, STAGES, zero, offs, valid)  # fmt: skip
    BARRIER()  # every thread's stores before the count, which releases them at GPU scope
    old = gl.atomic_add(count, ARRIVALS // K_GROUPS, sem="acq_rel", scope="gpu").to(gl.uint32, bitcast=True)
    target = old - old % ARRIVALS + ARRIVALS  # modulo 2^32, as the counter wraps
    seen = old + ARRIVALS // K_GROUPS
    while (seen - target).to(gl.int32, bitcast=True) < 0:
        seen = gl.atomic_add(count, 0, sem="acquire", scope="gpu").to(gl.uint32, bitcast=True)
    # this group's share of the weight rows, [A_ROWS, SHARE], weight rows inner as stored
    share: gl.constexpr = gl.BlockedLayout([1, 1], [32 // SHARE, SHARE], [4, 1], [1, 0])
    ms = a_row + gl.arange(0, A_ROWS, layout=gl.SliceLayout(1, share))
    ns = g * SHARE + gl.arange(0, SHARE, layout=gl.SliceLayout(0, share))
    offs = gl.expand_dims(ms - a_row, 1) * W_ROWS + gl.expand_dims(ns, 0)
    valid = gl.expand_dims(ms < M, 1)
    acc = gl.zeros([A_ROWS, SHARE], gl.float32, share)
    for kb in range(0, K_BLOCKS, PULL):
        acc = _few_take_over(f_s, parts_ptr, acc, kb, PULL, offs, valid)
    ns += gl.program_id(0) * W_ROWS
    out = c_ptr + gl.expand_dims(ms, 1) * stride_cm + gl.expand_dims(ns, 0)
    gl.store(out, acc.to(c_ptr.dtype.element_ty), mask=valid & gl.expand_dims(ns < N, 0))


@gluon.jit
def _few_consumer(a_s, b_s, f_s, ready, empty, c_ptr, as_ptr, bs_ptr, parts_ptr, count_ptr, M, N, stride_cm,
                  K_BLOCKS: gl.constexpr, STAGES: gl.constexpr, FACTORS: gl.constexpr, A_ROWS: gl.constexpr,
                  IN_FLIGHT: gl.constexpr, K_GROUPS: gl.constexpr, PULL: gl.constexpr):  # fmt: skip
    """One warpgroup: the [64, A_ROWS] tile of C^T = B A^T. Every K block's factor ``a_scale * b_scale`` first, into
    shared memory (``f_s``, [FACTORS >= K_BLOCKS, A_ROWS]); then per K block a 128-deep product from zero, and
    ``acc + part * factor`` in K order: ``gemm._swapped_product``'s arithmetic. ``IN_FLIGHT`` blocks' products run
    at once. With ``K_GROUPS`` > 1 the products go through global memory (``_few_share``)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, A_ROWS, 32])
    b_block = gl.program_id(0) * W_ROWS // BK
    a_row = _few_a_row(M, A_ROWS)
    table: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [4, 1], [1, 0])
    kbs = gl.arange(0, FACTORS, layout=gl.SliceLayout(1, table))
    ms = a_row + gl.arange(0, A_ROWS, layout=gl.SliceLayout(0, table))
    inside = gl.expand_dims(kbs < K_BLOCKS, 1) & gl.expand_dims(ms < M, 0)
    sa = gl.load(as_ptr + gl.expand_dims(ms, 0) * K_BLOCKS + gl.expand_dims(kbs, 1), mask=inside, other=0.0)
    sb = gl.load(bs_ptr + b_block * K_BLOCKS + kbs, mask=kbs < K_BLOCKS, other=0.0)
    f_s.store(sa * gl.expand_dims(sb, 1))
    BARRIER()
    f_s = plain_rows(f_s, [FACTORS, A_ROWS])
    zero = gl.zeros([W_ROWS, A_ROWS], gl.float32, mma)
    if K_GROUPS > 1:
        _few_share(a_s, b_s, f_s, ready, empty, parts_ptr, count_ptr, c_ptr, M, N, stride_cm, K_BLOCKS, STAGES,
                   IN_FLIGHT, K_GROUPS, PULL, zero, a_row)  # fmt: skip
    else:
        _few_chain(a_s, b_s, f_s, ready, empty, c_ptr, M, N, stride_cm, K_BLOCKS, STAGES, IN_FLIGHT, zero, a_row)


@gluon.jit
def fp8_gemm_few_rows(a_desc, b_desc, c_ptr, as_ptr, bs_ptr, parts_ptr, count_ptr, M, N, stride_cm,
                      K_BLOCKS: gl.constexpr, STAGES: gl.constexpr, FACTORS: gl.constexpr,
                      PRODUCER_REGS: gl.constexpr, IN_FLIGHT: gl.constexpr, K_GROUPS: gl.constexpr,
                      PULL: gl.constexpr, PDL: gl.constexpr):  # fmt: skip
    """C[M, N] (bf16, row stride ``stride_cm``) = A[M, K] @ B[N, K]^T, A scales [M, K/128], B scales [ceil(N/128),
    K/128], K = 128 K_BLOCKS: program (p, q, g) computes weight rows 64 p + [0, 64) against R rows of A from
    ``_few_a_row`` (R q, the last tile ending at row M), R the rows of ``a_desc``'s box (wgmma's N: 16, 32, 64 or
    128), over K group g (``K_GROUPS`` equal runs of K blocks), one warp copying the K blocks by TMA ``STAGES`` ahead
    of one multiplying warpgroup (launched with 4 warps, to which the copying warp adds 1). With ``K_GROUPS`` > 1,
    each group stores its blocks' products to ``parts_ptr`` (fp32, [tiles, K_BLOCKS, R, 64]) and counts in at
    ``count_ptr`` (int32 per tile, a multiple of ``ARRIVALS`` between launches); then each chains its share of the
    tile's weight rows over every K block from them, ``PULL`` blocks loaded at once. Every program of the grid must
    be resident at once (each waits for its tile's other groups). The bits of ``gemm_triton._gemm_swapped_kernel``
    unsplit, whatever ``K_GROUPS``. ``PDL``: launched early, it waits for the previous kernel first."""
    launch_dependents(PDL)
    wait_previous(PDL)
    A_ROWS: gl.constexpr = a_desc.block_type.shape[0]
    a_s = gl.allocate_shared_memory(a_desc.dtype, [STAGES, A_ROWS, BK], a_desc.layout)
    b_s = gl.allocate_shared_memory(b_desc.dtype, [STAGES, W_ROWS, BK], b_desc.layout)
    f_s = gl.allocate_shared_memory(gl.float32, [FACTORS, A_ROWS], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    gl.warp_specialize(
        [
            (_few_consumer, (a_s, b_s, f_s, ready, empty, c_ptr, as_ptr, bs_ptr, parts_ptr, count_ptr, M, N,
                             stride_cm, K_BLOCKS, STAGES, FACTORS, A_ROWS, IN_FLIGHT, K_GROUPS, PULL)),
            (_few_producer, (a_desc, b_desc, a_s, b_s, ready, empty, M, K_BLOCKS // K_GROUPS, STAGES)),
        ],
        [1],
        [PRODUCER_REGS],
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class FewRowsSchedule:
    """``fp8_gemm_few_rows``'s schedule (its compile-time constants): 8 stages of 16 KB at 64 rows of A, 128 KB,
    beside K / 2 bytes of factors (64 KB at ``MAX_FEW_K``); one program per SM. Measured against 12 stages and 1 or 4
    products in flight (benchmarks/HISTORY.md, 2026-12-04 — the few-row Gluon FP8 ``gemm`` up to 192 rows)."""

    stages: int = 8  # K blocks in the shared-memory ring the copying warp fills ahead
    producer_regs: int = 40  # registers per thread of the copying warp
    in_flight: int = 2  # K blocks' products issued before the first is waited for

    def constexprs(self) -> dict[str, int]:
        """The kernel's constants: ``STAGES``, ``PRODUCER_REGS``, ``IN_FLIGHT``."""
        return {k.upper(): v for k, v in dataclasses.asdict(self).items()}


FEW_ROWS_SCHEDULE = FewRowsSchedule()
FEW_A_ROWS = (16, 32, 64)  # rows of A per program: 16 up to 16 rows, else the fewer of 32 and 64 whose grid fits
MAX_FEW_K, FEW_MAX_M = 32768, 192
# Where it serves: while its grid fits the SMs at once and gives more than this share of them a program; with fewer
# programs the default mode's split over K is faster. In batch-invariant mode, whose other launches do not split K,
# from a fifth of the SMs on (benchmarks/HISTORY.md, 2026-12-04 — the few-row Gluon FP8 ``gemm`` up to 192 rows).
FEW_MIN_SHARE, FEW_MIN_SHARE_INVARIANT = 0.4, 0.2
# K groups per output tile, up to FEW_GROUPS_MAX_M rows: the most of FEW_K_GROUPS that divide the K blocks, leave each
# group at least FEW_GROUP_BLOCKS of them and keep the grid within the SMs (each must divide ARRIVALS). Beyond 8 rows
# the products' round trip through global memory costs more than the shorter chain saves; 2 groups never paid
# (benchmarks/HISTORY.md, 2026-12-04 — the few-row Gluon FP8 ``gemm`` in K groups). Stored products loaded at once
# by a group: up to FEW_PULL_REGS fp32 per thread.
FEW_K_GROUPS, FEW_GROUPS_MAX_M, FEW_GROUP_BLOCKS, FEW_PULL_REGS = (4,), 8, 8, 128
FEW_COUNT_SLOTS = 16  # sets of per-tile counters, taken in turn: launches on concurrent streams do not share one


def few_rows_grid(m: int, n: int, k: int, sms: int) -> tuple[int, int, int]:
    """(rows of A per program, K groups, programs) of an [m, n] output over K = ``k``: the fewest ``FEW_A_ROWS``
    above 16 rows whose grid of output tiles fits ``sms`` (else 64); up to ``FEW_GROUPS_MAX_M`` rows, the most
    ``FEW_K_GROUPS`` that still fit (else 1)."""
    tiles = triton.cdiv(n, W_ROWS.value)
    sizes = FEW_A_ROWS[:1] if m <= FEW_A_ROWS[0] else FEW_A_ROWS[1:]
    a_rows = next((r for r in sizes if tiles * triton.cdiv(m, r) <= sms), sizes[-1])
    tiles *= triton.cdiv(m, a_rows)
    k_blocks = k // FP8_BLOCK
    fits = (g for g in FEW_K_GROUPS if k_blocks % g == 0 and k_blocks // g >= FEW_GROUP_BLOCKS and tiles * g <= sms)
    groups = next(fits, 1) if m <= FEW_GROUPS_MAX_M else 1
    return a_rows, groups, tiles * groups


def few_rows_pull(k_blocks: int, groups: int, a_rows: int) -> int:
    """Stored products each group loads at once: the most K blocks that divide ``k_blocks`` and fit
    ``FEW_PULL_REGS`` registers per thread (a group's share of a product is ``a_rows`` x 64 / ``groups`` fp32 over
    128 threads)."""
    per_block = max(a_rows * W_ROWS.value // groups // 128, 1)
    return max(p for p in range(1, k_blocks + 1) if k_blocks % p == 0 and p * per_block <= FEW_PULL_REGS)


_few_counts: dict[int, torch.Tensor] = {}
_few_launches = itertools.count()


def _counters(device: torch.device) -> torch.Tensor | None:
    """The device's per-tile counters of K groups, [FEW_COUNT_SLOTS, SMs] int32 made zero, one row per launch in
    turn. None inside a CUDA graph capture before a launch outside one made them (the launch then keeps one K group:
    the same bits)."""
    index = device.index or 0
    if index not in _few_counts:
        if torch.cuda.is_current_stream_capturing():
            return None
        _few_counts[index] = torch.zeros(FEW_COUNT_SLOTS, num_sms(index), dtype=torch.int32, device=device)
    return _few_counts[index]


def launch_few_rows(
    a: QTensor,
    w: QTensor,
    schedule: FewRowsSchedule | None = None,
    a_rows: int | None = None,
    groups: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``a`` [M, K] FP8 with (1, 128) scales, ``w`` [N, K] FP8 with (128, 128) scales; a bf16 [M, N] (``out`` if
    given, columns contiguous, else a new one), in programs of 64 weight rows by ``a_rows`` rows of A (16, 32, 64 or
    128) over ``groups`` K groups (by default ``few_rows_grid``'s)."""
    m, k = a.shape
    n = w.shape[0]
    device = a.data.device
    sms = num_sms(device.index or 0)
    rows, k_groups, _ = few_rows_grid(m, n, k, sms)
    a_rows, k_groups = a_rows or rows, groups or k_groups
    k_blocks = k // FP8_BLOCK
    programs = triton.cdiv(n, W_ROWS.value) * triton.cdiv(m, a_rows) * k_groups
    # every group waits for its tile's others, and each launch adds ARRIVALS to the tile's counter
    if k_blocks % k_groups or ARRIVALS.value % k_groups or (k_groups > 1 and programs > sms):
        raise ValueError(
            f"launch_few_rows: groups={k_groups}: expected a divisor of {ARRIVALS.value} and of the {k_blocks} K "
            f"blocks whose grid fits {sms} SMs, got {programs} programs"
        )
    counts = _counters(device)
    if counts is None:
        k_groups, counts = 1, torch.empty(1, dtype=torch.int32, device=device)
    elif k_groups > 1:
        counts = counts[next(_few_launches) % FEW_COUNT_SLOTS]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=device) if out is None else out
    grid = (triton.cdiv(n, W_ROWS.value), triton.cdiv(m, a_rows), k_groups)
    parts = a.scale  # with one K group neither ``parts`` nor ``counts`` is read
    if k_groups > 1:
        parts = torch.empty(grid[0] * grid[1] * k_blocks * a_rows * W_ROWS.value, device=device)
    fp8_gemm_few_rows[grid](
        tma_descriptor(a.data.contiguous(), [a_rows, FP8_BLOCK], gl.float8e4nv),
        tma_descriptor(w.data.contiguous(), [W_ROWS.value, FP8_BLOCK], gl.float8e4nv),
        out, a.scale.contiguous(), w.scale.contiguous(), parts, counts, m, n,
        out.stride(0), K_BLOCKS=k_blocks, FACTORS=triton.next_power_of_2(k_blocks), K_GROUPS=k_groups,
        PULL=few_rows_pull(k_blocks, k_groups, a_rows), **(schedule or FEW_ROWS_SCHEDULE).constexprs(), num_warps=4,
        enable_fp_fusion=True,  # one FFMA per scaled block, as the Triton kernels
        PDL=PDL, launch_pdl=PDL,
    )  # fmt: skip
    return out


def gemm_fp8_few_rows(a, w: QTensor, *, out_dtype, bias) -> torch.Tensor:
    """``gemm`` by the few-row kernel (a bf16 ``a`` is quantised first)."""
    return launch_few_rows(_as_fp8(a, w), w)


def few_rows_supports(a, w, *, out_dtype, bias) -> bool | Decline:
    """``_fp8_operands``, K at most ``MAX_FEW_K``, at most ``FEW_MAX_M`` rows, and a grid (``few_rows_grid``) that
    fits the SMs and gives more than ``FEW_MIN_SHARE_INVARIANT`` of them a program in batch-invariant mode; in the
    default mode, more than ``FEW_MIN_SHARE`` of them an output tile (K groups do not count: at 4-8 rows the split
    over K was faster: benchmarks/HISTORY.md, 2026-12-04 — the few-row Gluon FP8 ``gemm`` in K groups)."""
    a_data = a.data if isinstance(a, QTensor) else a
    m = a_data.shape[0]
    answer = _fp8_operands(a, w, out_dtype, bias)
    if not answer:
        return answer
    if not 1 <= m <= FEW_MAX_M:
        return Decline(f"{m} rows, not 1 to {FEW_MAX_M}")
    if w.shape[1] > MAX_FEW_K:
        return Decline(f"K = {w.shape[1]} > {MAX_FEW_K}")
    sms = num_sms(a_data.device.index or 0)
    _, groups, programs = few_rows_grid(m, w.shape[0], w.shape[1], sms)
    if programs > sms:
        return Decline(f"{programs} programs > {sms} SMs")
    if batch_invariant_enabled():
        if FEW_MIN_SHARE_INVARIANT * sms < programs:
            return True
        return Decline(f"{programs} programs <= {FEW_MIN_SHARE_INVARIANT:g} x {sms} SMs")
    if FEW_MIN_SHARE * sms < programs // groups:
        return True
    return Decline(f"{programs // groups} output tiles <= {FEW_MIN_SHARE:g} x {sms} SMs")
