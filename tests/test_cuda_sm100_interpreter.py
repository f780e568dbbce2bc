"""The NVIDIA backend's Triton kernels, run on the CPU through the Triton interpreter (``TRITON_INTERPRET=1``) and
checked by the full conformance suite at small shapes: a wrong kernel fails CI. There is no cuBLAS in the
interpreter: the products a GPU gives to cuBLAS run Triton kernels here instead.
The interpreter also lacks bf16 arithmetic, truncates fp32 -> bf16 casts and mis-rounds fp32 -> e4m3 casts across a
binade; the kernels take a documented path for each under the interpreter (``_triton.dot``, ``_triton.cast`` and
``_triton.to_e4m3``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib

import pytest
import torch
from ep_harness import (
    expert,
    fitting_capacity,
    launch,
    overflow_problem,
    random_problem,
    reference_out,
    row_bytes,
    token_counts,
)

import deepinfer
from deepinfer.dispatch import batch_invariant, batch_invariant_enabled, last_resolution
from deepinfer.ops import ExpertPlacement, ep_combine, ep_dispatch
from deepinfer.reference import ep as ep_ref

EXPECTED_FALLBACKS: set[tuple[str, str]] = set()


@pytest.mark.slow
def test_conformance_through_the_triton_interpreter(tmp_path):
    report = tmp_path / "cuda_sm100_interpreter.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [
        sys.executable,
        "-m",
        "deepinfer.cli",
        "conformance",
        "--backend",
        "cuda_sm100",
        "--device",
        "cpu",
        "--report",
        str(report),
        "--note",
        "Triton interpreter on the CPU",
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    body = json.loads(report.read_text())
    fallbacks = {(r["op"], r["case"]) for r in body["results"] if r["status"] == "fallback"}
    assert fallbacks == EXPECTED_FALLBACKS
    served = {r["op"] for r in body["results"] if r["check"] == "accuracy" and r["impl"].startswith("cuda_sm100/")}
    assert served == set(deepinfer.ops.OP_NAMES), served  # every op runs a Triton kernel
    assert any(r["check"] == "batch_invariance" and r["status"] == "pass" for r in body["results"])


CASTS = """
import torch, triton, triton.language as tl
from deepinfer_cuda_sm100._triton import cast

@triton.jit
def kernel(x_ptr, y_ptr, z_ptr, N: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, N))
    tl.store(y_ptr + tl.arange(0, N), cast(x, y_ptr.dtype.element_ty))
    tl.store(z_ptr + tl.arange(0, N), cast(x, z_ptr.dtype.element_ty))

g = torch.Generator().manual_seed(0)
ties = (torch.randn(256, generator=g).bfloat16().float().view(torch.int32) + 0x8000).view(torch.float32)  # halfway
special = torch.tensor([float("inf"), -float("inf"), float("nan"), 3.4e38, -3.4e38, 0.0, -0.0, 1e-40, -1e-40])
payloads = torch.tensor([0x7FFFFFFF, -1, 0x7F800001], dtype=torch.int32).view(torch.float32)  # NaNs, not rounded
x = torch.cat([torch.randn(2048 - 256 - 12, generator=g) * 100, ties, special, payloads])
y, z = torch.empty(2048, dtype=torch.bfloat16), torch.empty(2048, dtype=torch.float16)
kernel[(1,)](x, y, z, N=2048)
want_y, want_z = x.bfloat16(), x.half()
nan = x.isnan()
same = lambda a, b: torch.equal(a.isnan(), nan) and torch.equal(a[~nan].view(torch.int16), b[~nan].view(torch.int16))
print(same(y, want_y), same(z, want_z))
"""


def test_casts_round_to_nearest_even_under_the_interpreter():
    """``_triton.cast``, which every bf16 result of the backend's ``tl`` kernels goes through, gives torch's (and a
    GPU's) round-to-nearest-even bits under the interpreter too: random values, exact ties, infinities, NaNs (one
    whose payload would carry into the sign), overflow past bf16's largest value, signed zeros and fp32 subnormals,
    to bf16 and to fp16. The interpreter's own fp32 -> bf16 cast truncates, which doubled the errors of the CPU
    conformance run."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", CASTS], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]


CAPACITY_OVERFLOW = """
import os, torch, deepinfer
from deepinfer import ops
x, w = torch.randn(6, 128, dtype=torch.bfloat16), torch.rand(6, 2)
ids = torch.tensor([[0, 1]] * 6, dtype=torch.int32)  # six rows each for experts 0 and 1, capacity 4
with deepinfer.use("cuda_sm100"):
    os.environ["DEEPINFER_VALUE_CHECKS"] = "0"
    recv, _, _, layout, handle = ops.ep_dispatch(x, ids, w, num_experts=4, mode="low_latency", capacity=4)
    out = ops.ep_combine(recv, handle)
    lost = torch.isnan(out.float()).any(1).tolist()
    print(type(handle).__name__, layout.masked_m.tolist(), bool(handle.overflow), lost)
"""


def test_capacity_overflow_is_never_silent():
    """Without value checks, the two tokens past capacity come back NaN and the handle says so."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", CAPACITY_OVERFLOW], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "GpuHandle [4, 4, 0, 0] True [False, False, False, False, True, True]"


UNALIGNED_OPERANDS = """
import torch, deepinfer
from deepinfer import QTensor, ops
from deepinfer.qtensor import quantize_blocks, quantize_rows
from deepinfer_cuda_sm100._triton import tma_ready

def shifted(t):  # the same values one element past a 16-byte boundary: TMA cannot read it, masked loads can
    out = torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape)
    return out.copy_(t)

g = torch.Generator().manual_seed(7)
a = quantize_rows(torch.randn(37, 256, generator=g), 128, "fp32")
w = quantize_blocks(torch.randn(3, 192, 256, generator=g) * 0.06)
offsets = torch.tensor([0, 20, 20, 37], dtype=torch.int32)
a_off = QTensor(shifted(a.data), a.scale, a.block, a.scale_format)
w_off = QTensor(shifted(w.data), w.scale, w.block, w.scale_format)
w0, w0_off = QTensor(w.data[0], w.scale[0], w.block, "fp32"), QTensor(w_off.data[0], w.scale[0], w.block, "fp32")
print(tma_ready(a.data, w0.data), tma_ready(a_off.data, w0_off.data.view(192, 256)))
with deepinfer.use("cuda_sm100"):
    dense = [ops.gemm(x, y, out_dtype=torch.float32) for x, y in ((a, w0), (a_off, w0_off))]
    few = [ops.gemm(x[:5], y, out_dtype=torch.float32) for x, y in ((a, w0), (a_off, w0_off))]  # swapped kernel
    grouped = [ops.grouped_gemm(x, y, expert_offsets=offsets, out_dtype=torch.float32)
               for x, y in ((a, w), (a_off, w_off))]
want = a.dequantize() @ w0.dequantize().t()
rows = [a.dequantize()[s:e] @ QTensor(w.data[i], w.scale[i], w.block, "fp32").dequantize().t()
        for i, (s, e) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist()))]
