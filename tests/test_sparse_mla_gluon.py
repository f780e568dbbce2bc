"""``sparse_mla``'s Hopper kernel in Gluon (``backends/cuda_sm100/sparse_mla_gluon.py``), compiled for SM90 on the
CPU. Gluon has no interpreter, so its results can only be proven on the GPU (conformance); here CI checks that it
compiles with the installed Triton, fits an SM90 block's shared memory, and has the tensor-core work of the dense
split kernel it is built from: each block's scores computed once, by one warpgroup, P x V split between two
warpgroups, and a third that gathers the listed rows by pointer (no TMA copies: Hopper has no gather), bf16 rows by
cp.async straight into the stages (fp8_ds_mla rows as stored, then dequantised in place)."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
from gluon_helpers import MAX_SHARED, compile_sm90, ptxas_report, wgmma_serialized

from deepinfer_cuda_sm100 import sparse_attention, sparse_mla_gluon


def _compile(kv_format: str, direct: bool, by_bits: bool = sparse_mla_gluon.FP8_BY_BITS):
    fp8 = kv_format == "fp8_ds_mla"
    signature = {"q_ptr": "*bf16", "cache_ptr": "*u8" if fp8 else "*bf16", "idx_ptr": "*i32"}
    signature |= {"part_out_ptr": "*bf16" if direct else "*fp32", "part_lse_ptr": "*fp32", "scale": "fp32"}
    signature |= dict.fromkeys(("H", "topk", "stride_qt", "stride_qh", "stride_it", "n_splits"), "i32")
    constants = {"WIDTH": 656 if fp8 else 576, "SPLIT": 2048 if direct else 512, "FP8": fp8, "DIRECT": direct}
    constants |= {"CHUNK": sparse_mla_gluon.CHUNK, "FP8_BY_BITS": by_bits}
    constants |= {"RIGHT_REGS": sparse_mla_gluon.RIGHT_REGS, "FILL_REGS": sparse_mla_gluon.FILL_REGS}
    options = {"num_warps": 4, "enable_fp_fusion": True}
    return compile_sm90(sparse_mla_gluon._sparse_split_kernel, signature, constants, options)


@pytest.mark.parametrize("direct", [False, True], ids=["partials", "direct"])
@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
def test_sparse_kernel_compiles_for_sm90_with_the_split_kernels_products(kv_format, direct):
    kernel = _compile(kv_format, direct)
    ptx = kernel.asm["ptx"]
    shapes = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)
    # scores: [64 heads, 64 entries] over 576 = 36 steps of k16, at two call sites (the first block, then each next)
    assert shapes.count("m64n64k16") == 72
    # P x V: 64 entries = 4 steps of k16 on 256 latent columns, one call site in each of two warpgroups
    assert shapes.count("m64n256k16") == 8
    assert len(re.findall(r"setmaxnreg\.dec", ptx)) >= 2  # three warpgroups, registers moved to the first
    fp8 = kv_format == "fp8_ds_mla"
    assert ("cvt.rn.f16x2.e4m3x2" in ptx) == (fp8 and not sparse_mla_gluon.FP8_BY_BITS)
    assert "cp.async.bulk.tensor" not in ptx  # every row gathered by pointer
    copies = re.findall(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], (\w+)(, %r\d+)?;", ptx)
    # straight into the stages, both caches: 16-byte copies of a source size 0 where not listed
    assert copies and all(size == "0x10" and source for size, source in copies) and "cp.async.wait_group" in ptx
    assert kernel.metadata.shared <= MAX_SHARED
    assert not wgmma_serialized(ptxas_report(ptx))


def test_sparse_kernel_is_chosen_where_it_applies_while_switched_on(monkeypatch):
    """The kernel takes DeepSeek's shapes on a Hopper GPU while ``SPARSE_MLA_GLUON`` is on (the default), and
    declines with the reason otherwise."""
    import torch

    monkeypatch.setattr(sparse_mla_gluon, "on_hopper", lambda t: True)
    monkeypatch.setattr(sparse_attention, "placed", lambda **ts: True)
    q = torch.empty(4, 128, 576, dtype=torch.bfloat16)
    cache = torch.empty(8, 64, 656, dtype=torch.uint8)
    idx = torch.empty(4, 2048, dtype=torch.int32)
    kw = {"softmax_scale": 0.1, "kv_lora_rank": 512, "kv_format": "fp8_ds_mla"}
    assert sparse_attention.SPARSE_MLA_GLUON
    monkeypatch.setattr(sparse_attention, "SPARSE_MLA_GLUON", False)
    assert "SPARSE_MLA_GLUON" in str(sparse_attention.sparse_gluon_supports(q, cache, idx, **kw))
    monkeypatch.setattr(sparse_attention, "SPARSE_MLA_GLUON", True)
    assert sparse_attention.sparse_gluon_supports(q, cache, idx, **kw) is True
    assert "heads" in str(sparse_attention.sparse_gluon_supports(q[:, :32], cache, idx, **kw))
