"""A warp-specialized, persistent FP8 block-scaled GEMM in Gluon, to test on the device whether Hopper's usual GEMM
schedule reaches 75% of the FP8 peak at M = 4096 on the DeepSeek-V3 projections where cuBLAS does not ((32768, 512)
54%, (2112, 7168) 69%, (7168, 2048) 71%: RESULTS.md, twelfth session).

What the earlier variants lacked (NOTES.md, fourth, eighth and twelfth sessions): the ``tl`` kernel issues its copies
and its products from the same warps, one tile per program; the eighth session's Gluon kernel loaded from its math
warpgroup, one 64-row tile per program; the persistent ``tl`` prototype walked tiles without a producer. Here one
program per SM walks the output tiles (128 x 128, or 192 x 128):

- a producer warp streams the A [64, 128] blocks of each consumer and the shared B [128, 128] block of every tile the
  program owns into a ring of ``STAGES`` shared-memory stages by TMA, running ahead across tile boundaries (the
  next tile's first blocks land during this tile's epilogue);
- two (or three) consumer warpgroups each take 64 of the tile's rows and share its B block: each 128-deep product
  from zero (``wgmma``), then ``acc + part * (a_scale * b_scale)``, the arithmetic of the committed kernels (so the
  bits are theirs, checked below); one warpgroup's scaling runs beside another's product;
- each consumer stores its 64 x 128 bf16 result by TMA from its own shared buffer; the copy completes while the next
  tile's products run.

cuBLAS's kernel for these shapes (Nsight Compute, ``h200_run.sh profile-gemm``) has the same division of work, plus
clusters of two programs that share their B blocks' copies (NOTES.md, twenty-third session).

    python3 benchmarks/gluon_gemm_ws.py OUT.json     (on the GPU: checked against the dequantised product and bit for
                                                      bit against the unsplit kernel, then timed from CUDA graphs
                                                      beside cuBLAS)
    python3 benchmarks/gluon_gemm_ws.py --compile    (anywhere: compiles every variant for SM90, prints resources and
                                                      whether ptxas serialized the wgmma instructions)

Written against Triton 3.6's Gluon (the H200 machine's); the TMA names of later versions are taken where present.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile

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


# (BM, stages, registers per consumer thread, per producer thread): each SM's 64K registers over 4 warpgroups
VARIANTS = [(128, 5, 232, 40), (128, 6, 232, 40), (192, 4, 152, 56)]


def _name(variant) -> str:
    return f"ws {variant[0]}x128 {variant[1]}st"


def _descriptors(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor):
    layout = lambda shape, dtype: gl.NVMMASharedLayout.get_default_for(shape, dtype)
    return (
        TensorDescriptor.from_tensor(a, [64, 128], layout([64, 128], gl.float8e4nv)),
        TensorDescriptor.from_tensor(b, [128, 128], layout([128, 128], gl.float8e4nv)),
        TensorDescriptor.from_tensor(c, [64, 128], layout([64, 128], gl.bfloat16)),
    )


_SMS: list[int] = []


def _constants(variant) -> dict:
    block_m, stages, consumer_regs, producer_regs = variant
    return {"CONSUMERS": block_m // 64, "GROUP_M": 8, "STAGES": stages,
            "CONSUMER_REGS": consumer_regs, "PRODUCER_REGS": producer_regs}  # fmt: skip


def launch(a, w, variant) -> torch.Tensor:
    """``a``, ``w``: FP8 QTensors with (1, 128) and (128, 128) scales; bf16 out."""
    m, k = a.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=a.data.device)
    if not _SMS:
        _SMS.append(torch.cuda.get_device_properties(a.data.device).multi_processor_count)
    tiles = triton.cdiv(m, variant[0]) * triton.cdiv(n, 128)
    descs = _descriptors(a.data, w.data, out)
    fp8_gemm_ws[(min(tiles, _SMS[0]),)](*descs, a.scale, w.scale, m, n, k, **_constants(variant), num_warps=4)
    return out


def compile_for_sm90(variant) -> None:
    """Compiles the kernel for SM90 without a GPU and prints its resources (``cuobjdump`` from Triton's wheel)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.experimental.gluon._runtime import GluonASTSource

    fp8 = torch.empty(384, 512, dtype=torch.float8_e4m3fn)
    out = torch.empty(256, 256, dtype=torch.bfloat16)
    signature = {name: "i32" for name in ("M", "N", "K")}
    for name, desc in zip(("a_desc", "b_desc", "c_desc"), _descriptors(fp8, fp8, out)):
        signature[name] = native_specialize_impl(BaseBackend, desc, False, True, True)[0]
    constants = _constants(variant)
    signature |= {"as_ptr": "*fp32", "bs_ptr": "*fp32"} | dict.fromkeys(constants, "constexpr")
    source = GluonASTSource(fp8_gemm_ws, signature, constants)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    bin_dir = f"{triton.__path__[0]}/backends/nvidia/bin"
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(kernel.asm["ptx"])
        # ptxas's own notes: C7514 says it serialized the wgmma instructions
        notes = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"],
                               capture_output=True, text=True)  # fmt: skip
        serialized = "C7514" in notes.stdout + notes.stderr
        usage = subprocess.run([f"{bin_dir}/cuobjdump", "--dump-resource-usage", f"{tmp}/k.cubin"],
                               capture_output=True, text=True).stdout  # fmt: skip
    found = re.search(r"REG:(\d+).*STACK:(\d+)", usage)
    print(f"Triton {triton.__version__}, SM90, {_name(variant)}: registers {found[1]}, stack {found[2]}, shared "
          f"{kernel.metadata.shared} bytes, wgmma serialized by ptxas: {serialized}")  # fmt: skip