err = lambda got, ref: float((got - ref).norm() / ref.norm())
print(max(err(x, want) for x in dense) < 1e-5, max(err(x, torch.cat(rows)) for x in grouped) < 1e-5,
      torch.equal(*dense), torch.equal(*grouped), all(torch.equal(x, dense[0][:5]) for x in few))
"""


def test_fp8_gemms_read_unaligned_operands():
    """FP8 ``gemm`` (the swapped kernel of a few rows included) and ``grouped_gemm`` take TMA copies where the
    operands allow and masked loads where they do not (a base address off 16 bytes): both paths match the dequantised
    product and each other bit for bit."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", UNALIGNED_OPERANDS], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["True False", "True True True True True"]


K_ZERO = """
import torch
import deepinfer
from deepinfer import ops
from deepinfer.dispatch import last_resolution
deepinfer.use("cuda_sm100")
bias = torch.randn(8)
for rows in (3, 64):  # the few-row tile (default mode), then the batch-invariant kernel's tile
    a, w = torch.zeros(rows, 0, dtype=torch.bfloat16), torch.zeros(8, 0)
    out = ops.gemm(a, w, out_dtype=torch.float32, bias=bias)
    print(last_resolution("gemm")[0].provider, torch.equal(out, bias.expand(rows, 8)))
"""


def test_an_fp32_weight_over_no_columns_gives_the_bias():
    """An fp32 weight with K = 0 (an empty sum) gives the bias on the Triton tiles too: one span, not zero spans."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", K_ZERO], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["triton-fp32-few-rows True", "triton True"]


MASKED_SWAPPED = """
import torch
from deepinfer import QTensor
from deepinfer.dispatch import batch_invariant
from deepinfer.qtensor import quantize_blocks, quantize_rows
from deepinfer_cuda_sm100 import gemm

def shifted(t):  # the same values one element past a 16-byte boundary: masked loads, not TMA copies
    out = torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape)
    return out.copy_(t)

g = torch.Generator().manual_seed(3)
a = quantize_rows(torch.randn(6, 20, 256, generator=g), 128, "fp32")
w = quantize_blocks(torch.randn(6, 160, 256, generator=g) * 0.06)  # a last column tile of 32 of 64 columns
masked_m = torch.tensor([0, 20, 3, 0, 17, 1], dtype=torch.int32)  # row tiles of 16 holding rows: 0, 2, 1, 0, 2, 1
live = [e for e in range(6) if masked_m[e]]
rows = lambda out: torch.cat([out[e, : masked_m[e]] for e in live])
want = torch.cat([a[e].dequantize()[: masked_m[e]] @ QTensor(w.data[e], w.scale[e], w.block, "fp32").dequantize().t()
                  for e in live])
a_rows = QTensor(rows(a.data), rows(a.scale), a.block, "fp32")  # the same rows in the contiguous layout
offsets = torch.tensor([0, *masked_m.cumsum(0).tolist()], dtype=torch.int32)
a_off = QTensor(shifted(a.data), a.scale, a.block, "fp32")
w_off = QTensor(shifted(w.data), w.scale, w.block, "fp32")
gemm.num_sms = lambda *_: 1
for invariant in (False, True):
    with batch_invariant(invariant):
        outs = []
        for per_sm in (1, 100):  # one program walking every (row tile, column tile) pair, or one program per pair
            gemm.MASKED_PROGRAMS_PER_SM = per_sm
            outs.append(rows(gemm.grouped_gemm(a, w, expert_offsets=None, masked_m=masked_m, out_dtype=torch.float32)))
            outs.append(rows(gemm.grouped_gemm(a_off, w_off, expert_offsets=None, masked_m=masked_m,
                                               out_dtype=torch.float32)))
        contiguous = gemm.grouped_gemm(a_rows, w, expert_offsets=offsets, masked_m=None, out_dtype=torch.float32)
    err = float((outs[0] - want).norm() / want.norm())
    print(invariant, all(torch.equal(outs[0], o) for o in outs[1:]), err < 1e-5, torch.equal(outs[0], contiguous))
"""


def test_masked_fp8_grouped_gemm_walks_the_tiles_that_hold_rows():
    """FP8 ``grouped_gemm`` in the masked layout (the swapped kernel) computes only the row tiles that hold rows,
    shared out over however many programs there are: one program walking them all, one per tile, TMA copies or masked
    loads, the rows are the same bits and the reference's product in both modes. They are also the bits of the same
    rows in the contiguous layout (64-row tiles), so batch-invariant decode and prefill agree."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", MASKED_SWAPPED], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["False True True True", "True True True True"]


UNSPLIT_TILES = """
import torch
from deepinfer.qtensor import quantize_blocks, quantize_rows
from deepinfer_cuda_sm100 import gemm

g = torch.Generator().manual_seed(11)
a = quantize_rows(torch.randn(130, 640, generator=g), 128, "fp32")
w = quantize_blocks(torch.randn(384, 640, generator=g) * 0.06)
bias = torch.randn(384, generator=g)
want = a.dequantize() @ w.dequantize().t() + bias
tiles = [gemm.Tile(64, n, 4, stages) for n, stages in ((128, 3), (64, 4), (32, 6), (16, 3))]
tiles += [gemm.SWAPPED_TILE, gemm.Tile(32, 128, 4, 4, swap=True)]
parts = gemm.SWAPPED_TILE._replace(split_k=3, block_parts=True)  # K blocks 2, 2, 1
tiles += [parts, gemm.Tile(64, 64, 4, 4, 4, swap=True, block_parts=True)]  # K blocks 2, 2, 1, none
launch = lambda dtype, tile: gemm._launch_gemm(
    a.data, w.data, torch.empty(130, 384, dtype=dtype), a.scale, w.scale, bias, tile.split_k == 1, tile)
for dtype in (torch.float32, torch.bfloat16):
    outs = [launch(dtype, t) for t in tiles]
    splits = [launch(dtype, gemm.Tile(16, 64, 4, 4, 4, swap=swap)) for swap in (False, True)]  # K spans 2, 2, 1, 0
    splits.append(launch(dtype, gemm.Tile(16, 64, 4, 4, 8, swap=True)))  # K spans 1, 1, 1, 1, 1, 0, 0, 0
    err = lambda got: float((got.float() - want).norm() / want.norm()) < (1e-5 if dtype == torch.float32 else 1e-2)
    print(dtype, all(torch.equal(outs[0], o) for o in outs[1:]), err(outs[0]), all(map(err, splits)))
"""


