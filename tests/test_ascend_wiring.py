"""The ascend backend's wiring, checked through the torch_npu TEST DOUBLE (tests/ascend/double): nothing here runs
on an NPU. The double rejects what torch_npu's docs reject; these tests check that it does, and that the backend
hands each fused operator the documented layouts (BSND/TND, block tables, group lists, scale shapes, the
656-byte record order) and gets the contract's results back."""

from __future__ import annotations

import math
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

import deepinfer
from deepinfer import ops, registry
from deepinfer.dispatch import last_resolution
from deepinfer.index_cache import allocate_index_cache, pack_fp8_ds_index
from deepinfer.kv_cache import allocate_kv_cache, pack_fp8_ds_mla
from deepinfer.qtensor import quantize_blocks, quantize_rows

DOUBLE = Path(__file__).parent / "ascend" / "double"
ROOT = Path(__file__).parents[1]


def _forget_torch_npu() -> None:
    for name in [m for m in sys.modules if m == "torch_npu" or m.startswith("torch_npu.")]:
        del sys.modules[name]


@pytest.fixture
def npu(monkeypatch):
    """The torch_npu test double as ``torch_npu`` and the ascend backend selected (emulating an Ascend 950)."""
    monkeypatch.syspath_prepend(str(DOUBLE))
    monkeypatch.delenv("DEEPINFER_ASCEND_FP8_GEMM", raising=False)
    monkeypatch.delenv("DEEPINFER_ASCEND_SOC", raising=False)
    _forget_torch_npu()
    import torch_npu

    assert torch_npu.TEST_DOUBLE
    registry.reload()
    torch_npu.CALLS.clear()
    with deepinfer.use("ascend"):
        yield torch_npu
    _forget_torch_npu()


def calls(npu, op: str) -> list[dict]:
    return [info for name, info in npu.CALLS if name == op]


