"""An FP8 block-scaled GEMM in Gluon (``triton.experimental.gluon``, Triton's lower-level language), to test on the
device whether overlapping one 128-deep product's MMA with the previous product's scaling lifts the K loop.

The ``tl`` kernel in ``deepinfer_cuda_sm100.gemm`` waits for each product before it scales and adds it, so the
tensor cores idle while the warpgroup does its FMAs (RESULTS.md, fourth session). ``tl`` gives no control over that
wait; Gluon does. Here one warpgroup keeps two products in flight: it issues product k, waits until only that one
is outstanding (so product k - 1 is done), refills the stage k - 1 read, then scales product k - 1 into the
accumulator while product k runs. Loads are TMA copies into a ring of ``STAGES`` buffers with an mbarrier each.

    python3 benchmarks/gluon_gemm.py OUT.json     (on the GPU: checked against the dequantised product, then timed
                                                   from CUDA graphs beside cuBLAS and the committed kernel)
    python3 benchmarks/gluon_gemm.py --compile    (anywhere: compiles the kernel for SM90 and prints its registers)
    python3 benchmarks/gluon_gemm.py OUT.json small  (on the GPU: batch-invariant mode's small row counts, below)

``small``: the kernel never splits K and accumulates each 128-deep product as ``acc + part * (sa * sb)``, the
arithmetic of the unsplit ``tl`` kernel, so it must give that kernel's bits at any tile width. At M = 1 ... 128 on
the DeepSeek-V3 projections, each width (32, 64, 128 columns) and depth (4, 6, 8 stages) is checked bit for bit
against ``triton-fp8-unsplit`` and timed beside it and beside the default mode (graph times).

Written against Triton 3.6's Gluon, the GPU machine's (Gluon is experimental: Triton 3.9 has renamed the TMA copy).
With ``pip install triton==3.6.0`` beside torch, ``--compile`` gives 223-224 registers and no stack for every variant.
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
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BN, BK = 128, 128  # BN = BK = 128 keeps a tile inside one weight-scale block; BM = 64 rows per warpgroup (4 warps)


@gluon.jit
def _row_scale(as_ptr, bs_ptr, offs_m, M, KB, kb, b_block):
    """``a_scale[m, kb] * b_scale[b_block, kb]`` per row: the factor of K block ``kb``'s product. Gluon does not
    pipeline loads, so the loop loads each block's factor one iteration before it is needed."""
    sa = gl.load(as_ptr + offs_m * KB + kb, mask=offs_m < M, other=0.0)
    sb = gl.load(bs_ptr + b_block * KB + kb)
    return gl.expand_dims(sa * sb, 1)


@gluon.jit
def _load_stage(a_desc, b_desc, bar, a_s, b_s, stage, off_m, off_n, kb, pred):
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    mbarrier.expect(bar.index(stage), nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [off_m, kb * 128], bar.index(stage), a_s.index(stage), pred=pred)
    tma.async_copy_global_to_shared(b_desc, [off_n, kb * 128], bar.index(stage), b_s.index(stage), pred=pred)