def test_fp8_gemm_bits_do_not_depend_on_the_unsplit_tile():
    """Unsplit FP8 ``gemm`` launches of 64-row tiles 128, 64, 32 and 16 columns wide (any stage count), of the
    swapped kernel, and of the swapped kernel split over K with the K blocks' products chained in K order by a second
    kernel, give the same bits, with a bias and fp32 or bf16 results: batch-invariant mode may pick its tile by row
    count. Launches split over K with fp32 partial sums (an empty last span included) stay within the reference's
    bound."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", UNSPLIT_TILES], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["torch.float32 True True True", "torch.bfloat16 True True True"]


def test_batch_invariant_gemm_never_splits_k(monkeypatch):
    """In batch-invariant mode the FP8 gemm never sums partial products over K, whatever M. It takes 64-row tiles
    or, at a few rows, the swapped kernel, whose long products spread K over programs but add the blocks' products
    in K order (``block_parts``): what fixes a row's arithmetic (the tile may follow M, which the test above shows
    changes no bit). The default mode splits long products at a few rows; where it does not split, it takes the same
    tile."""
    from deepinfer_cuda_sm100 import gemm

    monkeypatch.setattr(gemm, "num_sms", lambda *_: 132)  # the H200's

    for n, k in [(24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048), (2112, 7168)]:
        for m in (1, 7, 16, 17, 64, 65, 128, 255, 256, 4096, 8192):
            tile = gemm._tile(m, n, k, True, True)
            assert tile.split_k == 1 or tile.block_parts, (m, n, k, tile)
            assert tile.swap if m <= 16 else tile.block_m == 64, (m, n, k, tile)
            assert tile.block_parts == (m <= 16 and (n, k) in [(4096, 7168), (2112, 7168)]), (m, n, k, tile)
            default = gemm._tile(m, n, k, True, False)
            if default.split_k == 1 and not default.swap:  # unsplit, both modes take one tile
                assert default == tile, (m, n, k, default, tile)
        default = gemm._tile(1, n, k, True, False)
        assert default.split_k == (gemm.SWAPPED_SPLIT_K if k >= gemm.SPLIT_K_MIN_K else 1), (n, k, default)
        assert default.num_stages <= k // 128, (n, k, default)  # no stage without a K block to hold


def test_unsplit_tile_widens_where_that_makes_one_wave(monkeypatch):
    """The unsplit tile's width follows N, but doubles where the grid would otherwise take a second wave of programs
    and doubling fits one: (2112, 7168) at 192 rows took 2.1x the 128-row time with 198 programs of 32 columns."""
    from deepinfer_cuda_sm100 import gemm

    monkeypatch.setattr(gemm, "num_sms", lambda *_: 132)  # the H200's
    width = lambda m, n: gemm._unsplit_tile(m, n, 7168).block_n
    assert (width(128, 2112), width(192, 2112)) == (32, 64)  # 132 programs; 99 instead of 198
    assert (width(128, 4096), width(192, 4096)) == (64, 128)  # 128 programs; 96 instead of 192
    assert width(192, 7168) == 128  # 168 programs: wider tiles do not exist
    assert width(256, 2112) == 64  # 4 x 66 programs would be two waves, 4 x 33 are one


CUBLAS_PROBE = """
import torch
from deepinfer.qtensor import quantize_blocks, quantize_rows
from deepinfer_cuda_sm100 import gemm, gemm_cublas

g = torch.Generator().manual_seed(5)
w = quantize_blocks(torch.randn(256, 512, generator=g) * 0.05)
unsplit = lambda a, w, out_dtype, bias: gemm.gemm_fp8(a, w, out_dtype=out_dtype, bias=bias, invariant=True)

def off_by_one_bit(a, w, out_dtype, bias):
    out = unsplit(a, w, out_dtype, bias)
    out.view(torch.int16)[-1, -1] ^= 1
    return out

gemm_cublas.cublas_fp8_supports = lambda a, w, **kw: True  # stands in for a GPU with cuBLAS
capturing = [False]
torch.cuda.is_current_stream_capturing = lambda: capturing[0]
ask = lambda m: bool(gemm_cublas.cublas_fp8_invariant_supports(
    quantize_rows(torch.randn(m, 512, generator=g), 128, "fp32"), w, out_dtype=torch.bfloat16, bias=None))
gemm_cublas.gemm_fp8_cublas = lambda a, w, *, out_dtype, bias: unsplit(a, w, out_dtype, bias)  # same bits
first = ask(256)
gemm_cublas.gemm_fp8_cublas = off_by_one_bit  # asked again only at a new row count
print(first, ask(256), ask(320))
capturing[0] = True
print(ask(384), (384, 256, 512, 0) in gemm_cublas._cublas_answers)
"""


def test_cublas_serves_batch_invariant_mode_only_where_it_gave_the_unsplit_bits():
    """The wiring of ``cublas_fp8_invariant_supports`` with a test double for cuBLAS (the interpreter has none): a
    stand-in that gives the unsplit kernel's bits is taken, and that answer is kept for the row count; one that differs
    by a single bit at a new row count is declined; inside graph capture an unasked row count is declined unasked."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", CUBLAS_PROBE], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["True True False", "False False"]


CUBLAS_DENSE_PROBE = """
import torch
from deepinfer_cuda_sm100 import gemm, gemm_cublas

g = torch.Generator().manual_seed(5)
w = (torch.randn(96, 256, generator=g) * 0.06).bfloat16()
triton_bits = lambda a, w, *, out_dtype, bias: gemm.gemm_triton(a, w, out_dtype=out_dtype, bias=bias)

def off_by_one_bit(a, w, *, out_dtype, bias):
    out = triton_bits(a, w, out_dtype=out_dtype, bias=bias)
    out.view(torch.int32)[-1, -1] ^= 1
    return out

gemm_cublas.cublas_supports = lambda a, w, **kw: True  # stands in for a GPU with cuBLAS
capturing = [False]
torch.cuda.is_current_stream_capturing = lambda: capturing[0]
ask = lambda m, bias=None: bool(gemm_cublas.cublas_invariant_supports(
    torch.randn(m, 256, generator=g).bfloat16(), w, out_dtype=torch.float32, bias=bias))
gemm_cublas.gemm_cublas = triton_bits  # same bits
first, fewer, biased = ask(256), ask(255), ask(512, bias=torch.zeros(96, dtype=torch.bfloat16))
gemm_cublas.gemm_cublas = off_by_one_bit  # asked again only at a new row count
print(first, fewer, biased, ask(256), ask(320))
capturing[0] = True
print(ask(384), any(384 in key for key in gemm_cublas._cublas_answers))
"""


