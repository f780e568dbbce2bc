"""The Hopper FP8 ``gemm`` kernel in Gluon (``backends/cuda_sm100/gemm_gluon.py``): compiled for SM90 on the CPU, and
the rule that picks it. Gluon has no interpreter, so its results are proven on the GPU (bit for bit against the
unsplit Triton kernel in ``benchmarks/gluon_gemm_ws.py``, conformance at full shapes: RESULTS.md); here CI checks
that it still compiles with the installed Triton, into the tensor-core work it was measured with."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
import triton
from gluon_helpers import (
    MAX_SHARED,
    compile_gemm_sm90,
    compile_sm90,
    descriptor_type,
    gemm_descriptor_types,
    ptxas_report,
    wgmma_serialized,
)
from triton.experimental.gluon import language as gl

from deepinfer import QTensor
from deepinfer.dispatch import batch_invariant
from deepinfer.qtensor import quantize_blocks, quantize_rows
from deepinfer_cuda_sm100 import gemm_gluon


@pytest.mark.parametrize("schedule", ["RESIDENT", "STREAMED"])
def test_kernel_compiles_for_sm90_into_one_product_per_consumer_without_spills(schedule):
    kernel = compile_gemm_sm90(getattr(gemm_gluon, schedule))
    ptx = kernel.asm["ptx"]
    # three consumers, each one 128-deep product per K block: 4 steps of k32 on 64 rows x 128 columns
    assert re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.e4m3\.e4m3", ptx) == ["m64n128k32"] * 12
    assert "setmaxnreg.dec" in ptx  # the producer warp gives its registers to the consumers
    assert "fma.rn.f32" in ptx  # acc + part * factor in one rounding, as the unsplit kernel and cuBLAS
    assert kernel.metadata.shared <= MAX_SHARED
    report = ptxas_report(ptx)
    assert "Used" in report and not wgmma_serialized(report)
    frames = re.findall(r"(\d+) bytes stack frame", report)
    assert frames and set(frames) == {"0"}  # nothing spilled


def test_traced_build_stamps_each_block_and_epilogue_step_and_the_untraced_none():
    """``launch(..., trace=...)``, the benchmark's timeline: eight cycle stamps per consumer (stage ready, product done,
    five in the store, the next tile's start), still with its products asynchronous; the untraced kernel reads no
    clock."""
    traced = compile_gemm_sm90(gemm_gluon.RESIDENT, trace_tiles=2).asm["ptx"]
    assert traced.count("%clock64") == 3 * 8
    assert not wgmma_serialized(ptxas_report(traced))
    assert "%clock64" not in compile_gemm_sm90(gemm_gluon.RESIDENT).asm["ptx"]


def _operands(m: int, n: int, k: int):
    a = quantize_rows(torch.randn(m, k), 128, "fp32")
    return a, quantize_blocks(torch.randn(n, k))


@pytest.fixture
def on_hopper(monkeypatch):
    """The rule as an SM90 GPU sees it: CPU tensors taken for device ones."""
    monkeypatch.setattr(gemm_gluon, "INTERPRET", False)
    monkeypatch.setattr(gemm_gluon, "on_device", lambda *tensors: True)
    monkeypatch.setattr(gemm_gluon, "hopper", lambda index: True)


def test_supports_short_k_from_384_rows(on_hopper):
    bf16 = torch.bfloat16
    a, w = _operands(384, 256, 512)
    assert gemm_gluon.supports(a, w, out_dtype=bf16, bias=None)
    assert gemm_gluon.supports(a.dequantize().to(bf16), w, out_dtype=bf16, bias=None)  # quantised first
    assert not gemm_gluon.supports(_operands(383, 256, 512)[0], w, out_dtype=bf16, bias=None)
    assert not gemm_gluon.supports(*_operands(384, 256, 1152), out_dtype=bf16, bias=None)  # long K: cuBLAS
    assert not gemm_gluon.supports(*_operands(384, 260, 512), out_dtype=bf16, bias=None)  # rows of 520 bytes
    assert not gemm_gluon.supports(a, w, out_dtype=torch.float32, bias=None)
    assert not gemm_gluon.supports(a, w, out_dtype=bf16, bias=torch.zeros(256, dtype=bf16))
    assert not gemm_gluon.supports(a, w.dequantize().to(bf16), out_dtype=bf16, bias=None)
    coarse = QTensor(a.data, a.scale[:, :2].repeat_interleave(2, 1)[:, :2], (1, 256), "fp32")
    assert not gemm_gluon.supports(coarse, w, out_dtype=bf16, bias=None)


@pytest.mark.parametrize(
    ("a_rows", "k", "groups"),
    [(16, 2048, 1), (16, 16384, 1), (32, 7168, 1), (64, 16384, 1), (16, 7168, 4), (64, 7168, 2)],
)
def test_few_rows_kernel_compiles_for_sm90_into_one_product_per_k_block_without_spills(a_rows, k, groups):
    fp8 = torch.empty(64, k, dtype=torch.float8_e4m3fn)
    signature = {
        "a_desc": descriptor_type(fp8, [a_rows, 128], gl.float8e4nv),
        "b_desc": descriptor_type(fp8, [64, 128], gl.float8e4nv),
        "c_ptr": "*bf16",
        "as_ptr": "*fp32",
        "bs_ptr": "*fp32",
        "parts_ptr": "*fp32",
        "count_ptr": "*i32",
    } | dict.fromkeys(("M", "N", "stride_cm"), "i32")
    k_blocks = k // 128
    constants = gemm_gluon.FEW_ROWS_SCHEDULE.constexprs() | {"K_BLOCKS": k_blocks}
    constants |= {"FACTORS": triton.next_power_of_2(k_blocks)}
    constants |= {"PDL": gemm_gluon.PDL, "K_GROUPS": groups, "PULL": gemm_gluon.few_rows_pull(k_blocks, groups, a_rows)}
    in_flight = constants["IN_FLIGHT"]
    kernel = compile_sm90(
        gemm_gluon.fp8_gemm_few_rows, signature, constants, {"num_warps": 4, "enable_fp_fusion": True}
    )
    ptx = kernel.asm["ptx"]
    # IN_FLIGHT 128-deep products at once, each 4 steps of k32, 64 weight rows by the program's rows of A
    products = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.e4m3\.e4m3", ptx)
    assert products == [f"m64n{a_rows}k32"] * 4 * in_flight
    assert ("griddepcontrol.wait" in ptx) == gemm_gluon.PDL  # launched with PDL: waits for the previous kernel
    assert "setmaxnreg.dec" in ptx  # the copying warp is specialized
    assert "fma.rn.f32" in ptx  # acc + part * factor in one rounding, as the Triton kernels
    # K groups: each counts in when its products are stored (release) and waits for the others (acquire)
    assert ("atom.global.gpu.acq_rel.add" in ptx) == ("ld.global.gpu.acquire" in ptx) == (groups > 1)
    assert kernel.metadata.shared <= MAX_SHARED
    report = ptxas_report(ptx)
    assert "Used" in report and not wgmma_serialized(report)
    assert set(re.findall(r"(\d+) bytes stack frame", report)) == {"0"}


def test_few_rows_grid_takes_the_fewest_rows_of_a_whose_grid_fits_the_sms_then_the_most_k_groups():
    assert gemm_gluon.few_rows_grid(16, 7168, 2048, 132) == (16, 1, 112)
    assert gemm_gluon.few_rows_grid(17, 7168, 2048, 132) == (32, 1, 112)
    assert gemm_gluon.few_rows_grid(64, 4096, 7168, 132) == (32, 1, 128)
    assert gemm_gluon.few_rows_grid(64, 7168, 2048, 132) == (64, 1, 112)  # 32 rows: 224 programs
    assert gemm_gluon.few_rows_grid(192, 2112, 7168, 132) == (64, 1, 99)
    assert gemm_gluon.few_rows_grid(192, 7168, 7168, 132) == (64, 1, 336)  # none fits: 64 rows
    assert gemm_gluon.few_rows_grid(1, 2112, 7168, 132) == (16, 4, 132)  # 4 K groups of 14 blocks
    assert gemm_gluon.few_rows_grid(8, 2112, 7168, 132) == (16, 4, 132)
    assert gemm_gluon.few_rows_grid(9, 2112, 7168, 132) == (16, 1, 33)  # past FEW_GROUPS_MAX_M
    assert gemm_gluon.few_rows_grid(1, 4096, 7168, 132) == (16, 1, 64)  # 4 groups: 256 programs
    assert gemm_gluon.few_rows_grid(1, 2112, 1024, 132) == (16, 1, 33)  # 8 K blocks: no groups of fewer than 8
    assert gemm_gluon.few_rows_grid(1, 2112, 6400, 132) == (16, 1, 33)  # 50 K blocks: 4 do not divide them


def test_few_rows_pull_divides_the_k_blocks_within_the_register_budget():
    assert gemm_gluon.few_rows_pull(56, 4, 16) == 56  # a quarter of 64 x 16 products: 2 registers a block
    assert gemm_gluon.few_rows_pull(56, 2, 16) == 28
    assert gemm_gluon.few_rows_pull(56, 4, 32) == 28
    assert gemm_gluon.few_rows_pull(56, 2, 64) == 8
    assert gemm_gluon.few_rows_pull(50, 2, 16) == 25


def test_launch_few_rows_refuses_k_groups_that_could_wait_forever(monkeypatch):
    """Every K group waits for its tile's others: a grid beyond the SMs could hang, unequal groups would lose blocks,
    and a group count that does not divide ``ARRIVALS`` would leave the tile's counter off its multiples."""
    monkeypatch.setattr(gemm_gluon, "num_sms", lambda *_: 132)
    a, w = _operands(1, 4096, 7168)
    with pytest.raises(ValueError, match=r"groups=4: .* got 256 programs"):
        gemm_gluon.launch_few_rows(a, w, groups=4)
    with pytest.raises(ValueError, match="groups=3: expected a divisor of 4 and of the 56 K blocks"):
        gemm_gluon.launch_few_rows(*_operands(1, 2112, 7168), groups=3)
    with pytest.raises(ValueError, match=r"groups=3: .* 48 K blocks"):  # 3 divide the blocks, not the counter's 4
        gemm_gluon.launch_few_rows(*_operands(1, 2112, 6144), groups=3)