def served_by(op: str) -> str:
    impl, fallback = last_resolution(op)
    assert not fallback
    return impl.provider


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def reference(fn, *args, **kwargs):
    with deepinfer.use("reference"):
        return fn(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# probe and registration


def test_probe_says_emulated_and_the_backend_lives_on_the_cpu(npu):
    ok, reason = registry.get().probe("ascend")
    spec = registry.get().lookup("ascend")
    assert ok and "torch_npu test double (emulated, not hardware)" in reason
    assert spec.device_type == "cpu"  # never auto-detected as hardware
    assert {"fp8_e4m3", "kv_fp8_ds_mla", "mxfp8"} <= spec.capabilities
    assert deepinfer.current_backend().name == "ascend"


def test_an_a2_gets_bf16_capabilities_and_the_fp8_paths_step_aside(npu, monkeypatch):
    monkeypatch.setenv("DEEPINFER_TORCH_NPU_DOUBLE_SOC", "Ascend910B3")
    monkeypatch.setattr("deepinfer_ascend.probe._soc_cache", weakref.WeakKeyDictionary())
    registry.reload()
    with deepinfer.use("ascend") as spec:
        assert "fp8_e4m3" not in spec.capabilities
        a, w = torch.randn(4, 256, dtype=torch.bfloat16), quantize_blocks(torch.randn(64, 256))
        out = ops.gemm(a, w)
        assert served_by("gemm") == "torch-composite"
    assert not calls(npu, "npu_quant_matmul")
    assert rel_err(out, reference(ops.gemm, a, w)) < 1e-2


def _run_info(tmp_path: Path, module_source: str) -> subprocess.CompletedProcess:
    fake = tmp_path / "torch_npu"
    fake.mkdir()
    (fake / "__init__.py").write_text(module_source)
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin", "DEEPINFER_PLUGINS": "ascend"}
    return subprocess.run(
        [sys.executable, "-m", "deepinfer.cli", "info"], capture_output=True, text=True, env=env, timeout=60
    )


def test_missing_cann_is_a_reason_not_a_traceback(tmp_path):
    source = "raise ImportError('libhccl.so: cannot open shared object file: No such file or directory')\n"
    run = _run_info(tmp_path, source)
    text = run.stdout + run.stderr
    assert run.returncode == 0
    assert "Traceback" not in text
    assert "torch_npu is not importable" in text and "libhccl.so" in text


def test_no_device_is_a_reason(tmp_path):
    source = "class npu:\n    is_available = staticmethod(lambda: False)\n    device_count = staticmethod(lambda: 0)\n"
    run = _run_info(tmp_path, source)
    assert run.returncode == 0 and "finds no NPU" in run.stdout


def test_not_installed_is_a_reason(npu, monkeypatch):
    _forget_torch_npu()
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    from deepinfer_ascend import probe

    assert probe.probe() == (False, "torch_npu is not installed (pip install 'deepinfer[ascend]')")


# ---------------------------------------------------------------------------------------------------------------
# the double rejects what the docs reject


def test_double_rejects_documented_misuse(npu):
    reject = npu.DocumentedRejection
    q, kv = torch.randn(2, 1, 4, 512, dtype=torch.bfloat16), torch.randn(8, 16, 512, dtype=torch.bfloat16)
    qr, kr = torch.randn(2, 1, 4, 64, dtype=torch.bfloat16), torch.randn(8, 16, 64, dtype=torch.bfloat16)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    mla = {"query_rope": qr, "key_rope": kr, "actual_seq_kvlen": [5, 9], "block_table": table}
    mla |= {"num_query_heads": 4, "num_key_value_heads": 1, "input_layout": "BSND", "block_size": 16}
    fia = npu.npu_fused_infer_attention_score_v2
    fia(q, kv, kv, **mla)  # the documented form is accepted
    with pytest.raises(reject, match="contiguous"):
        fia(q, kv.transpose(0, 1).contiguous().transpose(0, 1), kv, **mla)
    with pytest.raises(reject, match="block_size"):
        fia(q, kv.view(16, 8, 512), kv.view(16, 8, 512), **(mla | {"block_size": 8, "key_rope": kr.view(16, 8, 64)}))
    with pytest.raises(reject, match="N of query"):
        fia(q[:, :, :3].contiguous(), kv, kv, **(mla | {"query_rope": qr[:, :, :3].contiguous(), "num_query_heads": 3}))
    with pytest.raises(reject, match="2048"):
        fia(q, kv, kv, **(mla | {"sparse_mode": 3}))
    t = torch.randn(6, 2, 48, dtype=torch.bfloat16)
    with pytest.raises(reject, match="Q_D, V_D"):
        fia(t, t, t, actual_seq_qlen=[6], actual_seq_kvlen=[6], num_query_heads=2, input_layout="TND")

    x1, w = torch.randn(4, 256).to(torch.float8_e4m3fn), torch.randn(256, 256).to(torch.float8_e4m3fn)
    s1, ws = torch.ones(4, 2), torch.ones(2, 2)
    qmm = npu.npu_quant_matmul
    qmm(x1, w.t(), ws.t(), pertoken_scale=s1, output_dtype=torch.bfloat16, group_sizes=[1, 128, 128])
    with pytest.raises(reject, match="transposed alike"):
        qmm(x1, w.t(), ws.t().contiguous(), pertoken_scale=s1, output_dtype=torch.bfloat16, group_sizes=[1, 128, 128])
    with pytest.raises(reject, match=r"\(m, ceil\(k/128\)\)"):
        qmm(x1, w.t(), ws.t(), pertoken_scale=s1[:, :1], output_dtype=torch.bfloat16, group_sizes=[1, 128, 128])

    a, gw = torch.randn(5, 128, dtype=torch.bfloat16), torch.randn(2, 128, 32, dtype=torch.bfloat16)
    gmm = npu.npu_grouped_matmul
    with pytest.raises(reject, match="int64"):
        gmm(
            [a], [gw], group_list=torch.tensor([2, 3], dtype=torch.int32), group_list_type=1, group_type=0, split_item=3
        )
    with pytest.raises(reject, match="add up"):
        gmm([a], [gw], group_list=torch.tensor([2, 2]), group_list_type=1, group_type=0, split_item=3)
    with pytest.raises(reject, match="not supported on Ascend 950"):
        gmm([a], [gw], group_list=torch.tensor([[0, 2], [1, 3]]), group_list_type=2, group_type=0, split_item=3)
    with pytest.raises(reject, match="length 1"):
        gmm([a], [gw[:1]], group_list=torch.tensor([5]), group_list_type=1, group_type=0, split_item=3)
    gmm([a], [gw[:1]], group_list=torch.tensor([5]), group_list_type=0, group_type=0, split_item=3)

    with pytest.raises(reject, match="col_block_size"):
        npu.npu_dynamic_block_quant(a, dst_type=torch.float8_e4m3fn, col_block_size=64)
    with pytest.raises(reject, match="dtype"):
        npu.npu_dynamic_block_quant(a.float(), dst_type=torch.float8_e4m3fn)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0]], dtype=torch.int32)
    with pytest.raises(reject, match="expert_capacity"):
        npu.npu_moe_init_routing_v2(
            a[:3], ids, expert_num=3, expert_capacity=3, drop_pad_mode=1, expert_tokens_num_type=1
        )
    rows, w6 = torch.randn(6, 8), torch.ones(3, 2)
    with pytest.raises(reject, match=r"\[0, 5\]"):
        npu.npu_moe_finalize_routing(rows, None, None, None, w6, torch.tensor([0, 1, 2, 3, 4, -1]).int(), None, 2)
    with pytest.raises(reject, match="dtype of expanded_permuted_rows"):
        npu.npu_moe_finalize_routing(rows.bfloat16(), None, None, None, w6, torch.arange(6).int(), None, 2)
    cache = torch.zeros(4, 8, dtype=torch.uint8)
    with pytest.raises(reject, match="input dtype"):
        npu.npu_scatter_nd_update_(cache, torch.tensor([[1]]), torch.ones(1, 8, dtype=torch.uint8))
    with pytest.raises(reject, match="duplicate"):
        npu.npu_scatter_nd_update_(cache.view(torch.int8), torch.tensor([[1], [1]]), torch.ones(2, 8, dtype=torch.int8))
    x = torch.randn(3, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(reject, match="T1D"):
        npu.npu_rotary_mul(x, torch.ones_like(x), torch.ones_like(x), rotary_mode="interleave")
    with pytest.raises(reject, match="greater than 2"):
        npu.npu_moe_gating_top_k(torch.randn(3, 8), 2, k_group=2, group_count=4, group_select_mode=1, norm_type=1)


def test_double_refuses_fp8_when_emulating_an_a2(npu, monkeypatch):
    monkeypatch.setenv("DEEPINFER_TORCH_NPU_DOUBLE_SOC", "Ascend910B3")
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    with pytest.raises(npu.DocumentedRejection, match="950"):
        npu.npu_dynamic_block_quant(x, dst_type=torch.float8_e4m3fn)


# ---------------------------------------------------------------------------------------------------------------
# attention


def _paged(batch_lens: list[int], block_size: int, kv_format: str, kv_lora_rank: int = 512, rope: int = 64):
    pages = [math.ceil(n / block_size) for n in batch_lens]
    cache = allocate_kv_cache(sum(pages) + 2, block_size, kv_lora_rank=kv_lora_rank, rope_dim=rope, kv_format=kv_format)
    cache.view(torch.uint8).fill_(0xFF)  # NaN wherever nothing was written
    order = torch.randperm(cache.shape[0]).tolist()
    table = torch.zeros(len(batch_lens), max(pages), dtype=torch.int32)
    flat = cache.view(-1, cache.shape[-1])
    for b, n in enumerate(batch_lens):
        ids, order = order[: pages[b]], order[pages[b] :]
        table[b, : pages[b]] = torch.tensor(ids, dtype=torch.int32)
        pos = torch.arange(n)
        slots = table[b, pos // block_size].long() * block_size + pos % block_size
        latent = torch.randn(n, kv_lora_rank + rope, dtype=torch.bfloat16)
        flat[slots] = latent if kv_format == "bf16" else pack_fp8_ds_mla(latent, kv_lora_rank)
    return cache, table


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("s_q", [1, 3])
def test_mla_decode_passes_bsnd_paged_mla_layout(npu, kv_format, s_q):
    lens = [70, 0, 33]  # a padding row that sees nothing
    cache, table = _paged(lens, 16, kv_format)
    table[1:, 3:] = -1  # entries past a sequence's pages are not validated: -1 padding must not be read
    q = torch.randn(3, s_q, 8, 576, dtype=torch.bfloat16)
    seq = torch.tensor(lens, dtype=torch.int32)
    out, lse = ops.mla_decode(q, cache, table, seq, softmax_scale=0.07)
    assert served_by("mla_decode") == "torch_npu.npu_fused_infer_attention_score_v2"
    (call,) = calls(npu, "npu_fused_infer_attention_score_v2")
    assert call["layout"] == "BSND" and call["mla"] and call["block_size"] == 16
    assert call["sparse_mode"] == (3 if s_q > 1 else 0)
    assert call["key_shape"][1:] == (16, 512)  # (blocknum, blocksize, KV_N * D) with KV_N 1
    ref_out, ref_lse = reference(ops.mla_decode, q, cache, table, seq, softmax_scale=0.07)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and bool(torch.isneginf(lse[1]).all())
    assert rel_err(out, ref_out) < 1e-2
    assert torch.allclose(lse[[0, 2]], ref_lse[[0, 2]], atol=1e-3)


def test_mla_decode_outside_the_documented_envelope_runs_the_composite(npu):
    cache, table = _paged([20, 9], 16, "bf16", kv_lora_rank=128, rope=64)
    q = torch.randn(2, 1, 4, 192, dtype=torch.bfloat16)
    seq = torch.tensor([20, 9], dtype=torch.int32)
    out, _ = ops.mla_decode(q, cache, table, seq, softmax_scale=0.1, kv_lora_rank=128)
    assert served_by("mla_decode") == "torch-composite"
    assert not calls(npu, "npu_fused_infer_attention_score_v2")
    assert rel_err(out, reference(ops.mla_decode, q, cache, table, seq, softmax_scale=0.1, kv_lora_rank=128)[0]) < 1e-2


def test_attention_varlen_passes_tnd_with_cumulative_lengths(npu):
    lens_q, lens_k = [5, 0, 7], [9, 4, 3]  # a cached prefix, an empty query, queries that see no key
    q = torch.randn(sum(lens_q), 4, 192, dtype=torch.bfloat16)
    k = torch.randn(sum(lens_k), 4, 192, dtype=torch.bfloat16)
    v = torch.randn(sum(lens_k), 4, 128, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 13, 16], dtype=torch.int32)
    out = ops.attention_varlen(q, k, v, cu_q, cu_k, softmax_scale=0.08, causal=True)
    (call,) = calls(npu, "npu_fused_infer_attention_score_v2")
    assert call["layout"] == "TND" and call["sparse_mode"] == 3 and call["dims"] == (192, 128)
    ref = reference(ops.attention_varlen, q, k, v, cu_q, cu_k, softmax_scale=0.08, causal=True)
    assert not out.isnan().any() and rel_err(out, ref) < 1e-2


def test_fp8_ds_mla_record_order_is_converted_for_torch_npu():
    from deepinfer_ascend.attention import from_ascend_records, to_ascend_records

    record = torch.cat([torch.full((512,), 1), torch.full((16,), 2), torch.full((128,), 3)]).to(torch.uint8)
    ascend = to_ascend_records(record[None])[0]
    assert ascend[:512].eq(1).all() and ascend[512:640].eq(3).all() and ascend[640:].eq(2).all()  # nope|rope|scale
    assert torch.equal(from_ascend_records(ascend[None])[0], record)


@pytest.mark.parametrize("heads", [4, 48])  # the operator's current docs list Q_N 48 besides powers of two
def test_quantized_sparse_attention_reads_the_converted_records(npu, monkeypatch, heads):
    """The npu_kv_quant_sparse_flash_attention wiring: all positions selected equals dense mla_decode."""
    from deepinfer_ascend import attention

    lens = [40, 17]
    cache, table = _paged(lens, 16, "fp8_ds_mla")
    q = torch.randn(2, 2, heads, 576, dtype=torch.bfloat16)
    seq = torch.tensor(lens, dtype=torch.int32)
    positions = torch.arange(48).expand(2, 2, 48)
    indices = torch.where(positions < seq[:, None, None], positions, -1).flip(-1)  # -1 first: the backend reorders
    out = attention.sparse_mla_decode_quantized(q, cache, table, seq, indices, softmax_scale=0.05)
    (call,) = calls(npu, "npu_kv_quant_sparse_flash_attention")
    assert call["key_dtype"] == torch.float8_e4m3fn and call["key_shape"][2:] == (1, 656)
    ref, _ = reference(ops.mla_decode, q, cache, table, seq, softmax_scale=0.05)
    assert rel_err(out, ref) < 1e-2
    # Handing torch_npu the core's byte order instead reads scales as rope and rope as scales: caught.
    monkeypatch.setattr(attention, "to_ascend_records", lambda records, kv_lora_rank=512: records)
    wrong = attention.sparse_mla_decode_quantized(q, cache, table, seq, indices, softmax_scale=0.05)
    assert not (rel_err(wrong, ref) < 1e-2)


def test_write_kv_cache_scatters_int8_records_and_skips_minus_one(npu):
    cache = allocate_kv_cache(3, 16, kv_lora_rank=512, rope_dim=64, kv_format="fp8_ds_mla").zero_()
    latent = torch.randn(4, 576, dtype=torch.bfloat16)
    slots = torch.tensor([3, -1, 40, 17])
    ops.write_kv_cache(latent, cache, slots)
    (call,) = calls(npu, "npu_scatter_nd_update_")
    assert call["dtype"] == torch.int8 and call["n"] == 3 and call["depth"] == 1
    expected = pack_fp8_ds_mla(latent[[0, 2, 3]], 512)
    assert torch.equal(cache.view(-1, 656)[[3, 40, 17]], expected)
    assert int(cache.view(-1, 656).any(dim=1).sum()) == 3


# ---------------------------------------------------------------------------------------------------------------
# GEMM


def test_fp8_gemm_passes_deepseek_scales_as_transposed_views_and_adds_bias_after(npu):
    a, w = torch.randn(5, 256, dtype=torch.bfloat16), quantize_blocks(torch.randn(200, 256) / 16)
    bias = torch.randn(200, dtype=torch.bfloat16)
    out = ops.gemm(a, w, bias=bias)
    assert served_by("gemm") == "torch_npu.npu_quant_matmul"
    (mm,) = calls(npu, "npu_quant_matmul")
    assert mm["mode"] == "G-B" and mm["x2_transposed"] and mm["shape"] == (5, 200, 256)
    assert calls(npu, "npu_dynamic_block_quant")[0]["dst_type"] == torch.float8_e4m3fn
    assert rel_err(out, reference(ops.gemm, a, w, bias=bias)) < 1e-2


def test_quantize_fp8_floors_the_scale_of_an_all_zero_block(npu):
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    x[1, 128:] = 0  # DeepSeek-V3 recipe: max(amax, 1e-4) / 448, passed to the operator as min_scale
    q = ops.quantize_fp8(x)
    assert served_by("quantize_fp8") == "torch_npu.npu_dynamic_block_quant"
    assert torch.allclose(q.scale[1, 1], torch.tensor(1e-4 / 448)) and not q.dequantize().isnan().any()
    assert torch.equal(q.data.view(torch.uint8), reference(ops.quantize_fp8, x).data.view(torch.uint8))


def test_grouped_gemm_uses_counts_and_a_transposed_weight(npu):
    w = quantize_blocks(torch.randn(3, 256, 128) / 12)
    offsets = torch.tensor([0, 4, 4, 9], dtype=torch.int32)
    a = quantize_rows(torch.randn(9, 128), 128, "fp32")
    out = ops.grouped_gemm(a, w, expert_offsets=offsets)
    (call,) = calls(npu, "npu_grouped_matmul")
    assert call["group_list_type"] == 1 and call["weight_transposed"] and call["dtype"] == torch.float8_e4m3fn
    assert rel_err(out, reference(ops.grouped_gemm, a, w, expert_offsets=offsets)) < 1e-2


@pytest.mark.parametrize("masked", [False, True])
def test_grouped_gemm_of_one_expert_passes_a_cumulative_group_list(npu, masked):
    # npu_grouped_matmul refuses a count list (group_list_type 1) of length 1; one group's cumsum is its count
    w = torch.randn(1, 64, 128, dtype=torch.bfloat16)
    if masked:
        a, kw = torch.randn(1, 5, 128, dtype=torch.bfloat16), {"masked_m": torch.tensor([3], dtype=torch.int32)}
    else:
        a, kw = torch.randn(5, 128, dtype=torch.bfloat16), {"expert_offsets": torch.tensor([0, 5], dtype=torch.int32)}
    out = ops.grouped_gemm(a, w, **kw)
    assert served_by("grouped_gemm") == "torch_npu.npu_grouped_matmul"
    (call,) = calls(npu, "npu_grouped_matmul")
    assert call["group_list_type"] == 0
    ref = reference(ops.grouped_gemm, a, w, **kw)
    assert rel_err(out[..., :3, :] if masked else out, ref[..., :3, :] if masked else ref) < 1e-2


def test_masked_grouped_gemm_needs_no_host_counts(npu):
    w = torch.randn(3, 64, 128, dtype=torch.bfloat16)
    a = torch.randn(3, 5, 128, dtype=torch.bfloat16)
    masked = torch.tensor([5, 0, 2], dtype=torch.int32)
    out = ops.grouped_gemm(a, w, masked_m=masked)
    ref = reference(ops.grouped_gemm, a, w, masked_m=masked)
    assert rel_err(out[0], ref[0]) < 1e-2 and rel_err(out[2, :2], ref[2, :2]) < 1e-2


def test_mx_recipe_converts_weights_once_and_declares_its_tolerance(npu, monkeypatch):
    monkeypatch.setenv("DEEPINFER_ASCEND_FP8_GEMM", "mx")
    registry.reload()
    with deepinfer.use("ascend") as spec:
        why = spec.tolerances["gemm/fp8"][1]
        assert "MXFP8" in why
        w = quantize_blocks(torch.randn(96, 256) / 16)
        prepared = deepinfer.prepare_weight("model.layers.0.mlp.down_proj.weight", w)
        assert prepared.prepared is not None and torch.equal(prepared.data.view(torch.uint8), w.data.view(torch.uint8))
        assert prepared.prepared.x2_scale.shape == (4, 96, 2)  # (ceil(k/64), n, 2) E8M0
        a = torch.randn(3, 256, dtype=torch.bfloat16)
        npu.CALLS.clear()
        out = ops.gemm(a, prepared)
    assert calls(npu, "npu_quant_matmul")[0]["mode"] == "mx"
    assert len(calls(npu, "npu_dynamic_mx_quant")) == 1  # the activation only: the weight was converted once
    assert rel_err(out, reference(ops.gemm, a, w)) < spec.tolerances["gemm/fp8"][0]


def test_prepare_weight_casts_linear_weights_to_nz(npu):
    w = torch.randn(64, 32, dtype=torch.bfloat16)
    nz = deepinfer.prepare_weight("model.layers.3.self_attn.o_proj.weight", w)
    assert npu.get_npu_format(nz) == 29 and torch.equal(nz, w)
    assert npu.get_npu_format(deepinfer.prepare_weight("model.embed_tokens.weight", w)) == 2
    fp8 = quantize_blocks(torch.randn(128, 128))
    assert deepinfer.prepare_weight("model.layers.3.mlp.up_proj.weight", fp8) is fp8  # G-B needs no conversion


# ---------------------------------------------------------------------------------------------------------------
# MoE


def test_moe_route_maps_scoring_to_the_documented_norm_type(npu):
    logits, bias = torch.randn(9, 64), torch.randn(64) * 0.3
    w, ids = ops.moe_route(logits, bias, top_k=6, n_group=8, topk_group=3, routed_scaling_factor=2.5)
    (call,) = calls(npu, "npu_moe_gating_top_k")
    assert call["norm_type"] == 1 and call["group_select_mode"] == 1  # sigmoid, top-2 sum per group
    rw, rids = reference(ops.moe_route, logits, bias, top_k=6, n_group=8, topk_group=3, routed_scaling_factor=2.5)
    assert torch.equal(ids.sort(-1).values, rids.sort(-1).values)
    assert torch.allclose(w.gather(1, ids.argsort(-1)), rw.gather(1, rids.argsort(-1)), atol=1e-5)


def test_moe_route_over_two_experts_runs_the_composite(npu):
    # npu_moe_gating_top_k wants more than 2 experts per group, one group included
    logits = torch.randn(5, 2)
    w, ids = ops.moe_route(logits, None, top_k=1)
    assert served_by("moe_route") == "torch-composite" and not calls(npu, "npu_moe_gating_top_k")
    rw, rids = reference(ops.moe_route, logits, None, top_k=1)
    assert torch.equal(ids, rids) and torch.allclose(w, rw)


def _routing(tokens: int, experts: int, k: int):
    ids = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)]).int()
    ids[0, 0] = -1
    return ids, torch.rand(tokens, k)