def test_cublas_serves_batch_invariant_dense_products_only_where_it_gave_the_triton_bits():
    """The same wiring for bf16 products (``cublas_invariant_supports``): a stand-in with the Triton kernel's bits is
    taken from ``CUBLAS_DENSE_INVARIANT_MIN_M`` rows and kept for the row count; one bit off at a new row count is
    declined, as are fewer rows, a bias, and an unasked row count inside graph capture (unasked)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", CUBLAS_DENSE_PROBE], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["True False False True False", "False False"]


def test_mla_decode_spans_fill_the_grid_and_ignore_rows_when_invariant():
    """``mla_decode``'s KV spans: whole 64-token blocks between the shortest and the longest span; the longest span
    whose grid gives ``GRID_FILL`` programs per SM (or the shortest); in batch-invariant mode one span whatever the
    rows."""
    from deepinfer_cuda_sm100 import attention

    lo, hi, fill, sms = attention.MIN_SPLIT_TOKENS, attention.MAX_SPLIT_TOKENS, attention.GRID_FILL, 132
    grid = lambda programs, context, split: programs * -(-context // split)
    picked = set()
    for programs in (1, 2, 16, 64, 66, 128, 256):
        for context in (64, 1000, 4096, 16384, 131072):
            split = attention._split_tokens(programs, context, sms, invariant=False)
            picked.add(split)
            assert lo <= split <= hi and split % 64 == 0, (programs, context, split)
            assert grid(programs, context, split) >= fill * sms or split == lo, (programs, context, split)
            assert split == hi or grid(programs, context, 2 * split) < fill * sms, (programs, context, split)
            assert attention._split_tokens(programs, context, sms, invariant=True) == attention.SPLIT_TOKENS
    assert {lo, hi} <= picked and len(picked) > 3, picked


def test_mla_decode_folds_a_short_last_span_where_the_grid_has_waves():
    """Default mode folds a last span of at most ``FOLD_SHARE`` of a span into the spans before it, in whole 64-token
    blocks, where the grid has more programs than SMs; below that, and in batch-invariant mode, it never folds. The
    spans always cover the context, each span but the last full."""
    from deepinfer_cuda_sm100 import attention

    sms, cdiv = 132, lambda a, b: -(-a // b)
    # 256 rows of 128 heads at a 4k context and one more page: one span, no partials and no merge
    assert attention._spans(512, 4096 + 64, sms, invariant=False) == (4096 + 64, 1)
    assert attention._spans(512, 4096 + 64, sms, invariant=True) == (attention.SPLIT_TOKENS, 3)
    assert attention._spans(16, 4096 + 64, sms, invariant=False) == (1024, 5)  # 80 programs: one wave
    folded = 0
    for programs in (1, 16, 64, 128, 256, 512):
        for context in (64, 1024, 4160, 5120, 8256, 16448, 131072 + 64):
            split = attention._split_tokens(programs, context, sms, invariant=False)
            span, n = attention._spans(programs, context, sms, invariant=False)
            assert span % 64 == 0 and (n - 1) * span < context <= n * span, (programs, context, span, n)
            tail = context - (cdiv(context, split) - 1) * split
            fold = programs * cdiv(context, split) > sms and tail <= attention.FOLD_SHARE * split and context > split
            assert (span, n) != (split, cdiv(context, split)) if fold else (span, n) == (split, cdiv(context, split))
            folded += fold
    assert folded > 3


MLA_FOLDED = """
from deepinfer.conformance.attention import _mla_case
from deepinfer.conformance.runner import check_case
from deepinfer_cuda_sm100 import attention

spans, pick = set(), attention._spans
attention._split_tokens = lambda *a: 256
attention._spans = lambda *a: spans.add((a[-1], pick(*a))) or pick(*a)
for fmt, s_q in (("bf16", 1), ("fp8_ds_mla", 2)):  # 17 pages of 64 in the table: spans of 256, the last of 64
    results = check_case(_mla_case(3, s_q, 16, (1025, 1088), 64, fmt), "cuda_sm100", seed=7, device="cpu")
    print(fmt, [(r.check, r.status) for r in results if r.impl == "cuda_sm100/triton-split"])
print(sorted(spans))
"""


def test_mla_decode_folded_spans_match_the_reference():
    """Spans folded to a length that is no power of two (four of 320 tokens, five blocks each, for five of 256)
    attend within the conformance tolerance of the reference, in both cache formats, one and two queries a row,
    contiguous and strided inputs; batch-invariant mode keeps its spans."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", MLA_FOLDED], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    ok = "[('accuracy', 'pass'), ('strided', 'pass')]"
    assert out.stdout.split("\n")[:3] == [f"bf16 {ok}", f"fp8_ds_mla {ok}", "[(False, (320, 4)), (True, (256, 5))]"]


GROUPED_STRIDED = """
import torch, deepinfer
from deepinfer import ops
from deepinfer.conformance.cases import error
from deepinfer_cuda_sm100 import gemm

blocks, pick = [], gemm.TensorDescriptor.from_tensor
gemm.TensorDescriptor.from_tensor = lambda t, block: blocks.append(len(block)) or pick(t, block)
g = torch.Generator().manual_seed(3)
w = torch.randn(3, 64, 128, generator=g).bfloat16() * 128**-0.5
for tokens in (80, 40):  # the 64-row tile (3-D copies of the view), then the decode tile (pointer loads of it)
    q = torch.randn(tokens, 3, 192, generator=g).bfloat16()
    a = q[..., :128].transpose(0, 1)  # [heads, tokens, 128]: rows 3 x 192 elements apart, heads 192
    masked = torch.tensor([tokens, tokens - 7, 0], dtype=torch.int32)
    rows = torch.arange(tokens)[None, :] < masked[:, None]  # the rows the contract defines
    with deepinfer.use("reference"):
        want = ops.grouped_gemm(a, w, masked_m=masked, out_dtype=torch.bfloat16)[rows]
    outs = []
    with deepinfer.use("cuda_sm100"):
        for in_place in (True, False):
            gemm.STRIDED_A_TMA, blocks[:] = in_place, []
            outs.append(ops.grouped_gemm(a, w, masked_m=masked, out_dtype=torch.bfloat16)[rows])
            print(tokens, in_place, sorted(set(blocks)), error(outs[-1], want) < 1e-2)
    print(torch.equal(*outs))
"""


def test_grouped_gemm_reads_strided_masked_views_in_place():
    """Masked bf16 ``grouped_gemm`` over a view strided by rows and experts (absorbed MLA's per-head queries): at the
    64-row tile it is read in place by 3-D TMA copies, at decode rows by pointer loads; within the conformance
    tolerance of the reference, and the same bits as a contiguous copy of the view read by 2-D copies."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", GROUPED_STRIDED], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:6] == [
        "80 True [2, 3] True",
        "80 False [2] True",
        "True",
        "40 True [] True",
        "40 False [] True",
        "True",
    ]


MLA_TMA_PATHS = """
import torch, deepinfer
from deepinfer import ops
from deepinfer.conformance.attention import _mla_case
from deepinfer.conformance.cases import Gen
from deepinfer_cuda_sm100 import attention

chosen, pick = [], attention._mla_tma
attention._mla_tma = lambda *a: chosen.append(pick(*a)) or chosen[-1]
with deepinfer.use("cuda_sm100"):
    for fmt in ("bf16", "fp8_ds_mla"):
        kw = _mla_case(2, 1, 16, (100, 200), 64, fmt).make(Gen(3, "cpu"))
        outs = []
        for tma in (True, False):
            attention.MLA_TMA = tma
            outs.append(ops.mla_decode(**kw))
        print(fmt, all(torch.equal(a, b) for a, b in zip(*outs)))
print(chosen)
"""


def test_mla_decode_tma_and_pointer_paths_agree():
    """At DeepSeek-V3's record layouts (latent 512, rope 64, pages of 64) ``mla_decode`` reads whole blocks by TMA
    copies, in both cache formats, and gives the same bits as with pointer loads (the partial last block of a span
    is gathered with masks either way)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", MLA_TMA_PATHS], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["bf16 True", "fp8_ds_mla True", "[True, False, True, False]"]