def test_few_rows_supports_where_its_grid_fits_the_sms_once_and_fills_enough_of_them(on_hopper, monkeypatch):
    """On 132 SMs, up to 192 rows: in both modes DeepSeek-V3's (7168, *) projections up to 64 rows (then 224
    programs), (4096, 7168) up to 128 rows and (2112, 7168) from 33 to 192 rows (66 to 132 programs); in
    batch-invariant mode also (2112, 7168) up to 32 rows (33 output tiles; 4 K groups up to 8 rows), where the
    default mode's split over K is faster."""
    monkeypatch.setattr(gemm_gluon, "num_sms", lambda *_: 132)
    bf16 = torch.bfloat16
    takes = lambda m, n, k: bool(gemm_gluon.few_rows_supports(*_operands(m, n, k), out_dtype=bf16, bias=None))
    for invariant in (False, True):
        with batch_invariant(invariant):
            assert takes(1, 7168, 2048) and takes(16, 7168, 2048) and takes(64, 7168, 2048)
            assert not takes(65, 7168, 2048)  # 224 programs: two waves
            assert takes(1, 4096, 1024) and takes(128, 4096, 1024)
            assert not takes(129, 4096, 1024)  # 192 programs
            assert not takes(1, 24576, 256)  # 384 programs: three waves
            assert takes(33, 2112, 1024) and takes(192, 2112, 1024)
            assert not takes(193, 2112, 1024)
            assert takes(1, 2112, 1024) == takes(32, 2112, 1024) == invariant
            assert takes(1, 2112, 7168) == takes(8, 2112, 7168) == takes(32, 2112, 7168) == invariant
    a, w = _operands(4, 7168, 1024)
    assert gemm_gluon.few_rows_supports(a.dequantize().to(bf16), w, out_dtype=bf16, bias=None)  # quantised first
    assert not gemm_gluon.few_rows_supports(a, w, out_dtype=torch.float32, bias=None)
    assert not gemm_gluon.few_rows_supports(a, w, out_dtype=bf16, bias=torch.zeros(7168, dtype=bf16))