@pytest.mark.parametrize("fp8", [False, True])
def test_low_latency_dispatch_uses_drop_pad_below_t_and_matches_the_reference(npu, fp8):
    x = torch.randn(12, 256, dtype=torch.bfloat16)
    ids, weights = _routing(12, 8, 3)
    x_in = quantize_rows(x, 128, "fp32") if fp8 else x
    capacity = 11
    out = ops.ep_dispatch(x_in, ids, weights, num_experts=8, mode="low_latency", capacity=capacity)
    assert calls(npu, "npu_moe_init_routing_v2")[0]["drop_pad_mode"] == 1
    ref = reference(ops.ep_dispatch, x_in, ids, weights, num_experts=8, mode="low_latency", capacity=capacity)
    masked = out[3].masked_m
    assert torch.equal(masked, ref[3].masked_m) and not bool(out[4].overflow)
    for e, m in enumerate(masked.tolist()):
        got, want = out[0][e] if not fp8 else out[0].dequantize()[e], ref[0][e] if not fp8 else ref[0].dequantize()[e]
        assert torch.equal(got[:m], want[:m])
        assert torch.equal(out[1][e, :m], ref[1][e, :m]) and torch.equal(out[2][e, :m], ref[2][e, :m])
    y = torch.randn(8, capacity, 64, dtype=torch.bfloat16)
    assert rel_err(ops.ep_combine(y, out[4]), reference(ops.ep_combine, y, ref[4])) < 1e-2
    assert calls(npu, "npu_moe_finalize_routing")[0]["drop_pad_mode"] == 3