MLA_DIRECT = """
import torch, deepinfer
from deepinfer import ops
from deepinfer.kv_cache import pack_fp8_ds_mla
from deepinfer_cuda_sm100 import attention

empty = torch.empty
torch.empty = lambda *a, **k: empty(*a, **k).fill_(7)  # what a kernel leaves unwritten is not zero by chance
g = torch.Generator().manual_seed(0)
with deepinfer.use("cuda_sm100"):
    for fmt in ("bf16", "fp8_ds_mla"):
        cache = deepinfer.allocate_kv_cache(6, 64, kv_lora_rank=512, rope_dim=64, kv_format=fmt, device="cpu")
        latent = torch.randn(6 * 64, 576, generator=g).bfloat16()
        cache.view(6 * 64, -1).copy_(latent if fmt == "bf16" else pack_fp8_ds_mla(latent, 512))
        kw = dict(q=torch.randn(3, 1, 16, 576, generator=g).bfloat16(), kv_cache=cache, softmax_scale=0.1,
                  block_table=torch.randperm(6, generator=g).view(3, 2).int(), kv_format=fmt,
                  seq_lens=torch.tensor([0, 37, 64], dtype=torch.int32))
        runs = []
        for span in (128, 64):  # one span over the 128-token table: written directly; two, the second empty: merged
            attention._split_tokens = lambda *a, span=span: span
            runs.append(ops.mla_decode(**kw))
        (direct, direct_lse), (merged, merged_lse) = runs
        print(fmt, torch.equal(direct, merged), torch.equal(direct_lse, merged_lse), bool((direct[0] == 0).all()),
              bool((direct_lse[0] == float("-inf")).all()), bool(direct[1:].abs().amax() > 0))
"""


def test_mla_decode_one_span_writes_the_merged_result():
    """Where one KV span covers the context, the split kernel writes the output and lse itself; they equal, bit for
    bit, what the merge gives when the same span is one of two (the other empty), and a row that sees nothing gets
    zeros and lse = -inf, as the merge would give it."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", MLA_DIRECT], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["bf16 True True True True True", "fp8_ds_mla True True True True True"]


MLA_BF16_COPY = """
import torch, deepinfer
from deepinfer import ops
from deepinfer.kv_cache import pack_fp8_ds_mla, unpack_fp8_ds_mla
from deepinfer_cuda_sm100 import attention