def test_cublas_takes_the_rows_of_whole_waves_and_the_few_row_kernel_the_rest(on_hopper, monkeypatch):
    """On 132 SMs cuBLAS's 128 x 128 tiles of (2112, 7168) at 1024 rows make 1.03 waves: 896 rows (one wave less a
    tile) go to cuBLAS and the other 128 to the few-row kernel (132 programs); likewise at 2048 and 3072 rows, not
    from 4 waves on (4096 rows), nor where the rest's grid would be as sparse as the few-row rule declines, the waves
    are whole (2976 rows is 2.99 waves: the rest would be 1024 rows), below one wave, where the rest's grid would not
    fit the SMs ((7168, 2048), (24576, 1536)), or where the short-K kernel serves."""
    from deepinfer_cuda_sm100 import gemm_cublas

    monkeypatch.setattr(gemm_cublas, "num_sms", lambda *_: 132)
    monkeypatch.setattr(gemm_cublas, "cublas_fp8_supports", lambda a, w, **kw: True)  # stands in for cuBLAS
    waves = lambda m, n, k: gemm_cublas.cublas_whole_waves(m, n, k, 132)
    assert [waves(m, 2112, 7168) for m in (1024, 2048, 3072, 4096)] == [896, 1920, 2944, 0]
    assert waves(3026, 2112, 7168) == 2944  # a rest of 82 rows: 99 programs
    assert waves(2976, 2112, 7168) == 0  # a rest of 32 rows: 33 programs, where the default mode splits K instead
    assert waves(2944, 2112, 7168) == waves(256, 2112, 7168) == 0
    assert waves(2048, 7168, 2048) == waves(2048, 24576, 1536) == waves(2048, 7168, 16384) == 0
    bf16 = torch.bfloat16
    takes = lambda m, n, k: bool(gemm_cublas.cublas_waves_supports(*_operands(m, n, k), out_dtype=bf16, bias=None))
    assert takes(2048, 2112, 7168) and not takes(2944, 2112, 7168) and not takes(2048, 7168, 2048)
    assert waves(2048, 2112, 512) == 1920 and not takes(2048, 2112, 512)  # the short-K kernel's
    a, w = _operands(2048, 2112, 7168)
    assert gemm_cublas.cublas_waves_supports(a.dequantize().to(bf16), w, out_dtype=bf16, bias=None)
    assert not gemm_cublas.cublas_waves_supports(a, w, out_dtype=torch.float32, bias=None)