@gluon.jit
def fp8_gemm_overlapped(a_desc, b_desc, c_ptr, as_ptr, bs_ptr, M, N, K, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """C[M, N] (bf16) = A[M, K] @ B[N, K]^T, A scales [M, K/128], B scales [ceil(N/128), K/128], K % 128 == 0."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    pid = gl.program_id(0)
    grid_m, grid_n = gl.cdiv(M, BLOCK_M), gl.cdiv(N, BLOCK_N)
    first_m = pid // (GROUP_M * grid_n) * GROUP_M
    rows_in_group = gl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * grid_n)) % rows_in_group
    pid_n = (pid % (GROUP_M * grid_n)) // rows_in_group
    off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N

    a_s = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, 128], a_desc.layout)
    b_s = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, 128], b_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bar.index(i), count=1)
    num_k = K // 128
    for i in gl.static_range(STAGES):  # K block i into stage i; block j >= STAGES comes when block j - STAGES is done
        _load_stage(a_desc, b_desc, bar, a_s, b_s, i, off_m, off_n, i, i < num_k)

    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BLOCK_N, 32]
    )
    offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    b_block = off_n // 128

    mbarrier.wait(bar.index(0), 0)
    part = warpgroup_mma(a_s.index(0), b_s.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
    factor = _row_scale(as_ptr, bs_ptr, offs_m, M, num_k, 0, b_block)
    for k in range(1, num_k):
        stage = k % STAGES
        mbarrier.wait(bar.index(stage), (k // STAGES) & 1)
        nxt = warpgroup_mma(a_s.index(stage), b_s.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)
        next_factor = _row_scale(as_ptr, bs_ptr, offs_m, M, num_k, k, b_block)
        done = warpgroup_mma_wait(1, deps=[part])  # product k - 1 is finished; product k may still run
        # product k - 1 no longer reads its stage: refill it with K block k - 1 + STAGES
        refill = k - 1 + STAGES
        _load_stage(a_desc, b_desc, bar, a_s, b_s, (k - 1) % STAGES, off_m, off_n, refill, refill < num_k)
        acc += done * factor
        part, factor = nxt, next_factor
    done = warpgroup_mma_wait(0, deps=[part])
    acc += done * factor
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bar.index(i))

    offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    mask = gl.expand_dims(offs_m < M, 1) & gl.expand_dims(offs_n < N, 0)
    ptrs = c_ptr + gl.expand_dims(offs_m.to(gl.int64) * N, 1) + gl.expand_dims(offs_n, 0)
    gl.store(ptrs, acc.to(gl.bfloat16), mask=mask)


VARIANTS = [(64, 3), (64, 4), (128, 3)]  # (rows per program, stages)


def descriptors(
    a: torch.Tensor, b: torch.Tensor, block_m: int, block_n: int = BN
) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors of the FP8 operands ``a [M, K]`` and ``b [N, K]`` (both K-contiguous) for a tile of
    ``block_m`` x ``block_n``."""
    layout_a = gl.NVMMASharedLayout.get_default_for([block_m, BK], gl.float8e4nv)
    layout_b = gl.NVMMASharedLayout.get_default_for([block_n, BK], gl.float8e4nv)
    return (
        TensorDescriptor.from_tensor(a, [block_m, BK], layout_a),
        TensorDescriptor.from_tensor(b, [block_n, BK], layout_b),
    )


def launch(a, w, stages: int = 4, block_m: int = 64, block_n: int = BN) -> torch.Tensor:
    """``a``, ``w``: FP8 QTensors with (1, 128) and (128, 128) scales. ``block_m`` 64: one warpgroup per program;
    128: two, each on 64 of the rows, sharing the weight tile. ``block_n`` divides 128 (a tile lies in one weight
    scale block)."""
    m, k = a.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=a.data.device)
    a_desc, b_desc = descriptors(a.data, w.data, block_m, block_n)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    fp8_gemm_overlapped[grid](
        a_desc, b_desc, out, a.scale, w.scale, m, n, k, STAGES=stages, GROUP_M=8, num_warps=block_m // 16
    )  # fmt: skip
    return out