empty = torch.empty
torch.empty = lambda *a, **k: empty(*a, **k).fill_(7)  # rows the copy must not write stay 7
g = torch.Generator().manual_seed(1)
cache = deepinfer.allocate_kv_cache(8, 64, kv_lora_rank=512, rope_dim=64, kv_format="fp8_ds_mla", device="cpu")
cache.view(8 * 64, -1).copy_(pack_fp8_ds_mla(torch.randn(8 * 64, 576, generator=g).bfloat16() * 30, 512))
table = torch.randperm(8, generator=g)[:6].view(3, 2).int()
lens = torch.tensor([100, 0, 128], dtype=torch.int32)
copy, copy_table = attention._bf16_copy(cache, table, lens, 512, 64)
want = unpack_fp8_ds_mla(cache.view(8 * 64, -1), 512).bfloat16()
rows = [(b * 128 + t, int(table[b, t // 64]) * 64 + t % 64) for b in range(3) for t in range(int(lens[b]))]
print(all(torch.equal(copy[c], want[w]) for c, w in rows), copy_table.tolist())
print(bool((copy[100:256] == 7).all()))  # past sequence 0's length, and all of sequence 1's
kw = dict(q=torch.randn(3, 1, 16, 576, generator=g).bfloat16(), softmax_scale=0.1, seq_lens=lens)
with deepinfer.use("cuda_sm100"):
    fp8 = ops.mla_decode(kv_cache=cache, block_table=table, kv_format="fp8_ds_mla", **kw)
    bf16 = ops.mla_decode(kv_cache=copy.view(6, 64, 576), block_table=copy_table, kv_format="bf16", **kw)
print(all(torch.equal(a, b) for a, b in zip(fp8, bf16)))
"""


def test_mla_decode_bf16_copy_of_an_fp8_cache_is_exact():
    """``attention._bf16_copy`` (batch-invariant mode's fp8_ds_mla cache where the Gluon split kernel runs in latent
    halves): each sequence's tokens below its length, dequantised exactly as ``unpack_fp8_ds_mla`` does, at row
    ``sequence * reach + position``; rows past the length are not written; ``mla_decode`` over the copy as a bf16
    cache gives the fp8_ds_mla cache's bits."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", MLA_BF16_COPY], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["True [[0, 1], [2, 3], [4, 5]]", "True", "True"]


INDEXER_TOPK_PATHS = """
import torch, deepinfer
from deepinfer import ops
from deepinfer.conformance.cases import Gen
from deepinfer.conformance.sparse_attention import _compare_topk, _index_cache, _pack_lens
from deepinfer_cuda_sm100 import sparse_attention as sa

sa.TOPK_DOT_ELEMENTS = 256  # 16 positions per step with 16 heads
sa.TOPK_LOOP_BLOCK_N = 16
sa.TOPK_SPAN = 16  # three programs over a row of the 48-position table, some of them past the query's limit
sa.TOPK_KEYS_BYTES = 4 * 48 * 8  # rows in chunks of four (each sorted by one program), then three
g = Gen(5, "cpu")
q_lens, seq_lens = [1, 4, 2], [40, 33, 6]
for fmt in ("bf16", "fp8_ds_index"):
    line = [fmt]
    for heads in (4, 16):  # one head at a time, then tl.dot
        for integer in (True, False):
            cache, table = _index_cache(g, seq_lens, 16, 128, fmt, integer)
            t = sum(q_lens)
            if integer:
                q = g.randint(-2, 3, t, heads, 128).to(torch.bfloat16)
                w = torch.exp2(g.randint(-2, 3, t, heads).float()) * (g.randint(0, 2, t, heads).float() * 2 - 1)
            else:
                q, w = g.randn(t, heads, 128), g.randn(t, heads, dtype=torch.float32, scale=heads**-0.5)
            kw = dict(q=q, weights=w, index_cache=cache, block_table=table, cu_seqlens_q=_pack_lens(q_lens, "cpu"),
                      seq_lens=torch.tensor(seq_lens, dtype=torch.int32))
            for topk in (20, 100):  # 100: more than the table's 48 positions
                with deepinfer.use("reference"):
                    want = ops.indexer_topk(**kw, topk=topk)
                with deepinfer.use("cuda_sm100"):
                    got = ops.indexer_topk(**kw, topk=topk)
                exact = torch.equal(got, want)
                line.append(exact if integer else _compare_topk(got, want, {**kw, "topk": topk}) < 1e-3)
    print(*line)
"""


def test_indexer_topk_head_paths_spans_chunks_and_padding():
    """``indexer_topk`` with one head at a time (4 heads) and with tl.dot (16 heads; the conformance cases have
    at most 8), each row scored by several span programs, rows in chunks of sort keys (each sorted by one program,
    the last with a masked row), and topk above the table's capacity (-1 past it): bit for bit the reference's
    slots on integer-valued inputs (exact scores, frequent ties), within the conformance tolerance on random
    ones."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", INDEXER_TOPK_PATHS], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["bf16" + " True" * 8, "fp8_ds_index" + " True" * 8]


SPARSE_MLA_UNLISTED = """
import torch, deepinfer
from deepinfer import ops
from deepinfer.conformance.cases import error
from deepinfer.dispatch import batch_invariant, last_resolution
from deepinfer.kv_cache import pack_fp8_ds_mla
from deepinfer_cuda_sm100 import sparse_attention as sa

sa.SPARSE_TILE = dict(sa.SPARSE_TILE, BLOCK_N=16)
sa.SPARSE_MIN_SPLIT, sa.num_sms = 16, lambda *_: 1000  # default mode: spans of 16 entries, merged
g = torch.Generator().manual_seed(3)
for fmt, rank, rope in (("bf16", 128, 64), ("fp8_ds_mla", 256, 32), ("bf16", 96, 24), ("fp8_ds_mla", 384, 64)):
    cache = deepinfer.allocate_kv_cache(8, 16, kv_lora_rank=rank, rope_dim=rope, kv_format=fmt, device="cpu")
    cache.view(torch.uint8).fill_(0xFF)  # NaN at every slot but the listed ones
    listed = torch.randperm(128, generator=g)[:40]
    listed = listed[listed != 0]  # slot 0 (where a -1 entry would land if it were read) stays NaN
    tokens = torch.randn(listed.numel(), rank + rope, generator=g).bfloat16()
    cache.view(128, -1)[listed] = tokens if fmt == "bf16" else pack_fp8_ds_mla(tokens, rank)
    indices = torch.full((5, 96), -1, dtype=torch.int32)
    indices[0, :30] = listed[:30].int()  # a prefix, then -1 (indexer_topk's layout)
    indices[1, [0, 50, 95]] = listed[30:33].int()  # whole steps and spans of -1 between listed slots
    indices[2, ::2] = listed[torch.randint(0, listed.numel(), (48,), generator=g)].int()  # repeats
    indices[4, 17] = listed[5]  # row 3: nothing listed; row 4: one slot
    kw = dict(q=torch.randn(5, 16, rank + rope, generator=g).bfloat16(), kv_cache=cache, indices=indices,
              softmax_scale=0.1, kv_lora_rank=rank)
    with deepinfer.use("reference"):
        want = ops.sparse_mla(**kw)
    line = [fmt]
    with deepinfer.use("cuda_sm100"):
        for invariant in (True, False):
            with batch_invariant(invariant):
                out, lse = ops.sparse_mla(**kw)
            impl, fallback = last_resolution("sparse_mla")
            line += [impl.provider, not fallback, bool(out.isfinite().all()), error((out, lse), want) < 1e-2]
            line += [bool((out[3] == 0).all() and (lse[3] == float("-inf")).all())]
    print(*line)
"""


def test_sparse_mla_reads_only_listed_slots():
    """``sparse_mla`` over a cache that holds NaN at every slot but the listed ones (slot 0 included, where a -1
    entry would land if it were read): -1 entries before, between (whole steps and whole spans of them) and after
    the listed slots, repeated slots, a row with one slot and a row with none. The outputs are finite and within
    the conformance tolerance of the reference, zeros and lse = -inf for the empty row, both for the batch-invariant
    kernel (the whole list in one program) and for the default mode's spans of 16 entries, merged by lse (where the
    latent is a power of two). Latents and rope parts of other widths (96 + 24, 384 + 64; the conformance cases
    have powers of two) run in padded, masked tiles."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", SPARSE_MLA_UNLISTED], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    row = " triton-unsplit True True True True triton True True True True"
    assert out.stdout.split("\n")[:4] == [fmt + row for fmt in ("bf16", "fp8_ds_mla") * 2]


SPARSE_MLA_FP8_PAGES = """
import torch, deepinfer
from deepinfer import ops
from deepinfer.conformance.cases import error
from deepinfer.kv_cache import pack_fp8_ds_mla
from deepinfer_cuda_sm100 import sparse_attention as sa

copies, kept = [], []
copy = sa._bf16_copy


def copying(cache, table, *args):  # records each copy's pages, then spoils the fp8 cache until the call returns
    out = copy(cache, table, *args)
    copies.append(table.tolist())
    kept.append(cache.clone())
    cache.view(torch.uint8).fill_(0xFF)
    return out


def attend(**kw):
    out = ops.sparse_mla(**kw)
    if kept:
        kw["kv_cache"].copy_(kept.pop())
    return out


sa._bf16_copy = copying
sa.SPARSE_TILE = dict(sa.SPARSE_TILE, BLOCK_N=16)
sa.SPARSE_MIN_SPLIT, sa.num_sms = 16, lambda *_: 1000  # spans of 16 entries, merged
sa.FP8_COPY_ROW_PAGES = 2  # the copy's pages in two rows of its grid
g = torch.Generator().manual_seed(4)
pages = [6, 1, 3]  # one sequence of 80 tokens in pages of 32: 6, 1 and half of 3
slots = torch.cat([torch.arange(p * 32, p * 32 + 32) for p in pages])[:80]
indices = torch.full((24, 32), -1, dtype=torch.int32)
for t in range(23):  # its last 24 tokens, causal: each lists 32 of the positions it sees (the last lists nothing)
    indices[t] = slots[torch.randperm(57 + t, generator=g)[:32]].int()
indices[3] = torch.where(torch.rand(32, generator=g) < 0.3, -1, indices[3])  # -1 entries anywhere
for rope in (64, 48):  # 48: not a power of two, so never copied
    cache = deepinfer.allocate_kv_cache(8, 32, kv_lora_rank=512, rope_dim=rope, kv_format="fp8_ds_mla", device="cpu")
    cache.view(torch.uint8).fill_(0xFF)  # NaN at every slot but the listed ones, listed pages' other slots included
    cache.view(256, -1)[slots] = pack_fp8_ds_mla(torch.randn(80, 512 + rope, generator=g).bfloat16(), 512)
    kw = dict(q=torch.randn(24, 16, 512 + rope, generator=g).bfloat16(), kv_cache=cache, indices=indices,
              softmax_scale=0.1, kv_lora_rank=512)
    with deepinfer.use("reference"):
        want = ops.sparse_mla(**kw)
    line = [rope]
    # never; copied (683 entries over 96 slots); too few entries per slot; nothing listed
    for min_tokens, reuse, listed in ((10**9, 4, True), (8, 4, True), (8, 8, True), (8, 4, False)):
        sa.FP8_COPY_MIN_TOKENS, sa.FP8_COPY_MIN_REUSE = min_tokens, reuse
        with deepinfer.use("cuda_sm100"):
            out, lse = attend(**(kw if listed else dict(kw, indices=torch.full_like(indices, -1))))
        if not listed:
            line += [len(copies), bool((out == 0).all() and (lse == float("-inf")).all())]
            continue
        line += [len(copies), bool(out.isfinite().all()), error((out, lse), want) < 1e-2]
        if min_tokens == 10**9:
            direct = (out, lse)
        else:
            line.append(torch.equal(out, direct[0]) and torch.equal(lse, direct[1]))
    print(*line)
print(copies)
"""


def test_sparse_mla_prefill_copies_listed_fp8_pages_to_bf16():
    """A prefill-sized chunk over an fp8_ds_mla cache (default mode) attends over a bf16 copy of the pages its lists
    name, each listed page once in page order (here over two rows of the copy kernel's grid), with the lists
    renumbered into the copy: the direct kernel's bits, unlisted slots of copied pages (NaN) never read, -1 entries
    kept, and the fp8 records themselves not read once copied (the test spoils them until the call returns). A chunk
    below ``FP8_COPY_MIN_TOKENS``, one whose lists name their pages' slots too few times (``FP8_COPY_MIN_REUSE``), one
    that lists nothing and one whose rope part is not a power of two read the fp8 records directly."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", SPARSE_MLA_FP8_PAGES], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == [  # the number of copies so far, then each call's checks
        "64 0 True True 1 True True True 1 True True True 1 True",
        "48 1 True True 1 True True True 1 True True True 1 True",
        "[[[1, 3], [6, 0]]]",
    ]


def setup_rank() -> None:
    deepinfer.use("cuda_sm100")
    from deepinfer_cuda_sm100 import moe

    moe.PACK_TILE = 64  # a few tokens per program, so that the small cases span several programs


def sc_normal(rank: int, world: int) -> list[tuple[str, str]]:
    """Multi-rank normal mode: this backend's dispatch kernels (the core's exchanges), then its combine kernel, in
    default and batch-invariant mode, for bf16 and FP8 payloads, repeated, skipped and all-skipped slots, a rank
    without tokens and replicated experts. The dispatch equals the core's own (its torch index work) byte for byte,
    handle included; rows of an odd number of bytes go to the core. fp32 expert outputs in default mode take the
    combine by per-rank partial sums (k = 3 at two ranks), within fp32 reassociation of the core's and the
    one-process reference; in batch-invariant mode they are bit for bit both. bf16 ones return a row per pair:
    within the interpreter's fp32 -> bf16 cast, which truncates (a GPU rounds to nearest even). Returns (dispatch,
    combine) implementations per case."""
    served = []
    experts = 4 * world
    replicated = ExpertPlacement(experts, [range(r * 4, r * 4 + 6) if r == 0 else range(r * 4, r * 4 + 4) for r in
                                           range(world)])  # fmt: skip
    cases = [
        ("bf16", 64, None, torch.float32, None),
        ("fp8", 256, "fp32", torch.float32, None),
        ("bf16_out", 64, None, torch.bfloat16, None),
        ("odd_width", 66, None, torch.bfloat16, None),
        ("odd_bytes", 65, None, torch.float32, None),
        ("replicated", 64, None, torch.float32, replicated),
    ]
    group = torch.distributed.group.WORLD
    for invariant in (False, True):
        for name, hidden, fp8, dtype, placement in cases:
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            p = random_problem(
                g, token_counts(g, world, 24, empty_rank=world - 1), experts, 3, hidden, fp8=fp8, repeat=0.2
            )
            p.ids[0][0] = -1
            label = f"{name}, batch-invariant {invariant}"
            with batch_invariant(invariant):
                out = ep_dispatch(p.xs[rank], p.ids[rank], p.weights[rank], num_experts=experts, group=group,
                                  placement=placement)  # fmt: skip
                dispatched = last_resolution("ep_dispatch")
                full = placement or ExpertPlacement.contiguous(experts, world)
                core = ep_ref.dispatch_normal(p.xs[rank], p.ids[rank], p.weights[rank], group=group, placement=full)
                y = expert(out[0], out[1], out[3], dtype)
                combined = ep_combine(y, out[4])
                combiner = last_resolution("ep_combine")
                core_combined = ep_ref.combine_normal(y, out[4])
                partial = ep_ref.sums_per_rank(y, out[4])
                ref = reference_out(p, rank, dtype)
            assert torch.equal(row_bytes(out[0]), row_bytes(core[0])), label
            assert torch.equal(out[1], core[1]) and torch.equal(out[2], core[2]), label
            assert torch.equal(out[3].expert_offsets, core[3].expert_offsets), label
            h, hc = out[4], core[4]
            assert isinstance(h, ep_ref.NormalHandle), label
            for field in ("final", "pair_pos", "copy_rows", "copy_weights", "copy_pos"):
                assert torch.equal(getattr(h, field), getattr(hc, field)), (label, field)
            splits = ("send_splits", "recv_splits", "copy_splits", "copy_recv_splits")
            assert [getattr(h, f) for f in splits] == [getattr(hc, f) for f in splits], label
            assert combined.dtype == dtype, label
            assert partial == (dtype == torch.float32 and not invariant), label
            if partial:
                torch.testing.assert_close(core_combined, ref, rtol=1e-5, atol=1e-5, msg=label)
                torch.testing.assert_close(combined, core_combined, rtol=1e-5, atol=1e-5, msg=label)
            else:
                assert torch.equal(core_combined, ref), label
                if dtype == torch.float32:
                    assert torch.equal(combined, ref), label
                else:
                    torch.testing.assert_close(combined.float(), ref.float(), rtol=2**-7, atol=0, msg=label)
            served.append(tuple(f"{i.backend}/{i.provider}" + " (fallback)" * f for i, f in (dispatched, combiner)))
    return served


def _low_latency_case(rank, world, p, capacity, placement, dtype, label) -> tuple[str, str]:
    """One low-latency dispatch and combine through this backend, beside the core's own on the same inputs: the
    same layout (rows below ``masked_m``), ids, weights, ``masked_m``, overflow and handle; the combine within fp32
    reassociation of the core's, bit for bit in batch-invariant mode. Returns the (dispatch, combine) served."""
    group = torch.distributed.group.WORLD
    full = placement or ExpertPlacement.contiguous(p.num_experts, world)
    x, ids, w = p.xs[rank], p.ids[rank], p.weights[rank]
    out = ep_dispatch(x, ids, w, num_experts=p.num_experts, group=group, mode="low_latency", capacity=capacity,
                      placement=full)  # fmt: skip
    dispatched = last_resolution("ep_dispatch")
    core = ep_ref.dispatch_low_latency(x, ids, w, group=group, placement=full, capacity=capacity)
    y = expert(out[0], out[1], out[3], dtype)
    combined = ep_combine(y, out[4])
    combiner = last_resolution("ep_combine")
    core_combined = ep_ref.combine_low_latency(y, core[4])
    masked_m = out[3].masked_m
    assert torch.equal(masked_m, core[3].masked_m), label
    assert torch.equal(out[1], core[1]) and torch.equal(out[2], core[2]), label
    for e, m in enumerate(masked_m.tolist()):
        assert torch.equal(row_bytes(out[0])[e, :m], row_bytes(core[0])[e, :m]), (label, e)
    h, hc = out[4], core[4]
    assert bool(h.overflow) == bool(hc.overflow), label
    assert torch.equal(h.mine, hc.mine) and torch.equal(h.rows[h.mine], hc.rows[hc.mine]), label
    assert torch.equal(h.weights, hc.weights) and torch.equal(h.lost, hc.lost), label
    assert torch.equal(torch.isnan(combined), torch.isnan(core_combined)), label
    if batch_invariant_enabled():
        assert torch.equal(combined, core_combined), label
    else:
        torch.testing.assert_close(combined, core_combined, rtol=1e-5, atol=1e-5, equal_nan=True, msg=label)
    return tuple(f"{i.backend}/{i.provider}" + " (fallback)" * f for i, f in (dispatched, combiner))