def test_capacity_overflow_drops_the_last_rows_and_marks_their_tokens(npu, monkeypatch):
    monkeypatch.setenv("DEEPINFER_VALUE_CHECKS", "0")
    x = torch.randn(6, 128, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 2], [0, 1], [2, 3]], dtype=torch.int32)
    out = ops.ep_dispatch(x, ids, torch.rand(6, 2), num_experts=4, mode="low_latency", capacity=2)
    assert bool(out[4].overflow) and out[3].masked_m.tolist() == [2, 2, 2, 2]
    combined = ops.ep_combine(torch.randn(4, 2, 128, dtype=torch.bfloat16), out[4])
    lost = combined.isnan().any(dim=1)
    assert lost.tolist() == [False, False, True, False, True, True]  # past capacity: experts 0 (t2, t4), 1 (t4), 2 (t5)


def test_normal_dispatch_with_a_reordered_placement(npu):
    from deepinfer.ops.moe import ExpertPlacement

    placement = ExpertPlacement(6, ((3, 0, 5, 1, 4, 2),))
    x = torch.randn(7, 128, dtype=torch.bfloat16)
    ids, weights = _routing(7, 6, 2)
    out = ops.ep_dispatch(x, ids, weights, num_experts=6, placement=placement)
    assert served_by("ep_dispatch") == "torch_npu.npu_moe_init_routing_v2"
    ref = reference(ops.ep_dispatch, x, ids, weights, num_experts=6, placement=placement)
    assert torch.equal(out[1], ref[1]) and torch.equal(out[2], ref[2])
    held = ref[1] >= 0  # the skipped pairs' rows (id -1) hold unspecified data
    assert not held.all() and torch.equal(out[0][held], ref[0][held])
    assert torch.equal(out[3].expert_offsets, ref[3].expert_offsets)
    y = torch.randn(out[0].shape[0], 32, dtype=torch.bfloat16)
    assert rel_err(ops.ep_combine(y, out[4]), reference(ops.ep_combine, y, ref[4])) < 1e-2


