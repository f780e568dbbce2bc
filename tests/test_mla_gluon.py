"""The Hopper split kernel of ``mla_decode`` in Gluon (``backends/cuda_sm100/mla_gluon.py``), compiled for SM90 on the
CPU. Gluon has no interpreter, so its results are proven on the GPU (conformance at full shapes, RESULTS.md); here CI
checks that it still compiles with the installed Triton and that its tensor-core work has the intended shape: each
block's scores computed once, by one warpgroup, and P x V split between the two warpgroups. The same for the three
kernels that replace it at a few rows in batch-invariant mode (scores first, then their softmax, then each span's
P x V)."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
from gluon_helpers import MAX_SHARED, assemble, compile_sm90, descriptor_type, ptxas_report, wgmma_serialized
from triton.experimental.gluon import language as gl

from deepinfer_cuda_sm100 import mla_gluon


def _descriptor(records: torch.Tensor, cols: int) -> str:
    return descriptor_type(records, [64, cols], gl.bfloat16)


def _records(kv_format: str) -> tuple[str, int, torch.Tensor]:
    """The cache pointer's type, a record's width and the records seen as bf16 (what the TMA descriptors cover)."""
    if kv_format == "fp8_ds_mla":
        return "*u8", 656, torch.empty(4096, 328, dtype=torch.bfloat16)
    return "*bf16", 576, torch.empty(4096, 576, dtype=torch.bfloat16)


def _wgmma_shapes(ptx: str) -> list[str]:
    return re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)


def _assert_fp8_route(ptx: str, fp8: bool, by_bits: bool) -> None:
    """The kernel dequantises e4m3 bytes (``fp8``) by the route ``FP8_BY_BITS`` selects, and only then."""
    assert ("cvt.rn.f16x2.e4m3x2" in ptx) == (fp8 and not by_bits)
    assert ("prmt.b32" in ptx and "0x9180" in ptx) == (fp8 and by_bits)


def _first_line(ptx: str, pattern: str) -> int:
    """The PTX line number of the first match of ``pattern`` (a large number if none)."""
    return next((i for i, line in enumerate(ptx.split("\n")) if re.search(pattern, line.strip())), 1 << 30)


def _fits_and_no_serialised_products(kernel, report: str | None = None) -> str:
    """Asserts that ``kernel`` fits an SM90 block's shared memory and that ptxas kept its products asynchronous
    (``report``: what ptxas said, when already assembled); returns what ptxas said."""
    assert kernel.metadata.shared <= MAX_SHARED
    report = report if report is not None else ptxas_report(kernel.asm["ptx"])
    assert "Used" in report and not wgmma_serialized(report)
    return report


def _compile(kv_format: str, direct: bool, halves: bool, by_bits: bool = mla_gluon.FP8_BY_BITS):
    """The split kernel as ``launch_split`` specialises it for DeepSeek-V3's cache in ``kv_format``, 64-token pages;
    ``direct``: one split, written to the bf16 output itself; ``halves``: one latent half of P x V per program;
    ``by_bits``: ``FP8_BY_BITS``."""
    cache_type, width, records = _records(kv_format)
    fp8 = kv_format == "fp8_ds_mla"
    signature = {"q_ptr": "*bf16", "cache_ptr": cache_type, "table_ptr": "*i32", "seq_lens_ptr": "*i32"}
    signature |= {"part_out_ptr": "*bf16" if direct else "*fp32", "part_lse_ptr": "*fp32", "scale": "fp32"}
    signature |= dict.fromkeys(
        ("S_q", "H", "stride_qb", "stride_qs", "stride_qh", "stride_table", "n_splits", "span"), "i32"
    )
    signature["rope_desc"] = _descriptor(records, 64)
    constants = {"PAGE": 64, "FP8": fp8, "CHUNK": mla_gluon.FP8_CHUNK, "DIRECT": direct}
    constants |= {"HALVES": halves, "WIDTH": width, "EARLY_RELEASE": mla_gluon.EARLY_RELEASE, "FP8_BY_BITS": by_bits}
    if fp8:  # the rope part by TMA from the records seen as bf16, the latent dequantised by the kernel
        constants |= {"lat_desc": None, "RIGHT_REGS": mla_gluon.FP8_RIGHT_REGS, "FILL_REGS": mla_gluon.FP8_FILL_REGS}
    else:
        signature["lat_desc"] = _descriptor(records, 256)
        constants |= {"RIGHT_REGS": mla_gluon.RIGHT_REGS, "FILL_REGS": 0}
    options = {"num_warps": 4, "enable_fp_fusion": True}
    return compile_sm90(mla_gluon._mla_split_kernel, signature, constants, options)


@pytest.mark.parametrize("halves", [False, True], ids=["both-halves", "one-half"])
@pytest.mark.parametrize("direct", [False, True], ids=["partials", "direct"])
@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
def test_split_kernel_compiles_for_sm90_with_scores_once_and_values_split(kv_format, direct, halves):
    kernel = _compile(kv_format, direct, halves)
    ptx = kernel.asm["ptx"]
    shapes = _wgmma_shapes(ptx)
    # scores: [64 heads, 64 tokens] over 576 = 36 steps of k16, at two call sites (first block, then each next one)
    assert shapes.count("m64n64k16") == 72
    # P x V: 64 tokens = 4 steps of k16 per call site, each on 256 latent columns: one site per warpgroup, or with
    # halves two in the second warpgroup (the left or the right half, chosen by the program), which LLVM merges
    # into one with its operand chosen per program
    assert shapes.count("m64n256k16") == (4 if halves else 8)
    assert len(re.findall(r"warp_group_dot .* -> tensor<64x256xf32", kernel.asm["ttgir"])) == 2
    # the warpgroups are specialised: registers move to the first; with fp8_ds_mla a third one dequantises
    assert len(re.findall(r"setmaxnreg\.dec", ptx)) >= (2 if kv_format == "fp8_ds_mla" else 1)
    _assert_fp8_route(ptx, kv_format == "fp8_ds_mla", mla_gluon.FP8_BY_BITS)
    _fits_and_no_serialised_products(kernel)


def _compile_scores(kv_format: str, tokens: int, by_bits: bool = mla_gluon.FP8_BY_BITS):
    """The scores kernel as ``launch_scores_first`` specialises it, ``tokens`` a program."""
    cache_type, width, records = _records(kv_format)
    fp8 = kv_format == "fp8_ds_mla"
    signature = {"q_ptr": "*bf16", "cache_ptr": cache_type, "table_ptr": "*i32", "seq_lens_ptr": "*i32"}
    signature |= {"rope_desc": _descriptor(records, 64), "scores_ptr": "*fp32", "maxima_ptr": "*fp32", "scale": "fp32"}
    signature |= dict.fromkeys(("S_q", "H", "stride_qb", "stride_qs", "stride_qh", "stride_table", "reach"), "i32")
    constants = {"PAGE": 64, "WIDTH": width, "TOKENS": tokens, "FP8": fp8}
    constants |= {"CHUNK": mla_gluon.SCORES_FP8_CHUNK, "PDL": True, "FP8_BY_BITS": by_bits}
    if fp8:  # the dequantised latent is also copied out, for the values kernel
        constants["lat_desc"] = None
        signature["latent_desc"] = _descriptor(torch.empty(4096, 512, dtype=torch.bfloat16), 256)
    else:
        signature["lat_desc"] = _descriptor(records, 256)
        constants["latent_desc"] = None
    options = {"num_warps": 4, "enable_fp_fusion": True}
    return compile_sm90(mla_gluon._mla_scores_kernel, signature, constants, options)


@pytest.mark.parametrize("tokens", [64, mla_gluon.SCORES_TOKENS])
@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
def test_scores_kernel_compiles_for_sm90_with_the_split_kernels_products(kv_format, tokens):
    fp8 = kv_format == "fp8_ds_mla"
    kernel = _compile_scores(kv_format, tokens)
    ptx = kernel.asm["ptx"]
    # the split kernel's scores: [64 heads, 64 tokens] over 576 = 36 steps of k16, at one call site (fp8_ds_mla: the
    # next block is dequantised while the product runs) or two (bf16: the first block, then each next one, issued
    # before the block before is stored)
    assert _wgmma_shapes(ptx) == ["m64n64k16"] * (36 if fp8 else 72)
    _assert_fp8_route(ptx, fp8, mla_gluon.FP8_BY_BITS)
    assert ("cp.async.bulk.tensor.2d.global.shared" in ptx) == fp8
    report = _fits_and_no_serialised_products(kernel)
    assert re.search(r"\b0 bytes spill stores", report), report


def test_scores_chunk_is_halved_only_while_the_grid_fits_the_sms():
    # 132 SMs, two head blocks: one row of 4096 tokens gets 128 programs of 64 tokens, two rows 128 of 128 tokens;
    # eight rows fill the SMs at 512 tokens (128 programs; 256 tokens would make 256)
    assert mla_gluon.scores_tokens(1, 2, 4096, 132) == 64
    assert mla_gluon.scores_tokens(2, 2, 4096, 132) == 128
    assert mla_gluon.scores_tokens(8, 2, 4096, 132) == mla_gluon.SCORES_TOKENS == 512
    assert mla_gluon.scores_tokens(1, 2, 16384, 132) == 256


def test_probs_kernel_compiles_for_sm90_without_products():
    signature = {"scores_ptr": "*fp32", "maxima_ptr": "*fp32", "probs_ptr": "*bf16", "factors_ptr": "*fp32"}
    signature |= {"seq_lens_ptr": "*i32", "scale": "fp32", "S_q": "i32"}
    options = {"num_warps": 4, "enable_fp_fusion": True}
    kernel = compile_sm90(mla_gluon._mla_probs_kernel, signature, {"SPLIT": 2048, "PDL": True}, options)
    assert _wgmma_shapes(kernel.asm["ptx"]) == []
    # launched early, it waits for the scores kernel before it touches global memory
    wait = _first_line(kernel.asm["ptx"], "griddepcontrol.wait")
    assert wait < _first_line(kernel.asm["ptx"], r"^(@!?%p\d+ )?(ld\.global|st\.global|cp\.async)")
    assert "ex2.approx" in kernel.asm["ptx"]  # P as the split kernel computes it
    assert re.search(r"\b0 bytes spill stores", ptxas_report(kernel.asm["ptx"]))


@pytest.mark.parametrize("parts", [4, 8])
@pytest.mark.parametrize("direct", [False, True], ids=["partials", "direct"])
@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
def test_values_kernel_compiles_for_sm90_with_one_latent_part_per_program(kv_format, direct, parts):
    cache_type, width, records = _records(kv_format)
    fp8 = kv_format == "fp8_ds_mla"
    part = 512 // parts
    latent = torch.empty(4096, 512, dtype=torch.bfloat16) if fp8 else records  # fp8_ds_mla: the scores kernel's copy
    signature = {"p_desc": descriptor_type(torch.empty(4096, 64, dtype=torch.bfloat16), [64, 64], gl.bfloat16)}
    signature["f_desc"] = descriptor_type(torch.empty(4096, 192, dtype=torch.float32), [1, 128], gl.float32)
    signature["v_desc"] = descriptor_type(latent, [64, part], gl.bfloat16)
    signature |= {"factors_ptr": "*fp32", "cache_ptr": cache_type, "table_ptr": "*i32", "seq_lens_ptr": "*i32"}
    signature |= {"part_out_ptr": "*bf16" if direct else "*fp32", "part_lse_ptr": "*fp32"}
    signature |= dict.fromkeys(("S_q", "H", "stride_table", "n_splits", "blocks", "reach"), "i32")
    constants = {"PAGE": 64, "WIDTH": width, "SPLIT": 2048, "PARTS": parts, "STAGES": mla_gluon.VALUES_STAGES}
    constants |= {"DIRECT": direct, "FP8": fp8, "FILL_REGS": mla_gluon.VALUES_FILL_REGS, "PDL": True}
    options = {"num_warps": 4, "enable_fp_fusion": True}
    kernel = compile_sm90(mla_gluon._mla_values_kernel, signature, constants, options)
    ptx = kernel.asm["ptx"]
    # no scores and no softmax here; P x V: 64 tokens = 4 steps of k16 on the program's latent columns
    assert _wgmma_shapes(ptx) == [f"m64n{part}k16"] * 4
    assert "ex2.approx" not in ptx
    # launched early, it reads the sequence lengths and the block table (written before the scores kernel began), then
    # waits for the probs kernel before its first copy of P, the factors or the latent (fp8_ds_mla: the scores
    # kernel's copy)
    wait = _first_line(ptx, "griddepcontrol.wait")
    assert wait < _first_line(ptx, r"cp\.async\.bulk\.tensor")
    # the next block's copies are waited for while a block's product runs
    lines = ptx.split("\n")
    issued = _first_line(ptx, r"wgmma\.commit_group")
    done = issued + _first_line("\n".join(lines[issued:]), r"wgmma\.wait_group")
    assert any("mbarrier.try_wait" in line for line in lines[issued:done])
    assert len(re.findall(r"setmaxnreg\.dec", ptx)) >= 1  # the filling warpgroup is specialised
    _fits_and_no_serialised_products(kernel)


def test_values_parts_halve_when_eight_would_not_fit_the_sms_at_once():
    assert mla_gluon.values_parts(16, 132) == 8  # one row, two head blocks, eight spans
    assert mla_gluon.values_parts(32, 132) == 4


def _run_e4m3_bits_asm(words: list[int]) -> list[tuple[int, int]]:
    """``mla_gluon.E4M3_BITS_ASM`` run on the CPU for each 32-bit input, by the PTX ISA's definitions of the three
    instructions it uses (``prmt`` in its default mode, ``shl``, ``and``); returns its two outputs."""
    lines = [line.strip().rstrip(";") for line in mla_gluon.E4M3_BITS_ASM.value.splitlines()]
    body = [line.replace(",", " ").split() for line in lines if line and line[0] not in "{}."]
    assert {op for op, *_ in body} == {"prmt.b32", "shl.b32", "and.b32"}, body
    results = []
    for word in words:
        regs = {"$2": word}
        value = lambda x, regs=regs: regs[x] if x in regs else int(x, 0)  # a register, or a literal
        for op, dst, *src in body:
            if op == "prmt.b32":
                a, b, selector = (value(x) for x in src)
                source = (b << 32 | a).to_bytes(8, "little")
                out = 0
                for i in range(4):
                    nibble = selector >> 4 * i & 0xF
                    byte = source[nibble & 7]
                    if nibble & 8:  # replicate the selected byte's sign bit
                        byte = 0xFF if byte & 0x80 else 0
                    out |= byte << 8 * i
                regs[dst] = out
            elif op == "shl.b32":
                regs[dst] = value(src[0]) << value(src[1]) & 0xFFFFFFFF
            else:
                regs[dst] = value(src[0]) & value(src[1])
        results.append((regs["$0"], regs["$1"]))
    return results


def test_e4m3_bits_asm_gives_each_byte_as_bf16_times_two_to_the_minus_120():
    """The integer route of ``FP8_BY_BITS``, checked on the CPU: every e4m3 byte but NaN at each of the four positions
    of a word becomes the bf16 of its value times 2^-120 (subnormals and -0 included), and the two bf16 multiplies of
    ``_e4m3_times_scale`` then give exactly the fp32 route's bf16 over the scales an fp8_ds_mla cache can hold,
    2^-22 to 2^120. The kernel's register packing (byte i of the word is element i; elements 0-1 in the first output,
    low half first) is Triton's and is checked by the GPU's conformance."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    gen = torch.Generator().manual_seed(0)
    others = torch.randint(0, 256, (4, codes.numel()), generator=gen, dtype=torch.uint8)
    got = torch.empty(4, codes.numel(), dtype=torch.int32)
    for pos in range(4):
        lanes = others.clone()
        lanes[pos] = codes
        words = [int.from_bytes(bytes(lanes[:, i].tolist()), "little") for i in range(codes.numel())]
        outs = _run_e4m3_bits_asm(words)
        got[pos] = torch.tensor([(outs[i][pos // 2] >> 16 * (pos % 2)) & 0xFFFF for i in range(len(words))])
    bits = got.to(torch.int16).view(torch.bfloat16)
    want = codes.view(torch.float8_e4m3fn).float()
    for pos in range(4):
        assert torch.equal(bits[pos].float() * 2.0**120, want), pos
        assert torch.equal(torch.signbit(bits[pos].float()), torch.signbit(want)), pos  # -0 stays -0
    # the kernel's factors: 2^120 undoes the bits' bias (bf16's 127 less e4m3's 7); the scale splits at 2^7
    split, inv, unbias = (c.value for c in (mla_gluon.SCALE_SPLIT, mla_gluon.INV_SCALE_SPLIT, mla_gluon.TWO_POW_120))
    assert unbias == 2.0 ** (127 - 7) and split * inv == 1.0 and split * unbias <= 2.0**127
    for log_scale in range(-22, 121):
        scale = torch.tensor(2.0**log_scale)
        a = (torch.minimum(scale, torch.tensor(split)) * unbias).to(torch.bfloat16)
        b = torch.maximum(scale * inv, torch.tensor(1.0)).to(torch.bfloat16)
        assert torch.equal(bits[0] * a * b, (want * scale).to(torch.bfloat16)), log_scale


def test_fp8_kernels_by_bits_compile_without_the_fp32_route():
    """With ``FP8_BY_BITS`` the fp8_ds_mla split, scores and sparse kernels still compile for SM90 with their products
    asynchronous and no more spills, and their dequantisation has left the conversion instructions: no e4m3 unpack,
    no f16 -> f32 (``HADD2.F32``), and a fraction of the ``F2FP`` packs (what is left converts scales and P)."""
    from test_sparse_mla_gluon import _compile as compile_sparse

    def spills(report: str) -> int:
        return int(re.search(r"(\d+) bytes spill stores", report).group(1))

    for build in (
        lambda by_bits: _compile("fp8_ds_mla", False, False, by_bits),
        lambda by_bits: _compile_scores("fp8_ds_mla", 64, by_bits),
        lambda by_bits: compile_sparse("fp8_ds_mla", False, by_bits),
    ):
        before, after = build(False), build(True)
        (report_before, code_before), (report_after, code_after) = (assemble(k.asm["ptx"]) for k in (before, after))
        assert "cvt.rn.f16x2.e4m3x2" in before.asm["ptx"] and "cvt.rn.f16x2.e4m3x2" not in after.asm["ptx"]
        assert "prmt.b32" in after.asm["ptx"] and "mul.bf16" in after.asm["ptx"]
        assert code_before.count("HADD2.F32") >= 256 and code_after.count("HADD2.F32") == 0
        assert code_after.count("F2FP") * 4 < code_before.count("F2FP")
        assert code_after.count("HMUL2.BF16") >= 256
        assert spills(report_after) <= spills(report_before)
        _fits_and_no_serialised_products(after, report_after)