def sc_low_latency(rank: int, world: int) -> list[tuple[str, str]]:
    """Multi-rank low-latency mode: this backend's placement kernels (the core's exchange), then its combine kernel,
    in default and batch-invariant mode, for bf16 and FP8 payloads, repeated, skipped and all-skipped slots, a rank
    without tokens and replicated experts, each beside the core's own (``_low_latency_case``); then capacity
    overflow with value checks off (the same lost rows, NaN for the same tokens). fp32 expert outputs also match the
    one-process reference within fp32 reassociation. Returns (dispatch, combine) implementations per case."""
    served = []
    experts = 4 * world
    replicated = ExpertPlacement(experts, [range(r * 4, r * 4 + 6) if r == 0 else range(r * 4, r * 4 + 4) for r in
                                           range(world)])  # fmt: skip
    # (name, hidden, FP8 scale format, placement, rank without tokens)
    cases = [
        ("bf16", 64, None, None, world - 1),
        ("fp8", 256, "fp32", None, None),
        ("replicated", 64, None, replicated, None),
    ]
    for invariant in (False, True):
        for name, hidden, fp8, placement, empty in cases:
            g = torch.Generator().manual_seed(zlib.crc32(("ll" + name).encode()))
            p = random_problem(g, token_counts(g, world, 12, empty_rank=empty), experts, 3, hidden, fp8=fp8, repeat=0.2)
            p.ids[0][0] = -1
            full = placement or ExpertPlacement.contiguous(experts, world)
            capacity = fitting_capacity(p, full, 12)
            label = f"low-latency {name}, batch-invariant {invariant}"
            with batch_invariant(invariant):
                served.append(_low_latency_case(rank, world, p, capacity, placement, torch.float32, label))
                y_ref = reference_out(p, rank, torch.float32)
            group = torch.distributed.group.WORLD
            out = ep_dispatch(p.xs[rank], p.ids[rank], p.weights[rank], num_experts=experts, group=group,
                              mode="low_latency", capacity=capacity, placement=full)  # fmt: skip
            combined = ep_combine(expert(out[0], out[1], out[3], torch.float32), out[4])
            torch.testing.assert_close(combined, y_ref, rtol=1e-5, atol=1e-5, msg=label)
    p, capacity = overflow_problem(torch.Generator().manual_seed(7), world, 64)
    os.environ["DEEPINFER_VALUE_CHECKS"] = "0"
    try:
        served.append(_low_latency_case(rank, world, p, capacity, None, torch.float32, "low-latency overflow"))
    finally:
        del os.environ["DEEPINFER_VALUE_CHECKS"]
    return served