# --- grouped_gemm at prefill rows (gemm_gluon_grouped) ---------------------------------------------------------------


@pytest.mark.parametrize(("k", "consumers"), [(7168, 3), (2048, 3), (7168, 2)])  # V3's experts: gate/up, down
def test_grouped_kernel_compiles_for_sm90_as_the_dense_one_without_spills(k, consumers):
    from deepinfer_cuda_sm100 import gemm_gluon_grouped as grouped

    signature = gemm_descriptor_types() | {"c_ptr": "*bf16", "as_ptr": "*fp32", "bs_ptr": "*fp32", "table_ptr": "*i32"}
    signature |= dict.fromkeys(("MAX_TILES", "N"), "i32")
    constants = {"K_BLOCKS": k // 128, "GROUP_M": grouped.GROUP_M, "STAGES": grouped.STAGES}
    constants |= {"CONSUMER_REGS": grouped.CONSUMER_REGS, "PRODUCER_REGS": grouped.PRODUCER_REGS}
    constants |= {"CONSUMERS": consumers}
    kernel = compile_sm90(grouped.fp8_grouped_ws, signature, constants, {"num_warps": 4, "enable_fp_fusion": True})
    ptx = kernel.asm["ptx"]
    products = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.e4m3\.e4m3", ptx)
    assert products == ["m64n128k32"] * 4 * consumers  # each consumer one 128-deep product per K block
    assert "setmaxnreg.dec" in ptx and "fma.rn.f32" in ptx  # a specialized copying warp; acc + part * factor
    assert "cp.async.bulk.tensor.2d.global.shared" in ptx  # whole 64-row blocks stored by TMA
    assert "st.global.v4" in ptx  # a block cut by its expert's end, in 16-byte runs under a mask
    assert kernel.metadata.shared <= MAX_SHARED
    report = ptxas_report(ptx)
    assert "Used" in report and not wgmma_serialized(report)
    assert set(re.findall(r"(\d+) bytes stack frame", report)) == {"0"}


def _expected_tiles(offsets: list[int], rows: int) -> list[tuple[int, int, int]]:
    """(expert, first row, the expert's end) of each tile of ``rows`` rows, expert by expert, written out by hand."""
    return [
        (e, first, offsets[e + 1]) for e in range(len(offsets) - 1) for first in range(offsets[e], offsets[e + 1], rows)
    ]


TILE_TABLE = """
import json, sys, torch
from deepinfer_cuda_sm100 import gemm_gluon_grouped as grouped
offsets = json.loads(sys.argv[1])
table, max_tiles = grouped.tile_table(torch.tensor(offsets, dtype=torch.int32), offsets[-1], 192)
count = int(table[3 * max_tiles])
print(json.dumps([max_tiles, count, table[: 3 * max_tiles].view(3, max_tiles)[:, :count].T.tolist()]))
"""


@pytest.mark.parametrize("counts", [[0, 200, 5], [192, 0, 0, 384, 1, 191, 193, 0], "random"])
def test_tile_table_lists_each_experts_row_tiles_in_order(counts):
    """``_tile_table_kernel`` (a Triton kernel: run by the interpreter): every expert's rows in tiles of 192 that
    never cross experts, empty experts skipped, the count at the end, for any spread of rows."""
    if counts == "random":  # DeepSeek-V3's 256 experts, an 8k chunk's rows spread unevenly
        counts = torch.randint(0, 512, (256,), generator=torch.Generator().manual_seed(0)).tolist()
        counts[7] = 0
    offsets = [0, *itertools.accumulate(counts)]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", TILE_TABLE, json.dumps(offsets)], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    max_tiles, count, tiles = json.loads(done.stdout.splitlines()[-1])
    want = _expected_tiles(offsets, 192)
    assert count == len(want) and max_tiles >= count
    assert [tuple(t) for t in tiles] == want


def test_grouped_kernel_takes_prefill_rows_of_fp8_experts_outside_batch_invariant_mode(monkeypatch):
    """As an SM90 GPU sees it: FP8 experts in the contiguous layout from 384 rows per expert on average, a bf16
    activation quantised first; not the masked layout, other weights or shapes, or batch-invariant mode (there the
    Triton kernel serves)."""
    from deepinfer_cuda_sm100 import gemm, gemm_gluon_grouped

    monkeypatch.setattr(gemm_gluon_grouped, "INTERPRET", False)
    monkeypatch.setattr(gemm_gluon_grouped, "on_device", lambda *tensors: True)
    monkeypatch.setattr(gemm_gluon_grouped, "hopper", lambda index: True)
    monkeypatch.setattr(gemm, "GROUPED_GLUON", True)
    experts, n, k, bf16 = 4, 256, 256, torch.bfloat16
    w = quantize_blocks(torch.randn(experts, n, k))
    offsets = torch.tensor([0, 900, 900, 1350, 1536], dtype=torch.int32)

    def supports(rows: int, **over):
        kw = dict(a=quantize_rows(torch.randn(rows, k), 128, "fp32"), w=w, expert_offsets=offsets, masked_m=None,
                  out_dtype=bf16) | over  # fmt: skip
        return gemm_gluon_grouped.supports(**kw)

    assert supports(1536) and supports(1536, a=torch.randn(1536, k, dtype=bf16))
    assert "fewer than 384 per expert" in supports(1535).reason
    assert "masked layout" in supports(1536, masked_m=torch.tensor([1, 2, 3, 4], dtype=torch.int32)).reason
    assert "FP8 QTensor" in supports(1536, w=w.dequantize().to(bf16)).reason
    assert "N or K" in supports(1536, w=quantize_blocks(torch.randn(experts, 200, k))).reason
    assert "out_dtype" in supports(1536, out_dtype=torch.float32).reason
    a = quantize_rows(torch.randn(1536, k), 128, "fp32")
    assert gemm.grouped_kernel(a, w, masked_m=None, invariant=False, expert_offsets=offsets) == "gluon-ws"
    assert gemm.grouped_kernel(a, w, masked_m=None, invariant=True, expert_offsets=offsets) == "triton"
    monkeypatch.setattr(gemm, "GROUPED_GLUON", False)
    assert gemm.grouped_kernel(a, w, masked_m=None, invariant=False, expert_offsets=offsets) == "triton"
    assert gemm.grouped_gluon_supports(a, w, expert_offsets=offsets, masked_m=None, out_dtype=bf16).reason == (
        "gemm.GROUPED_GLUON is off"
    )