# ---------------------------------------------------------------------------------------------------------------
# small ops


def test_rope_passes_t1d_coefficients_in_the_requested_mode(npu):
    table = ops.rope_cos_sin_cache(64, 128)
    x, pos = torch.randn(5, 3, 64, dtype=torch.bfloat16), torch.tensor([0, 9, 4, 127, 2], dtype=torch.int32)
    for interleaved, mode in ((True, "interleave"), (False, "half")):
        out = ops.rope(x, pos, table, interleaved)
        assert calls(npu, "npu_rotary_mul")[-1]["rotary_mode"] == mode
        assert rel_err(out, reference(ops.rope, x, pos, table, interleaved)) < 1e-2


def test_rms_norm_with_residual_returns_the_sum_from_npu_add_rms_norm(npu):
    x, res, w = (torch.randn(4, 64, dtype=torch.bfloat16) for _ in range(3))
    y, h = ops.rms_norm(x, w[0], 1e-6, res)
    assert calls(npu, "npu_add_rms_norm") and torch.equal(h, (x.float() + res.float()).bfloat16())
    assert rel_err(y, reference(ops.rms_norm, x, w[0], 1e-6, res)[0]) < 1e-2


def test_rms_norm_of_a_vector_gives_npu_rms_norm_two_dims(npu):
    # npu_rms_norm takes x of 2 to 8 dims (npu_add_rms_norm 1 to 8); the contract allows a 1-D x
    x, w = torch.randn(64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    y, h = ops.rms_norm(x, w, 1e-6)
    assert served_by("rms_norm") == "torch_npu.npu_(add_)rms_norm"
    assert calls(npu, "npu_rms_norm")[-1]["dims"] == 2 and y.shape == x.shape and h is x
    assert rel_err(y, reference(ops.rms_norm, x, w, 1e-6)[0]) < 1e-2


def test_double_npu_rms_norm_follows_its_own_dims_dtypes_and_empty_rules(npu):
    reject = npu.DocumentedRejection
    with pytest.raises(reject, match="2 to 8 dims"):
        npu.npu_rms_norm(torch.randn(8), torch.ones(8))
    y, rstd = npu.npu_rms_norm(torch.randn(3, 8, dtype=torch.bfloat16), torch.ones(8))  # fp32 gamma: documented
    assert y.dtype == torch.bfloat16 and rstd.shape == (3, 1) and rstd.dtype == torch.float32
    y, rstd = npu.npu_rms_norm(torch.randn(0, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16))
    assert y.shape == (0, 8) and rstd.shape == (0, 1)
    with pytest.raises(reject, match="dtype of x"):
        npu.npu_rms_norm(torch.randn(3, 8), torch.ones(8, dtype=torch.bfloat16))
    with pytest.raises(reject, match="dtype of x"):
        npu.npu_add_rms_norm(*(torch.randn(3, 8, dtype=torch.bfloat16) for _ in range(2)), torch.ones(8))
    with pytest.raises(reject, match="empty"):
        npu.npu_add_rms_norm(*(torch.randn(0, 8) for _ in range(2)), torch.ones(8))
    npu.npu_add_rms_norm(torch.randn(8), torch.randn(8), torch.ones(8))  # 1-D is documented here


def test_sample_is_per_row_and_deterministic(npu):
    logits = torch.randn(6, 50)
    temp = torch.tensor([0.0, 0.7, 1.0, 1.3, 0.5, 0.9])
    top_p, top_k = torch.tensor([1.0, 0.8, 1.0, 0.5, 1.0, 0.9]), torch.tensor([0, 5, 0, 0, 3, 10], dtype=torch.int32)
    seeds = torch.arange(6, dtype=torch.int64) * 7919
    full = ops.sample(logits, temp, top_p, top_k, seeds)
    alone = torch.cat([ops.sample(logits[i : i + 1], temp[i : i + 1], top_p[i : i + 1], top_k[i : i + 1],
                                  seeds[i : i + 1]) for i in range(6)])  # fmt: skip
    assert torch.equal(full, alone) and torch.equal(full, ops.sample(logits, temp, top_p, top_k, seeds))
    assert int(full[0]) == int(logits[0].argmax())


def test_a_wrong_layout_does_not_slip_through(npu, monkeypatch):
    """Breaking one piece of wiring (the decode mask) is caught by the double, not silently computed."""
    from deepinfer_ascend import attention

    cache, table = _paged([40, 33], 16, "bf16")
    q = torch.randn(2, 2, 4, 576, dtype=torch.bfloat16)
    monkeypatch.setattr(attention, "causal_mask", lambda device: torch.ones(2048, 2048, dtype=torch.bool).tril())
    with pytest.raises(npu.DocumentedRejection, match="upper triangle"):
        ops.mla_decode(q, cache, table, torch.tensor([40, 33], dtype=torch.int32), softmax_scale=0.1)


# ---------------------------------------------------------------------------------------------------------------
# DeepSeek Sparse Attention: indexer_topk, sparse_mla, write_index_cache (and layer_norm)


def _index_cache(lens: list[int], block_size: int, fmt: str, head_dim: int = 128, integer: bool = False):
    """An indexer-key cache with each sequence's keys in shuffled pages, NaN bytes everywhere else; unused table
    entries are -1 (the core does not validate them)."""
    pages = [math.ceil(n / block_size) for n in lens]
    cache = allocate_index_cache(sum(pages) + 2, block_size, head_dim=head_dim, index_format=fmt)
    cache.view(torch.uint8).fill_(0xFF)
    order = torch.randperm(cache.shape[0]).tolist()
    table = torch.full((len(lens), max(pages)), -1, dtype=torch.int32)
    flat = cache.view(-1, cache.shape[-1])
    for b, n in enumerate(lens):
        ids, order = order[: pages[b]], order[pages[b] :]
        table[b, : pages[b]] = torch.tensor(ids, dtype=torch.int32)
        pos = torch.arange(n)
        slots = table[b, pos // block_size].long() * block_size + pos % block_size
        if integer:  # three distinct integer keys: many exact ties
            keys = torch.randint(-2, 3, (3, head_dim)).float()[torch.randint(0, 3, (n,))]
        else:
            keys = torch.randn(n, head_dim)
        flat[slots] = keys.bfloat16() if fmt == "bf16" else pack_fp8_ds_index(keys)
    return cache, table


def _indexer_inputs(q_lens: list[int], lens: list[int], heads: int, fmt: str, integer: bool, block_size: int = 16):
    cache, table = _index_cache(lens, block_size, fmt, integer=integer)
    t = sum(q_lens)
    if integer:  # exact scores: small integers, signed power-of-two weights (exact in bf16 too)
        q = torch.randint(-2, 3, (t, heads, 128)).bfloat16()
        weights = torch.exp2(torch.randint(-2, 3, (t, heads)).float()) * (torch.randint(0, 2, (t, heads)) * 2 - 1)
    else:
        q, weights = torch.randn(t, heads, 128).bfloat16(), torch.randn(t, heads) * heads**-0.5
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, weights, cache, table, cu, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_index"])
def test_indexer_topk_turns_the_lightning_indexers_positions_into_sorted_slots(npu, fmt):
    """Exact ties everywhere: the indexer's score-ordered positions come back as the contract's rows, exactly."""
    # decode, a chunk over a prefix, rows that see fewer than topk positions (undefined tail), an empty sequence
    q, w, cache, table, cu, lens = _indexer_inputs([1, 5, 2, 0, 2], [40, 70, 9, 5, 33], 8, fmt, integer=True)
    out = ops.indexer_topk(q, w, cache, table, cu, lens, topk=24)
    assert served_by("indexer_topk") == "torch_npu.npu_lightning_indexer"
    (call,) = calls(npu, "npu_lightning_indexer")
    assert (call["layout_query"], call["layout_key"], call["sparse_mode"]) == ("TND", "PA_BSND", 3)
    assert call["sparse_count"] == 24 and call["key_dtype"] == torch.bfloat16  # fp8 keys go in dequantised
    assert call["weights_dtype"] == torch.bfloat16  # the 950 takes no fp32 weights
    assert call["seq_lens_q"] == [1, 5, 2, 0, 2] and call["seq_lens_k"] == [40, 70, 9, 5, 33]
    assert torch.equal(out, reference(ops.indexer_topk, q, w, cache, table, cu, lens, topk=24))


def test_fp8_indexer_keys_are_dequantised_from_the_pages_the_batch_reads(npu):
    """A long sequence among many pages: only its pages are copied (a compact table), not the whole cache."""
    cache, table = _index_cache([90, 10], 16, "fp8_ds_index", integer=True)
    big = torch.full((40, 16, 132), 0xFF, dtype=torch.uint8)
    big[: cache.shape[0]] = cache  # 33 more pages nobody uses
    q, w, _, _, cu, lens = _indexer_inputs([4, 1], [90, 10], 16, "fp8_ds_index", integer=True)
    out = ops.indexer_topk(q, w, big, table, cu, lens, topk=32)
    (call,) = calls(npu, "npu_lightning_indexer")
    assert call["key_blocks"] == 2 * 6 and call["key_dtype"] == torch.bfloat16  # B x the longest's pages
    assert torch.equal(out, reference(ops.indexer_topk, q, w, big, table, cu, lens, topk=32))


def test_positions_map_through_the_block_table_in_ascending_order():
    """The documented part of the indexer's output is the first min(topk, visible) entries of a row; their order is
    undocumented. Out-of-range or later entries (undefined) are dropped; kept positions are sorted, then mapped."""
    from deepinfer_ascend.sparse_attention import positions_to_slots

    table = torch.tensor([[5, 2, 9]], dtype=torch.int32)  # page size 16
    positions = torch.tensor(
        [
            [33, 3, 17, 123, 123],  # by score, then undefined bytes past the 3 positions that are not 123
            [1, 0, 7, 7, 7],  # sees 2 positions: only the first 2 entries count
            [2, 0, 1, 1, 0],  # sees 3: later repeats are not read
        ],
        dtype=torch.int32,
    )
    seq, visible = torch.zeros(3, dtype=torch.long), torch.tensor([34, 2, 3])
    out = positions_to_slots(positions, seq, visible, table, 16)
    assert out.tolist() == [[83, 33, 145, -1, -1], [80, 81, -1, -1, -1], [80, 81, 82, -1, -1]]
    assert out.dtype == torch.int32


def test_indexer_topk_chooses_like_the_reference_with_fp32_scores_on_an_a2(npu, monkeypatch):
    monkeypatch.setenv("DEEPINFER_TORCH_NPU_DOUBLE_SOC", "Ascend910B3")
    monkeypatch.setattr("deepinfer_ascend.probe._soc_cache", weakref.WeakKeyDictionary())
    registry.reload()
    q, w, cache, table, cu, lens = _indexer_inputs([3, 1], [50, 20], 4, "bf16", integer=False)
    with deepinfer.use("ascend") as spec:
        assert "indexer_topk/bf16" not in spec.tolerances
        out = ops.indexer_topk(q, w, cache, table, cu, lens, topk=16)
        assert served_by("indexer_topk") == "torch_npu.npu_lightning_indexer"  # 4 heads: A2 takes up to 64
    (call,) = calls(npu, "npu_lightning_indexer")
    assert call["weights_dtype"] == torch.float32  # the contract's weights, unrounded
    assert torch.equal(out, reference(ops.indexer_topk, q, w, cache, table, cu, lens, topk=16))


def test_indexer_topk_outside_the_envelope_runs_the_composite(npu):
    q, w, cache, table, cu, lens = _indexer_inputs([2, 1], [30, 12], 4, "bf16", integer=True)  # 950: 4 heads
    out = ops.indexer_topk(q, w, cache, table, cu, lens, topk=10)
    assert served_by("indexer_topk") == "torch-composite" and not calls(npu, "npu_lightning_indexer")
    assert torch.equal(out, reference(ops.indexer_topk, q, w, cache, table, cu, lens, topk=10))


def test_the_950_declares_the_indexer_tolerance_its_bf16_weights_need(npu):
    spec = registry.get().lookup("ascend")
    value, why = spec.tolerances["indexer_topk/bf16"]
    assert spec.tolerances["indexer_topk/fp8_ds_index"] == (value, why) and value == 5e-3 and "bf16" in why
    assert "indexer_topk/exact" not in spec.tolerances  # integer inputs stay exact


def test_compact_rows_keeps_repeats_and_puts_valid_entries_first():
    from deepinfer_ascend.sparse_attention import compact_rows

    indices = torch.tensor([[7, -1, 3, -1, 7], [-1, -1, -1, -1, -1], [12, 3, -1, -1, -1]], dtype=torch.int32)
    slots = torch.tensor([3, 7, 12])
    assert compact_rows(indices, slots).tolist() == [[0, 1, 1, -1, -1], [-1] * 5, [0, 2, -1, -1, -1]]


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
def test_sparse_mla_gathers_the_listed_slots_into_one_tnd_sequence(npu, kv_format):
    cache, table = _paged([70, 33], 16, kv_format)
    pos = [torch.randperm(70)[:12], torch.randperm(33)[:12]]
    slots = [table[b, p // 16].long() * 16 + p % 16 for b, p in enumerate(pos)]
    indices = torch.full((5, 16), -1, dtype=torch.int32)
    indices[0, :12] = slots[0].int()
    indices[1, ::2][:8] = slots[1][:8].int()  # -1 interleaved
    indices[2, 3:15] = slots[0].flip(0).int()
    indices[2, 15] = indices[2, 3]  # listed twice: counted twice
    indices[3] = indices[1].flip(0)
    # row 4 lists nothing
    q = torch.randn(5, 16, 576, dtype=torch.bfloat16)
    out, lse = ops.sparse_mla(q, cache, indices, softmax_scale=0.07)
    assert served_by("sparse_mla") == "torch_npu.npu_sparse_flash_attention"
    (call,) = calls(npu, "npu_sparse_flash_attention")
    assert (call["layout_query"], call["layout_kv"], call["sparse_mode"], call["batch"]) == ("TND", "TND", 0, 1)
    assert call["lse"] and call["topk"] == 16
    assert call["kv_tokens"] == len(set(indices.flatten().tolist()))  # the distinct slots (-1 included: a spare row)
    ref_out, ref_lse = reference(ops.sparse_mla, q, cache, indices, softmax_scale=0.07)
    assert torch.equal(out[4], torch.zeros_like(out[4])) and bool(torch.isneginf(lse[4]).all())
    assert rel_err(out, ref_out) < 1e-2 and torch.allclose(lse[:4], ref_lse[:4], atol=1e-3)


def test_sparse_mla_with_an_unsupported_head_count_on_an_a2_runs_the_composite(npu, monkeypatch):
    monkeypatch.setenv("DEEPINFER_TORCH_NPU_DOUBLE_SOC", "Ascend910B3")
    monkeypatch.setattr("deepinfer_ascend.probe._soc_cache", weakref.WeakKeyDictionary())
    registry.reload()
    cache, table = _paged([40], 16, "bf16")
    pos = torch.randperm(40)[:20]
    indices = (table[0, pos // 16].long() * 16 + pos % 16).int().view(2, 10)
    q = torch.randn(2, 12, 576, dtype=torch.bfloat16)  # 12 heads: a 950 takes them, A2/A3 want powers of two
    with deepinfer.use("ascend"):
        out, _ = ops.sparse_mla(q, cache, indices, softmax_scale=0.07)
        assert served_by("sparse_mla") == "torch-composite"
    assert not calls(npu, "npu_sparse_flash_attention")
    assert rel_err(out, reference(ops.sparse_mla, q, cache, indices, softmax_scale=0.07)[0]) < 1e-2


def test_write_index_cache_scatters_int8_records_and_skips_minus_one(npu):
    cache = allocate_index_cache(3, 16, head_dim=128, index_format="fp8_ds_index").zero_()
    k = torch.randn(4, 128, dtype=torch.bfloat16)
    ops.write_index_cache(k, cache, torch.tensor([3, -1, 40, 17]))
    assert served_by("write_index_cache") == "torch_npu.npu_scatter_nd_update_"
    (call,) = calls(npu, "npu_scatter_nd_update_")
    assert call["dtype"] == torch.int8 and call["n"] == 3 and call["depth"] == 1
    assert torch.equal(cache.view(-1, 132)[[3, 40, 17]], pack_fp8_ds_index(k[[0, 2, 3]]))
    assert int(cache.view(-1, 132).any(dim=1).sum()) == 3


def test_layer_norm_is_plain_torch_in_fp32(npu):
    x, w, b = torch.randn(5, 128, dtype=torch.bfloat16) * 3 + 2, torch.randn(128), torch.randn(128)
    y = ops.layer_norm(x, w, b, 1e-6)
    assert served_by("layer_norm") == "torch-composite" and y.dtype == torch.bfloat16
    assert rel_err(y, reference(ops.layer_norm, x, w, b, 1e-6)) < 1e-2


def test_double_rejects_documented_dsa_misuse(npu, monkeypatch):
    reject = npu.DocumentedRejection
    key = torch.randn(4, 16, 1, 128, dtype=torch.bfloat16)
    q, w = torch.randn(3, 8, 128, dtype=torch.bfloat16), torch.randn(3, 8, dtype=torch.bfloat16)
    li = {"actual_seq_lengths_query": torch.tensor([1, 3], dtype=torch.int32), "layout_query": "TND"}
    li |= {"actual_seq_lengths_key": torch.tensor([20, 9], dtype=torch.int32), "layout_key": "PA_BSND"}
    li |= {"block_table": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), "sparse_count": 8}
    npu.npu_lightning_indexer(q, key, w, **li)  # the documented form is accepted
    with pytest.raises(reject, match="float32"):
        npu.npu_lightning_indexer(q, key, w.float(), **li)  # a 950 takes no fp32 weights
    with pytest.raises(reject, match="N of query"):
        npu.npu_lightning_indexer(q[:, :4].contiguous(), key, w[:, :4].contiguous(), **li)
    with pytest.raises(reject, match="sparse_count"):
        npu.npu_lightning_indexer(q, key, w, **(li | {"sparse_count": 2049}))
    with pytest.raises(reject, match="multiple of 16"):
        npu.npu_lightning_indexer(q, key.view(8, 8, 1, 128), w, **(li | {"block_table": torch.zeros(2, 4).int()}))
    with pytest.raises(reject, match="128"):
        npu.npu_lightning_indexer(q[..., :64].contiguous(), key[..., :64].contiguous(), w, **li)
    with pytest.raises(reject, match="prefix sums"):
        npu.npu_lightning_indexer(q, key, w, **(li | {"actual_seq_lengths_query": torch.tensor([2, 1]).int()}))
    with pytest.raises(reject, match="return_value"):
        npu.npu_lightning_indexer(q, key, w, **(li | {"return_value": True}))

    kv = torch.randn(6, 1, 512, dtype=torch.bfloat16)
    qs, qr, kr = torch.randn(2, 4, 512).bfloat16(), torch.randn(2, 4, 64).bfloat16(), torch.randn(6, 1, 64).bfloat16()
    sfa = {"query_rope": qr, "key_rope": kr, "layout_query": "TND", "layout_kv": "TND", "attention_mode": 2}
    sfa |= {"actual_seq_lengths_query": torch.tensor([2]).int(), "actual_seq_lengths_kv": torch.tensor([6]).int()}
    sfa |= {"sparse_mode": 0, "return_softmax_lse": True}
    idx = torch.tensor([[[0, 5, -1]], [[2, -1, -1]]], dtype=torch.int32)
    npu.npu_sparse_flash_attention(qs, kv, kv, idx, 0.1, **sfa)
    with pytest.raises(reject, match="valid sparse_indices must come before"):
        npu.npu_sparse_flash_attention(qs, kv, kv, idx.flip(-1).contiguous(), 0.1, **sfa)
    with pytest.raises(reject, match="share the same data"):
        npu.npu_sparse_flash_attention(qs, kv, kv + 1, idx, 0.1, **sfa)
    with pytest.raises(reject, match="attention_mode"):
        npu.npu_sparse_flash_attention(qs, kv, kv, idx, 0.1, **(sfa | {"attention_mode": 0}))
    with pytest.raises(reject, match="inside the batch"):
        npu.npu_sparse_flash_attention(qs, kv, kv, idx + 6, 0.1, **sfa)
    monkeypatch.setenv("DEEPINFER_TORCH_NPU_DOUBLE_SOC", "Ascend910B3")
    q3, qr3 = torch.randn(2, 3, 512).bfloat16(), torch.randn(2, 3, 64).bfloat16()
    with pytest.raises(reject, match="Q_N"):
        npu.npu_sparse_flash_attention(q3, kv, kv, idx, 0.1, **(sfa | {"query_rope": qr3}))