SCENARIOS = {"normal": sc_normal, "low_latency": sc_low_latency}


def test_multi_rank_normal_dispatch_and_combine(monkeypatch):
    """Two Gloo ranks on the CPU, the kernels through the interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got = launch(__name__, 2, list(SCENARIOS), pg_timeout_s=60, deadline_s=300)
    for rank in range(2):
        assert (rank, "normal") in got, f"rank {rank} never reported"
        err, served, _ = got[(rank, "normal")]
        assert err is None, f"rank {rank}:\n{err}"
        kernels = ("cuda_sm100/triton", "cuda_sm100/triton")
        assert served == [("reference/torch (fallback)", "cuda_sm100/triton") if i % 6 == 4 else kernels
                          for i in range(12)], served  # fmt: skip
        assert (rank, "low_latency") in got, f"rank {rank} never reported low_latency"
        err, served, _ = got[(rank, "low_latency")]
        assert err is None, f"rank {rank}:\n{err}"
        assert served == [kernels] * 7, served


STRIDED_INDICES = """
import torch, deepinfer
from deepinfer.conformance.cases import Gen, bitwise_equal, error, strided
from deepinfer.conformance.runner import _run, all_cases
from deepinfer.conformance.tolerances import tolerance

ARGS = {  # the index arguments of each op, and the small vectors read beside the operands
    "mla_decode": ("seq_lens", "block_table"),
    "attention_varlen": ("cu_seqlens_q", "cu_seqlens_k"),
    "write_kv_cache": ("slot_mapping",),
    "write_index_cache": ("slot_mapping",),
    "indexer_topk": ("block_table", "cu_seqlens_q", "seq_lens"),
    "sparse_mla": ("indices",),
    "grouped_gemm": ("expert_offsets", "masked_m"),
    "silu_and_mul": ("masked_m",),
    "rope": ("positions",),
    "sample": ("seeds",),
    "gemm": ("bias",),
    "moe_route": ("bias",),
}
seen = set()
for i, case in enumerate(all_cases("small")):
    for arg in ARGS.get(case.op, ()):
        kw = case.make(Gen(100 + i, "cpu"))
        if (case.op, case.variant, arg) in seen or kw.get(arg) is None or kw[arg].shape[0] < 2:
            continue
        seen.add((case.op, case.variant, arg))
        with deepinfer.use("reference"):
            ref = _run(case, kw)
        for inner in (True, False) if kw[arg].dim() > 1 else (True,):  # a table's rows strided, or padded only
            with deepinfer.use("cuda_sm100"):
                out = _run(case, {**kw, arg: strided(kw[arg], inner=inner)})
                if case.op == "sample":  # a seed fixes its draw: the same tokens as from contiguous seeds
                    ok = bitwise_equal(out, _run(case, kw))
                else:
                    compare = case.compare or (lambda o, r, k: error(o, r))
                    ok = compare(out, ref, kw) <= tolerance(case.op, case.variant)[0]
            print(case.op, case.variant, arg, "ok" if ok else "WRONG")
"""


def test_kernels_read_non_contiguous_index_tensors():
    """Every index argument (slots, lengths, offsets, page tables, positions, seeds) of every Triton kernel, and the
    biases, given as a non-contiguous view: the results equal the reference's on the same values, in each cache
    format and layout (and a seed draws the token it draws from a contiguous tensor)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", STRIDED_INDICES], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-4000:]
    lines = out.stdout.splitlines()
    assert len(lines) >= 20, lines
    assert [line for line in lines if not line.endswith(" ok")] == []


MLA_NO_PAGES = """
import torch, deepinfer
from deepinfer import ops

empty = torch.empty
torch.empty = lambda *a, **k: empty(*a, **k).fill_(7)  # what a kernel leaves unwritten is not zero by chance
g = torch.Generator().manual_seed(2)
for fmt, width in (("bf16", 192), ("fp8_ds_mla", 196)):
    cache = deepinfer.allocate_kv_cache(2, 16, kv_lora_rank=128, rope_dim=64, kv_format=fmt, device="cpu")
    kw = dict(q=torch.randn(3, 2, 4, 192, generator=g).bfloat16(), kv_cache=cache, softmax_scale=0.1,
              block_table=torch.zeros(3, 0, dtype=torch.int32), seq_lens=torch.zeros(3, dtype=torch.int32),
              kv_lora_rank=128)
    with deepinfer.use("cuda_sm100"):
        out, lse = ops.mla_decode(**kw)
    print(fmt, bool((out == 0).all()), bool((lse == float("-inf")).all()))
"""


def test_mla_decode_with_a_block_table_of_no_columns():
    """A block table ``[B, 0]`` (every ``seq_lens`` 0): zeros and ``lse = -inf``, as for any query that sees nothing,
    not whatever the output buffers held."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", MLA_NO_PAGES], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.splitlines() == ["bf16 True True", "fp8_ds_mla True True"]