PROJECTIONS = ((24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048), (2112, 7168))  # DeepSeek-V3


def shape_row(m: int, n: int, k: int, peak: float) -> dict:
    """Each side against the dequantised product (and the Gluon kernel bit for bit against the unsplit ``tl``
    kernel, whose bits batch-invariant mode keeps), then timed from CUDA graphs on the same inputs."""
    from gemm_tiles import SETS, inputs, rel_err

    from deepinfer.bench import time_graph_ms
    from deepinfer_cuda_sm100 import gemm

    a, w = inputs(m, n, k, seed=m + n + k)
    want = a[0].dequantize() @ w[0].dequantize().t()
    unsplit = gemm.gemm_fp8(a[0], w[0], out_dtype=torch.bfloat16, bias=None, invariant=True).view(torch.int16)
    sides = {"cublas": lambda i: gemm.gemm_fp8_cublas(a[i], w[i], out_dtype=torch.bfloat16, bias=None)} | {
        _name(v): lambda i, v=v: launch(a[i], w[i], v) for v in VARIANTS
    }
    row = {"M": m, "N": n, "K": k}
    for name, fn in sides.items():
        try:
            got = fn(0)
            err = rel_err(got, want)
            same = bool(torch.equal(got.view(torch.int16), unsplit))
            ms = time_graph_ms(fn, sets=SETS, reps=30) if err < 1e-2 else None
        except Exception as e:  # a variant the compiler or driver refuses is reported, not hidden
            row[name] = f"{type(e).__name__}: {str(e)[:200]}"
            print(f"M={m} N={n} K={k} {name}: {row[name]}", flush=True)
            continue
        row[name] = {"ms": ms, "rel_err": err, "bits_equal_unsplit": same}
        tflops = 2 * m * n * k / ms / 1e9 if ms else 0.0
        print(f"M={m} N={n} K={k} {name}: {ms} ms, {tflops:.0f} TFLOP/s ({tflops / peak:.0%} of peak), "
              f"rel err {err:.1e}, bits = unsplit: {same}", flush=True)  # fmt: skip
    return row


def main() -> int:
    if sys.argv[1:] == ["--compile"]:
        for variant in VARIANTS:
            compile_for_sm90(variant)
        return 0
    from deepinfer.bench import time_graph_ms

    size = 8192  # the FP8 peak, as gemm_kloop.py measures it: tensor-wise scaled_mm at 8192^3
    x = torch.randn(size, size, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    ms = time_graph_ms(lambda i: torch._scaled_mm(x, x.t(), one, one, out_dtype=torch.bfloat16), sets=1, reps=20)
    peak = 2 * size**3 / ms / 1e9
    report = {"device": torch.cuda.get_device_name(), "fp8_peak_tflops": peak, "rows": []}
    print(f"FP8 peak (same run): {peak:.0f} TFLOP/s", flush=True)
    for m, n, k in [(4096, n, k) for n, k in PROJECTIONS] + [(8192, 2112, 7168), (512, 4096, 7168)]:
        report["rows"].append(shape_row(m, n, k, peak))
        with open(sys.argv[1], "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
