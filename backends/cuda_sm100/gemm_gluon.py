"""FP8 block-scaled ``gemm`` for Hopper (SM90) in Gluon: a warp-specialized, persistent kernel with 192 x 128 tiles.
``plugin`` registers it ahead of cuBLAS where ``supports`` says so: short K (at most 1024, DeepSeek-V3's ``wkv_b``,
(N, K) = (32768, 512)) from 384 rows on, where it measured 1.13-1.25x cuBLAS's speed (benchmarks/RESULTS.md).

Why there: at short K a tile's product is over in a few blocks, and the copies of A and B blocks from L2 set the
pace (Nsight Compute: the L2 at 76% of its throughput, NOTES.md). A 192-row tile reads each B block once for 192 rows
instead of 128: a sixth less from L2 per FLOP. cuBLAS saves more with clusters of two programs that share B, which
Gluon cannot express.

The schedule: one program per SM walks the output tiles, grouped ``GROUP_M`` row blocks at a time;
- a producer warp streams each consumer's A [64, 128] block and the tile's shared B [128, 128] block into a ring of
  ``STAGES`` shared-memory stages by TMA, running ahead across tile boundaries;
- ``CONSUMERS`` warpgroups (three here; two in the benchmark's 128-row variants) each own 64 of the tile's rows: per K
  block a 128-deep product from zero (``wgmma``), waited for, then ``acc + part * (a_scale * b_scale)``;
- each consumer stores its 64 x 128 bf16 result by TMA from its own shared buffer.

The arithmetic of every element is the unsplit ``tl`` kernel's (``gemm._gemm_kernel``): the K-ordered sum of 128-deep
products, each from zero and scaled; the bits are the same (``benchmarks/gluon_gemm_ws.py`` checks each launch,
conformance checks rows alone against the batch), so batch-invariant mode takes it too.
"""

from __future__ import annotations

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
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from deepinfer import QTensor

from ._triton import INTERPRET, hopper, num_sms, on_device, tma_ready
from .gemm import FP8_BLOCK, _as_fp8

# Gluon is experimental and renames things: later versions have ``tma.async_load`` / ``async_store`` and
# ``gl.barrier``; Triton 3.6 (the H200 machine's) has the older names, which later versions refuse.
TMA_LOAD = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
TMA_STORE = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
BARRIER = getattr(gl, "thread_barrier", None) or gl.barrier
BK = gl.constexpr(128)  # K blocks of 128: one activation scale and one weight scale each
WG_ROWS = gl.constexpr(64)  # rows per consumer warpgroup (wgmma's M)


@gluon.jit
def _tile_coords(tile, grid_m, grid_n, GROUP_M: gl.constexpr):
    """Tile ``tile``'s (row block, column block), grouped ``GROUP_M`` row blocks at a time so that the tiles the
    programs hold at once share their A and B blocks in L2."""
    group = GROUP_M * grid_n
    first_m = tile // group * GROUP_M
    rows = gl.minimum(grid_m - first_m, GROUP_M)
    return first_m + (tile % group) % rows, (tile % group) // rows