def compile_for_sm90(stages: int = 4, block_m: int = 64) -> None:
    """Compiles the kernel for SM90 without a GPU and prints its resources (``cuobjdump`` from Triton's wheel)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fp8 = torch.empty(256, 512, dtype=torch.float8_e4m3fn)
    a_desc, b_desc = descriptors(fp8, fp8, block_m)
    signature = {name: "i32" for name in ("M", "N", "K")}
    for name, desc in (("a_desc", a_desc), ("b_desc", b_desc)):
        signature[name] = native_specialize_impl(BaseBackend, desc, False, True, True)[0]
    signature |= {"c_ptr": "*bf16", "as_ptr": "*fp32", "bs_ptr": "*fp32", "STAGES": "constexpr", "GROUP_M": "constexpr"}
    source = GluonASTSource(fp8_gemm_overlapped, signature, {"STAGES": stages, "GROUP_M": 8})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": block_m // 16})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        tool = f"{triton.__path__[0]}/backends/nvidia/bin/cuobjdump"
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+).*STACK:(\d+).*SHARED:(\d+)", usage)
    shape = f"{block_m} x {BN}, {stages} stages"
    print(f"Triton {triton.__version__}, SM90, {shape}: registers {found[1]}, stack {found[2]}, shared "
          f"{kernel.metadata.shared} bytes")  # fmt: skip


def shape_row(m: int, n: int, k: int) -> dict:
    """Checks each side against the dequantised product, then times it from CUDA graphs (same inputs)."""
    from gemm_tiles import SETS, inputs, rel_err

    from deepinfer.bench import time_graph_ms
    from deepinfer_cuda_sm100 import gemm

    a, w = inputs(m, n, k, seed=m + n + k)
    want = a[0].dequantize() @ w[0].dequantize().t()
    committed = gemm.Tile(64, 128, 4, 4 if k >= gemm.DEEP_K else 3)

    def ours(i):
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        return gemm._launch_gemm(a[i].data, w[i].data, out, a[i].scale, w[i].scale, None, False, committed)

    sides = {
        "cublas": lambda i: gemm.gemm_fp8_cublas(a[i], w[i], out_dtype=torch.bfloat16, bias=None),
        "committed": ours,
    } | {
        f"gluon {block_m} x 128, {stages} stages": lambda i, s=stages, b=block_m: launch(a[i], w[i], s, b)
        for block_m, stages in VARIANTS
    }
    row = {"M": m, "N": n, "K": k}
    for name, fn in sides.items():
        try:
            err = rel_err(fn(0), want)
            ms = time_graph_ms(fn, sets=SETS, reps=30) if err < 1e-2 else None
        except Exception as e:  # a variant the compiler or driver refuses is reported, not hidden
            row[name] = f"{type(e).__name__}: {str(e)[:200]}"
            print(f"M={m} N={n} K={k} {name}: {row[name]}", flush=True)
            continue
        row[name] = {"ms": ms, "rel_err": err}
        tflops = f"{2 * m * n * k / ms / 1e9:.0f} TFLOP/s" if ms else "-"
        print(f"M={m} N={n} K={k} {name}: {ms} ms, {tflops}, rel err {err:.1e}", flush=True)
    return row


PROJECTIONS = ((24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048), (2112, 7168))  # DeepSeek-V3
SMALL_ROWS = (1, 8, 64, 128)
SMALL_TILES = [(bn, stages) for bn in (32, 64, 128) for stages in (4, 6, 8)]


def small_row(m: int, n: int, k: int) -> dict:
    """Batch-invariant mode at a small row count: every Gluon width and depth against the unsplit ``tl`` kernel's
    bits, timed beside it and beside the default mode (``ops.gemm``, which splits K where the GPU would idle)."""
    from gemm_tiles import SETS, inputs

    from deepinfer import ops
    from deepinfer.bench import time_graph_ms
    from deepinfer.dispatch import batch_invariant
    from deepinfer_cuda_sm100 import gemm

    a, w = inputs(m, n, k, seed=m + n + k)
    unsplit = lambda i: gemm.gemm_fp8(a[i], w[i], out_dtype=torch.bfloat16, bias=None, invariant=True)
    want = unsplit(0).view(torch.int16)
    default = lambda i: ops.gemm(a[i], w[i], out_dtype=torch.bfloat16)
    with batch_invariant(False):
        row = {"M": m, "N": n, "K": k, "default_ms": time_graph_ms(default, sets=SETS)}
    row["unsplit_ms"] = time_graph_ms(unsplit, sets=SETS)
    line = f"M={m:>4} N={n:>5} K={k:>5}: default {row['default_ms']:.4f}, unsplit {row['unsplit_ms']:.4f} ms"
    best = None
    for bn, stages in SMALL_TILES:
        name = f"gluon 64x{bn} {stages}st"
        fn = lambda i, s=stages, b=bn: launch(a[i], w[i], s, 64, b)
        try:
            same = bool(torch.equal(fn(0).view(torch.int16), want))
            ms = time_graph_ms(fn, sets=SETS)
        except Exception as e:  # a launch the compiler or driver refuses is reported, not hidden
            row[name] = f"{type(e).__name__}: {str(e)[:200]}"
            continue
        row[name] = {"ms": ms, "bits_equal_unsplit": same}
        if same and (best is None or ms < row[best]["ms"]):
            best = name
        if not same:
            line += f" | {name} BITS DIFFER"
    if best:
        ms = row[best]["ms"]
        line += f" | best {best} {ms:.4f} ms: {row['unsplit_ms'] / ms:.2f}x unsplit,"
        line += f" {ms / row['default_ms']:.2f}x default"
    print(line, flush=True)
    return row


def main() -> int:
    if sys.argv[1:] == ["--compile"]:
        for block_m, stages in VARIANTS:
            compile_for_sm90(stages, block_m)
        return 0
    if sys.argv[2:] == ["small"]:
        import deepinfer

        deepinfer.use("cuda_sm100")
        rows = []
        for n, k in PROJECTIONS:
            for m in SMALL_ROWS:
                rows.append(small_row(m, n, k))
                with open(sys.argv[1], "w") as f:
                    json.dump(rows, f, indent=1)
        return 0
    report = {"device": torch.cuda.get_device_name(), "rows": []}
    for m, n, k in [(4096, n, k) for n, k in PROJECTIONS] + [(512, 4096, 7168)]:
        report["rows"].append(shape_row(m, n, k))
        with open(sys.argv[1], "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