@gluon.jit
def _producer(a_desc, b_desc, a0_s, a1_s, a2_s, b_s, ready, empty, M, N, K, CONSUMERS: gl.constexpr,
              GROUP_M: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """One warp: every K block of every tile this program owns into the stage ring (each consumer's 64 rows of A
    into its own buffer, B into the shared one), once every consumer is done with the stage's previous block."""
    BM: gl.constexpr = CONSUMERS * WG_ROWS
    BN: gl.constexpr = b_desc.block_type.shape[0]
    nbytes: gl.constexpr = CONSUMERS * a_desc.block_type.nbytes + b_desc.block_type.nbytes
    grid_m, grid_n = gl.cdiv(M, BM), gl.cdiv(N, BN)
    num_k = K // BK
    it = 0
    for tile in range(gl.program_id(0), grid_m * grid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile, grid_m, grid_n, GROUP_M)
        for kb in range(num_k):
            stage = it % STAGES
            bar = ready.index(stage)
            mbarrier.wait(empty.index(stage), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(bar, nbytes)
            TMA_LOAD(a_desc, [pid_m * BM, kb * BK], bar, a0_s.index(stage))
            TMA_LOAD(a_desc, [pid_m * BM + WG_ROWS, kb * BK], bar, a1_s.index(stage))
            if CONSUMERS == 3:
                TMA_LOAD(a_desc, [pid_m * BM + 2 * WG_ROWS, kb * BK], bar, a2_s.index(stage))
            TMA_LOAD(b_desc, [pid_n * BN, kb * BK], bar, b_s.index(stage))
            it += 1


@gluon.jit
def _factor(as_ptr, bs_ptr, offs_m, M, num_k, kb, b_block):
    """``a_scale[m, kb] * b_scale[b_block, kb]`` per row: the factor of K block ``kb``'s product."""
    sa = gl.load(as_ptr + offs_m * num_k + kb, mask=offs_m < M, other=0.0)
    return gl.expand_dims(sa * gl.load(bs_ptr + b_block * num_k + kb), 1)


@gluon.jit
def _store(c_desc, c_s, acc, row, col):
    """A result tile out through shared memory by TMA, once the buffer's previous copy has read it."""
    tma.store_wait(0)
    BARRIER()
    c_s.store(acc.to(gl.bfloat16))
    fence_async_shared()
    BARRIER()  # every thread's part is in shared memory before the copy starts
    TMA_STORE(c_desc, [row, col], c_s)


@gluon.jit
def _consumer(a_s, b_s, c_s, ready, empty, c_desc, as_ptr, bs_ptr, M, N, K, PART: gl.constexpr,
              CONSUMERS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """One warpgroup: rows ``64 PART + [0, 64)`` of each tile, from its own A buffer ``a_s``. Each 128-deep product
    (from zero) is waited for before it is scaled and added (``acc + part * factor``, in K order); the other
    warpgroups' products keep the tensor cores busy meanwhile. (A product left in flight while the previous one's
    registers are read makes ptxas serialize every wgmma instruction: C7514, NOTES.md, twenty-third session.) The
    next block's factor loads while this block's product runs."""
    BM: gl.constexpr = CONSUMERS * WG_ROWS
    BN: gl.constexpr = b_s.shape[1]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
    grid_m, grid_n = gl.cdiv(M, BM), gl.cdiv(N, BN)
    num_k = K // BK
    zero = gl.zeros([WG_ROWS, BN], gl.float32, mma)
    rows = PART * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, mma))
    it = 0
    for tile in range(gl.program_id(0), grid_m * grid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile, grid_m, grid_n, GROUP_M)
        offs_m = pid_m * BM + rows
        b_block = pid_n * BN // BK
        factor = _factor(as_ptr, bs_ptr, offs_m, M, num_k, 0, b_block)
        acc = zero
        for kb in range(num_k):
            stage = (it + kb) % STAGES
            mbarrier.wait(ready.index(stage), ((it + kb) // STAGES) & 1)
            part = warpgroup_mma(a_s.index(stage), b_s.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)
            next_factor = _factor(as_ptr, bs_ptr, offs_m, M, num_k, gl.minimum(kb + 1, num_k - 1), b_block)
            part = warpgroup_mma_wait(0, deps=[part])
            mbarrier.arrive(empty.index(stage), count=1)
            acc = acc + part * factor
            factor = next_factor
        it += num_k
        _store(c_desc, c_s, acc, pid_m * BM + PART * WG_ROWS, pid_n * BN)
    tma.store_wait(0)


@gluon.jit
def fp8_gemm_ws(a_desc, b_desc, c_desc, as_ptr, bs_ptr, M, N, K, CONSUMERS: gl.constexpr, GROUP_M: gl.constexpr,
                STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):  # fmt: skip
    """C[M, N] (bf16) = A[M, K] @ B[N, K]^T, A scales [M, K/128], B scales [ceil(N/128), K/128], K % 128 == 0, in
    tiles of 64 CONSUMERS x 128 (one weight scale block wide), CONSUMERS 2 or 3 warpgroups of 64 rows each. Launched
    with 4 warps (the first consumer), to which each other consumer adds 4 and the producer 1; one program per SM (or
    per tile, if fewer)."""
    BN: gl.constexpr = b_desc.block_type.shape[0]
    a_layout: gl.constexpr = a_desc.layout
    a0_s = gl.allocate_shared_memory(a_desc.dtype, [STAGES, WG_ROWS, BK], a_layout)
    a1_s = gl.allocate_shared_memory(a_desc.dtype, [STAGES, WG_ROWS, BK], a_layout)
    a2_s = a1_s  # a placeholder with two consumers (a partition takes no None)
    if CONSUMERS == 3:
        a2_s = gl.allocate_shared_memory(a_desc.dtype, [STAGES, WG_ROWS, BK], a_layout)
    b_s = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
    c0_s = gl.allocate_shared_memory(gl.bfloat16, [WG_ROWS, BN], c_desc.layout)  # each consumer's output buffer
    c1_s = gl.allocate_shared_memory(gl.bfloat16, [WG_ROWS, BN], c_desc.layout)
    c2_s = c1_s
    if CONSUMERS == 3:
        c2_s = gl.allocate_shared_memory(gl.bfloat16, [WG_ROWS, BN], c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)  # every consumer releases a stage
    fence_async_shared()
    if CONSUMERS == 2:
        gl.warp_specialize(
            [
                (_consumer, (a0_s, b_s, c0_s, ready, empty, c_desc, as_ptr, bs_ptr, M, N, K, 0, CONSUMERS, GROUP_M,
                             STAGES)),
                (_consumer, (a1_s, b_s, c1_s, ready, empty, c_desc, as_ptr, bs_ptr, M, N, K, 1, CONSUMERS, GROUP_M,
                             STAGES)),
                (_producer, (a_desc, b_desc, a0_s, a1_s, a2_s, b_s, ready, empty, M, N, K, CONSUMERS, GROUP_M,
                             STAGES)),
            ],
            [4, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
                (_consumer, (a0_s, b_s, c0_s, ready, empty, c_desc, as_ptr, bs_ptr, M, N, K, 0, CONSUMERS, GROUP_M,
                             STAGES)),
                (_consumer, (a1_s, b_s, c1_s, ready, empty, c_desc, as_ptr, bs_ptr, M, N, K, 1, CONSUMERS, GROUP_M,
                             STAGES)),
                (_consumer, (a2_s, b_s, c2_s, ready, empty, c_desc, as_ptr, bs_ptr, M, N, K, 2, CONSUMERS, GROUP_M,
                             STAGES)),
                (_producer, (a_desc, b_desc, a0_s, a1_s, a2_s, b_s, ready, empty, M, N, K, CONSUMERS, GROUP_M,
                             STAGES)),
            ],
            [4, 4, 1],
            [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip


# (tile rows, stages, registers per consumer thread, per producer thread): 3 x 128 x 152 + 32 x 56 of an SM's 64K
VARIANT = (192, 4, 152, 56)
MIN_M, MAX_K = 384, 1024  # where it was measured faster than cuBLAS (at 256 rows: 1.02x)


def _descriptors(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple:
    """TMA descriptors of the FP8 activation [M, K] (64-row blocks), weight [N, K] and bf16 output [M, N]."""
    layout = lambda shape, dtype: gl.NVMMASharedLayout.get_default_for(shape, dtype)
    return (
        TensorDescriptor.from_tensor(a, [64, 128], layout([64, 128], gl.float8e4nv)),
        TensorDescriptor.from_tensor(b, [128, 128], layout([128, 128], gl.float8e4nv)),
        TensorDescriptor.from_tensor(c, [64, 128], layout([64, 128], gl.bfloat16)),
    )


def constants(variant: tuple[int, int, int, int]) -> dict:
    block_m, stages, consumer_regs, producer_regs = variant
    return {"CONSUMERS": block_m // 64, "GROUP_M": 8, "STAGES": stages,
            "CONSUMER_REGS": consumer_regs, "PRODUCER_REGS": producer_regs}  # fmt: skip


def launch(a: QTensor, w: QTensor, variant: tuple[int, int, int, int] = VARIANT) -> torch.Tensor:
    """``a`` [M, K] FP8 with (1, 128) scales, ``w`` [N, K] FP8 with (128, 128) scales; a new bf16 [M, N]."""
    m, k = a.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=a.data.device)
    tiles = triton.cdiv(m, variant[0]) * triton.cdiv(n, 128)
    programs = min(tiles, num_sms(a.data.device.index or 0))
    fp8_gemm_ws[(programs,)](
        *_descriptors(a.data.contiguous(), w.data.contiguous(), out), a.scale.contiguous(), w.scale.contiguous(),
        m, n, k, **constants(variant), num_warps=4,
        enable_fp_fusion=True,  # one FFMA per scaled block, as the unsplit kernel (Triton 3.10 turns fusion off)
    )  # fmt: skip
    return out


def gemm_fp8(a, w: QTensor, *, out_dtype, bias) -> torch.Tensor:
    """``gemm`` with an FP8 block-scaled weight: a bf16 ``a`` is quantised first (as ``gemm.gemm_fp8`` does)."""
    return launch(_as_fp8(a, w), w)


def supports(a, w, *, out_dtype, bias) -> bool:
    """An SM90 GPU, a (128, 128)-scaled e4m3 weight [N, K] with K <= ``MAX_K`` a multiple of 128 and N a multiple of 8
    (TMA's 16-byte rows), an e4m3 (1, 128)-scaled or bf16 activation of at least ``MIN_M`` rows, a bf16 result, no
    bias."""
    a_data = a.data if isinstance(a, QTensor) else a
    e4m3, bf16 = torch.float8_e4m3fn, torch.bfloat16
    a_kind = (a.block, a_data.dtype) == ((1, FP8_BLOCK), e4m3) if isinstance(a, QTensor) else a_data.dtype == bf16
    return (
        not INTERPRET
        and isinstance(w, QTensor)
        and w.block == (FP8_BLOCK, FP8_BLOCK)
        and w.data.dtype == e4m3
        and a_kind
        and a_data.dim() == 2
        and a_data.shape[0] >= MIN_M
        and w.shape[1] <= MAX_K
        and w.shape[1] % FP8_BLOCK == 0
        and w.shape[0] % 8 == 0
        and bias is None
        and out_dtype == bf16
        and on_device(a_data, w.data)
        and hopper(a_data.device.index or 0)
        and tma_ready(a_data, w.data)
    )
