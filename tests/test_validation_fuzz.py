"""Hypothesis fuzzing of every op's validation and of the main references.

Each validation test draws a valid call (random shapes, dtypes and arguments the contract allows) and then either
keeps it or applies one named mutation that the contract forbids. A valid call must return outputs of the
documented shapes and dtypes; a mutated call must raise ``deepinfer.InputError``; any other exception fails the
test. The reference tests compare gemm, grouped_gemm, mla_decode and moe_route with the independent formulations
of ``test_references`` at hypothesis-chosen small shapes.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from test_references import (
    act_quant,
    blockwise_fp8_gemm,
    check_mla_against_decompressed,
    dequant,
    dot_bound,
    hf_route,
    mla_problem,
    random_fp8_weight,
    sorted_by_id,
)

import deepinfer
from deepinfer import InputError, QTensor, ops
from deepinfer.ops.moe import DispatchHandle

FP8 = torch.float8_e4m3fn
FLOATS = (torch.bfloat16, torch.float16, torch.float32)
NOT_FLOAT = (torch.int32, torch.int64, torch.float64, torch.bool, torch.uint8)
NOT_A_TENSOR = (None, 3, 1.5, "tensor", [1, 2])


def fuzz(max_examples: int):
    return settings(
        deadline=None, max_examples=max_examples, database=None, suppress_health_check=[HealthCheck.too_slow]
    )


@pytest.fixture(autouse=True)
def on_reference():
    """Every op call in this file runs the reference backend."""
    with deepinfer.use("reference"):
        yield


class Draw:
    """Hypothesis draws plus a torch generator seeded by hypothesis, so every example is reproducible."""

    def __init__(self, data):
        self.data = data
        self.gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32), label="seed"))

    def __call__(self, strategy, label=None):
        return self.data.draw(strategy, label=label)

    def int(self, low: int, high: int, label=None) -> int:
        return self(st.integers(low, high), label)

    def pick(self, options, label=None):
        return self(st.sampled_from(list(options)), label)

    def randn(self, *shape: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen) * scale).to(dtype)

    def randint(self, low: int, high: int, *shape: int, dtype=torch.int32) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=self.gen).to(dtype)

    def fp8(self, *shape: int, block: tuple[int, int], scale_format: str = "fp32") -> QTensor:
        data = self.randn(*shape, scale=32).clamp(-448, 448).to(FP8)
        sshape = (*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))
        return QTensor(data, torch.rand(sshape, generator=self.gen) + 0.01, block, scale_format)


def mutations(names: str, valid_runs: int = 4):
    """Parametrizes a test over ``mutation``: None (a valid call, ``valid_runs`` times) and each of the space-separated
    ``names`` once, so every forbidden case runs on every run; hypothesis draws the rest of the call, with what
    the mutation needs (a non-empty batch, a used page, ...)."""
    valid = [pytest.param(None, id=f"valid{i}") for i in range(valid_runs)]
    return pytest.mark.parametrize("mutation", valid + [pytest.param(n, id=n) for n in names.split()])


def on_meta(t):
    """The same tensor (or QTensor data) on the meta device: a device mismatch."""
    if isinstance(t, QTensor):
        return QTensor(t.data.to("meta"), t.scale, t.block, t.scale_format)
    return t.to("meta")


def expect(op, kwargs: dict, mutation: str | None, check) -> None:
    """A valid call returns outputs that pass ``check``; a mutated call raises InputError; nothing else."""
    note(f"mutation: {mutation}")
    try:
        out = op(**kwargs)
    except InputError as e:
        assert mutation is not None, f"valid arguments rejected: {e}"
        return
    assert mutation is None, f"invalid arguments accepted ({mutation})"
    check(out)


def is_tensor(t, shape, dtype) -> bool:
    return isinstance(t, torch.Tensor) and tuple(t.shape) == tuple(shape) and t.dtype == dtype


def shaped(shape, dtype):
    """A check: the output is a tensor of this shape and dtype."""

    def check(out):
        found = f"{type(out).__name__} {list(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else repr(out)
        assert is_tensor(out, shape, dtype), f"expected a {dtype} tensor {list(shape)}, got {found}"

    return check


# ---------------------------------------------------------------------------------------------------------------
# Validation: every op
# ---------------------------------------------------------------------------------------------------------------


@mutations("x_type x_dtype x_ndim k_not_multiple block scale_format")
@fuzz(15)
@given(data=st.data())
def test_quantize_fp8_validation(mutation, data):
    """quantize_fp8: QTensor with data like x, scales [..., K / block] fp32, or InputError."""
    d = Draw(data)
    block = d.pick([1, 3, 32, 64, 128])
    lead = d(st.lists(st.integers(0, 3), min_size=1, max_size=2))
    k = block * d.int(0, 3)
    x = d.randn(*lead, k, dtype=d.pick(FLOATS))
    kw = dict(x=x, block=block, scale_format=d.pick(["fp32", "ue8m0"]))
    if mutation == "x_type":
        kw["x"] = d.pick(NOT_A_TENSOR)
    elif mutation == "x_dtype":
        kw["x"] = x.to(d.pick(NOT_FLOAT))
    elif mutation == "x_ndim":
        kw["x"] = d.randn(k) if d(st.booleans()) else d.randn(1, 1, 1, k)
    elif mutation == "k_not_multiple":
        kw["block"] = block if block > 1 else d.pick([2, 5, 128])  # every K is a multiple of 1
        kw["x"] = d.randn(*lead, kw["block"] * d.int(0, 2) + d.int(1, kw["block"] - 1))
    elif mutation == "block":
        kw["block"] = d.pick([0, -128, True, 128.0, "128", None])
    elif mutation == "scale_format":
        kw["scale_format"] = d.pick(["e8m0", "FP32", None, 0])

    def check(q):
        assert isinstance(q, QTensor) and q.block == (1, block) and q.scale_format == kw["scale_format"]
        assert is_tensor(q.data, x.shape, FP8) and is_tensor(q.scale, (*lead, k // block), torch.float32)

    expect(ops.quantize_fp8, kw, mutation, check)


def draw_weight(d: Draw, n: int, k: int, *, fp8: bool, dtype, lead: tuple[int, ...] = ()):
    if fp8:
        return d.fp8(*lead, n, k, block=(128, 128), scale_format=d.pick(["fp32", "ue8m0"]))
    return d.randn(*lead, n, k, dtype=dtype)


def draw_activation(d: Draw, *shape: int, fp8_w: bool, dtype):
    """A float activation, or an FP8 (1, 128) QTensor when the weight is FP8 (drawn at random)."""
    if fp8_w and d(st.booleans(), label="fp8 a"):
        return d.fp8(*shape, block=(1, 128), scale_format=d.pick(["fp32", "ue8m0"]))
    return d.randn(*shape, dtype=dtype if not fp8_w else d.pick(FLOATS))


def mutate_weight_qtensor(d: Draw, w: QTensor, what: str) -> QTensor:
    if what == "w_block":
        return QTensor(w.data, w.scale, d.pick([(1, 128), (128, 64), 128, None, "128x128"]), w.scale_format)
    if what == "w_scale_shape":
        return QTensor(w.data, torch.ones(*w.scale.shape[:-1], w.scale.shape[-1] + 1), w.block, w.scale_format)
    if what == "w_scale_dtype":
        return QTensor(w.data, w.scale.to(d.pick([torch.float16, torch.bfloat16, torch.float64])), w.block)
    if what == "w_data_dtype":
        return QTensor(w.data.to(torch.bfloat16), w.scale, w.block, w.scale_format)
    if what == "w_scale_format":
        return QTensor(w.data, w.scale, w.block, d.pick(["e8m0", None]))
    raise AssertionError(what)


QT_MUTATIONS = ["w_block", "w_scale_shape", "w_scale_dtype", "w_data_dtype", "w_scale_format"]
FLOAT_W_MUTATIONS = ["dtype_mismatch", "fp8_a_float_w", "w_dtype"]


@mutations(
    "a_type w_type k_mismatch w_ndim bias_shape bias_dtype out_dtype meta w_block w_scale_shape w_scale_dtype "
    "w_data_dtype w_scale_format fp8_k dtype_mismatch fp8_a_float_w w_dtype"
)
@fuzz(15)
@given(data=st.data())
def test_gemm_validation(mutation, data):
    """gemm: [M, N] in out_dtype for every allowed operand pairing, InputError otherwise."""
    d = Draw(data)
    fp8_w = {**dict.fromkeys([*QT_MUTATIONS, "fp8_k"], True), **dict.fromkeys(FLOAT_W_MUTATIONS, False)}.get(
        mutation, d(st.booleans(), label="fp8 w")
    )
    m, n = d.int(0, 5), d.int(1, 300)
    k = 128 * d.int(1, 2) if fp8_w else d.int(1, 40)
    dtype = d.pick(FLOATS)
    w = draw_weight(d, n, k, fp8=fp8_w, dtype=dtype)
    # an fp32 weight meets a bf16 / fp16 activation too (a router's product)
    a_dtype = d.pick(FLOATS) if dtype == torch.float32 and not fp8_w else dtype
    a = draw_activation(d, m, k, fp8_w=fp8_w, dtype=a_dtype)
    bias = d.randn(n, dtype=d.pick(FLOATS)) if d(st.booleans(), label="bias") else None
    kw = dict(a=a, w=w, out_dtype=d.pick(FLOATS), bias=bias)
    if mutation == "a_type":
        kw["a"] = d.pick(NOT_A_TENSOR)
    elif mutation == "w_type":
        kw["w"] = d.pick(NOT_A_TENSOR)
    elif mutation == "k_mismatch":
        kw["a"] = draw_activation(d, m, k + 128, fp8_w=fp8_w, dtype=dtype)
    elif mutation == "w_ndim":
        kw["w"] = draw_weight(d, n, k, fp8=fp8_w, dtype=dtype, lead=(1,))
    elif mutation == "bias_shape":
        kw["bias"] = d.randn(n + d.pick([1, -1]) if n > 1 else 2)
    elif mutation == "bias_dtype":
        kw["bias"] = d.randn(n).to(d.pick(NOT_FLOAT))
    elif mutation == "out_dtype":
        kw["out_dtype"] = d.pick([torch.int32, torch.float64, "bfloat16", None, FP8])
    elif mutation == "meta":
        which = d.pick(["a", "w"] + (["bias"] if bias is not None else []))
        kw[which] = on_meta(kw[which])
    elif mutation in QT_MUTATIONS:
        kw["w"] = mutate_weight_qtensor(d, w, mutation)
    elif mutation == "fp8_k":  # a K that is no multiple of 128, with scales of the matching logical shape
        kw["w"] = d.fp8(n, k - d.int(1, 127), block=(128, 128))
        kw["a"] = d.randn(m, kw["w"].shape[1], dtype=torch.bfloat16)
    elif mutation == "dtype_mismatch":  # (a bf16 / fp16 activation meets an fp32 weight: not a mismatch)
        if dtype == torch.float32:
            kw["w"] = w.to(d.pick([t for t in (torch.bfloat16, torch.float16) if t != a_dtype]))
        else:
            kw["a"] = a.to(d.pick([t for t in FLOATS if t != dtype]))
    elif mutation == "fp8_a_float_w":
        kw["a"] = d.fp8(m, 128, block=(1, 128))
        kw["w"] = d.randn(n, 128, dtype=dtype)
    elif mutation == "w_dtype":
        kw["w"] = w.to(d.pick(NOT_FLOAT))
    expect(ops.gemm, kw, mutation, shaped((m, n), kw["out_dtype"]))


@mutations(
    "both_layouts no_layout layout_dtype layout_length a_ndim k_mismatch out_dtype masked_too_big masked_negative "
    "a_experts offsets_order offsets_total w_block w_scale_shape w_scale_dtype w_data_dtype w_scale_format "
    "dtype_mismatch meta"
)
@fuzz(15)
@given(data=st.data())
def test_grouped_gemm_validation(mutation, data):
    """grouped_gemm: contiguous [M, N] or masked [E, max_m, N] in out_dtype, InputError otherwise."""
    d = Draw(data)
    fp8_w = {**dict.fromkeys(QT_MUTATIONS, True), "dtype_mismatch": False, "meta": False}.get(
        mutation, d(st.booleans(), label="fp8 w")
    )
    masked = {"masked_too_big": True, "masked_negative": True, "a_experts": True, "offsets_order": False}.get(
        mutation, mutation != "offsets_total" and d(st.booleans(), label="masked")
    )
    experts, n = d.int(0, 4), d.int(1, 140)
    k = 128 * d.int(1, 2) if fp8_w else d.int(1, 24)
    dtype = d.pick(FLOATS)
    w = draw_weight(d, n, k, fp8=fp8_w, dtype=dtype, lead=(experts,))
    counts = [d.int(0, 3) for _ in range(experts)]
    if masked:
        max_m = max(counts, default=0) + d.int(0, 2)
        a = draw_activation(d, experts, max_m, k, fp8_w=fp8_w, dtype=dtype)
        kw = dict(a=a, w=w, masked_m=torch.tensor(counts, dtype=torch.int32).reshape(experts))
        out_shape = (experts, max_m, n)
    else:
        a = draw_activation(d, sum(counts), k, fp8_w=fp8_w, dtype=dtype)
        offsets = torch.tensor([0, *torch.tensor(counts, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
        kw = dict(a=a, w=w, expert_offsets=offsets)
        out_shape = (sum(counts), n)
    kw["out_dtype"] = d.pick(FLOATS)
    key = "masked_m" if masked else "expert_offsets"
    if mutation == "both_layouts":
        kw["masked_m" if not masked else "expert_offsets"] = torch.zeros(experts + (not masked), dtype=torch.int32)
    elif mutation == "no_layout":
        del kw[key]
    elif mutation == "layout_dtype":
        kw[key] = kw[key].to(d.pick([torch.int64, torch.float32, torch.int16]))
    elif mutation == "layout_length":
        kw[key] = torch.cat([kw[key], kw[key][-1:] if len(kw[key]) else torch.zeros(1, dtype=torch.int32)])
    elif mutation == "a_ndim":
        kw["a"] = d.randn(*((3, k) if masked else (1, 2, k)), dtype=dtype)
    elif mutation == "k_mismatch":
        kw["a"] = draw_activation(d, *a.shape[:-1], k + 128, fp8_w=fp8_w, dtype=dtype)
    elif mutation == "out_dtype":
        kw["out_dtype"] = d.pick([torch.int32, torch.float64, "float32"])
    elif mutation == "masked_too_big":
        if experts == 0:
            kw["masked_m"] = torch.zeros(1, dtype=torch.int32)  # a length mismatch instead
        else:
            kw["masked_m"] = kw["masked_m"].clone()
            kw["masked_m"][d.int(0, experts - 1)] = a.shape[1] + d.int(1, 3)
    elif mutation == "masked_negative":
        kw["masked_m"] = kw["masked_m"].clone() if experts else torch.zeros(1, dtype=torch.int32)
        kw["masked_m"][0] = -1
    elif mutation == "a_experts":
        kw["a"] = draw_activation(d, experts + 1, a.shape[1], k, fp8_w=fp8_w, dtype=dtype)
    elif mutation == "offsets_order":
        offsets = kw["expert_offsets"].clone()
        offsets[0] = d.pick([1, -1])
        kw["expert_offsets"] = offsets
    elif mutation == "offsets_total":
        offsets = kw["expert_offsets"].clone()
        offsets[-1] += d.pick([1, -1]) if offsets[-1] > 0 else 1
        kw["expert_offsets"] = offsets
    elif mutation in QT_MUTATIONS:
        kw["w"] = mutate_weight_qtensor(d, w, mutation)
    elif mutation == "dtype_mismatch":
        kw["a"] = kw["a"].to(d.pick([t for t in FLOATS if t != dtype]))
    elif mutation == "meta":
        kw["w"] = on_meta(w)
    expect(ops.grouped_gemm, kw, mutation, shaped(out_shape, kw["out_dtype"]))


def draw_cache(d: Draw, *, fp8: bool, lora: int, rope: int, used_page: bool = False):
    """(kv_cache, block_table, seq_lens) for a random batch over random pages (``used_page``: sequence 0 holds at
    least one token)."""
    num_blocks, block_size = d.int(int(used_page), 6), d.int(1, 4)
    batch, max_blocks = d.int(int(used_page), 3), d.int(int(used_page), 3)
    width = lora + 4 * (lora // 128) + 2 * rope if fp8 else lora + rope
    if fp8:
        cache = torch.randint(0, 256, (num_blocks, block_size, width), generator=d.gen, dtype=torch.uint8)
    else:
        cache = d.randn(num_blocks, block_size, width, dtype=torch.bfloat16)
    limit = max_blocks * block_size if num_blocks else 0
    seq_lens = torch.tensor([d.int(int(used_page and b == 0), limit) for b in range(batch)], dtype=torch.int32)
    table = d.randint(0, max(num_blocks, 1), batch, max_blocks)
    unused = torch.arange(max_blocks)[None, :] * block_size >= seq_lens[:, None]
    table[unused] = d.pick([-1, 0, 10**6])  # entries past a sequence's pages are never read
    return cache, table, seq_lens


@mutations(
    "q_type q_ndim q_dtype rank_too_big rank_zero cache_width cache_dtype format cache_strided table_rows "
    "table_dtype lens_length scale scale_nan meta lens_too_long page_out_of_range lens_negative fp8_rank"
)
@fuzz(15)
@given(data=st.data())
def test_mla_decode_validation(mutation, data):
    """mla_decode: out [B, S_q, H, L] in q's dtype and lse [B, S_q, H] fp32, or InputError."""
    d = Draw(data)
    fp8 = mutation != "fp8_rank" and d(st.booleans(), label="fp8 cache")
    lora, rope = (128, d.int(1, 4)) if fp8 else (d.int(1, 8), d.int(1, 4))
    used_page = mutation in ("lens_too_long", "page_out_of_range", "lens_negative")
    cache, table, seq_lens = draw_cache(d, fp8=fp8, lora=lora, rope=rope, used_page=used_page)
    batch, s_q, heads = table.shape[0], d.int(1, 3), d.int(0, 3)
    q = d.randn(batch, s_q, heads, lora + rope, dtype=d.pick(FLOATS))
    fmt = d.pick([None, "fp8_ds_mla" if fp8 else "bf16"])
    kw = dict(q=q, kv_cache=cache, block_table=table, seq_lens=seq_lens, softmax_scale=d(st.floats(1e-3, 4)))
    kw.update(kv_lora_rank=lora, kv_format=fmt)
    if mutation == "q_type":
        kw["q"] = d.pick(NOT_A_TENSOR)
    elif mutation == "q_ndim":
        kw["q"] = q[:, 0]
    elif mutation == "q_dtype":
        kw["q"] = q.to(d.pick(NOT_FLOAT))
    elif mutation == "rank_too_big":
        kw["kv_lora_rank"] = lora + rope + d.int(0, 3)
    elif mutation == "rank_zero":
        kw["kv_lora_rank"] = d.pick([0, -1, True, 4.0])
    elif mutation == "cache_width":
        kw["kv_cache"] = torch.zeros(*cache.shape[:2], cache.shape[2] + d.pick([1, -1]), dtype=cache.dtype)
    elif mutation == "cache_dtype":
        kw["kv_cache"] = cache.to(d.pick([torch.float32, torch.float16, torch.int8]))
    elif mutation == "format":
        kw["kv_format"] = d.pick(["bf16" if fp8 else "fp8_ds_mla", "fp8", 1])
    elif mutation == "cache_strided":  # a non-contiguous view of the right shape (at least one page)
        strided = torch.zeros(max(cache.shape[0], 1), cache.shape[2], cache.shape[1] + 1, dtype=cache.dtype)
        kw["kv_cache"] = strided[:, :, : cache.shape[1]].transpose(1, 2)
    elif mutation == "table_rows":
        kw["block_table"] = torch.zeros(batch + 1, table.shape[1], dtype=torch.int32)
    elif mutation == "table_dtype":
        kw["block_table"] = table.to(d.pick([torch.int64, torch.float32]))
    elif mutation == "lens_length":
        kw["seq_lens"] = torch.zeros(batch + 1, dtype=torch.int32)
    elif mutation == "scale":
        kw["softmax_scale"] = d.pick([-0.5, 0.0, math.inf, "0.1", None])
    elif mutation == "scale_nan":
        kw["softmax_scale"] = math.nan
    elif mutation == "meta":
        which = d.pick(["kv_cache", "block_table", "seq_lens"])
        kw[which] = on_meta(kw[which])
    elif mutation == "lens_too_long":
        kw["seq_lens"] = seq_lens.clone()
        kw["seq_lens"][0] = table.shape[1] * cache.shape[1] + d.int(1, 3)
    elif mutation == "page_out_of_range":  # sequence 0 reads its first page
        kw["block_table"] = table.clone()
        kw["block_table"][0, 0] = d.pick([-1, cache.shape[0], cache.shape[0] + 7])
    elif mutation == "lens_negative":
        kw["seq_lens"] = seq_lens.clone()
        kw["seq_lens"][0] = -1
    elif mutation == "fp8_rank":  # fp8_ds_mla needs kv_lora_rank % 128 == 0
        kw["kv_cache"] = torch.zeros(*cache.shape[:2], lora + 4 + 2 * rope, dtype=torch.uint8)

    def check(res):
        out, lse = res
        assert is_tensor(out, (batch, s_q, heads, lora), q.dtype) and is_tensor(lse, (batch, s_q, heads), torch.float32)

    expect(ops.mla_decode, kw, mutation, check)


@mutations(
    "q_ndim k_dtype k_dim v_rows v_heads heads cu_length cu_empty cu_start cu_total cu_dtype causal scale scale_nan "
    "meta v_type"
)
@fuzz(15)
@given(data=st.data())
def test_attention_varlen_validation(mutation, data):
    """attention_varlen: [T_q, H, D_v] in q's dtype, or InputError."""
    d = Draw(data)
    lens = d(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4)), max_size=3), label="lens")
    kv_heads, group = d.int(1, 2), d.int(0, 2)
    heads, d_qk, d_v = kv_heads * group, d.int(1, 8), d.int(1, 8)
    dtype = d.pick(FLOATS)
    t_q, t_k = sum(lq for lq, _ in lens), sum(lk for _, lk in lens)
    cu = lambda ls: torch.tensor([0, *torch.tensor(ls, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    kw = dict(
        q=d.randn(t_q, heads, d_qk, dtype=dtype), k=d.randn(t_k, kv_heads, d_qk, dtype=dtype),
        v=d.randn(t_k, kv_heads, d_v, dtype=dtype), cu_seqlens_q=cu([lq for lq, _ in lens]),
        cu_seqlens_k=cu([lk for _, lk in lens]), softmax_scale=d(st.floats(1e-3, 2)), causal=d(st.booleans()),
    )  # fmt: skip
    if mutation == "q_ndim":
        kw["q"] = kw["q"].flatten(1)
    elif mutation == "k_dtype":
        kw["k"] = kw["k"].to(d.pick([t for t in (*FLOATS, torch.int32) if t != dtype]))
    elif mutation == "k_dim":
        kw["k"] = d.randn(t_k, kv_heads, d_qk + 1, dtype=dtype)
    elif mutation == "v_rows":
        kw["v"] = d.randn(t_k + 1, kv_heads, d_v, dtype=dtype)
    elif mutation == "v_heads":
        kw["v"] = d.randn(t_k, kv_heads + 1, d_v, dtype=dtype)
    elif mutation == "heads":  # no kv heads, or H_k not dividing H (H + 1 never divides H > 0)
        kv = d.pick([0, heads + 1]) if heads else 0
        kw["k"], kw["v"] = d.randn(t_k, kv, d_qk, dtype=dtype), d.randn(t_k, kv, d_v, dtype=dtype)
    elif mutation == "cu_length":
        kw["cu_seqlens_k"] = torch.cat([kw["cu_seqlens_k"], kw["cu_seqlens_k"][-1:]])
    elif mutation == "cu_empty":
        kw["cu_seqlens_q"] = kw["cu_seqlens_k"] = torch.zeros(0, dtype=torch.int32)
    elif mutation == "cu_start":
        kw["cu_seqlens_q"] = kw["cu_seqlens_q"] + 1
    elif mutation == "cu_total":
        if len(lens) and t_k:
            kw["cu_seqlens_k"] = kw["cu_seqlens_k"].clone()
            kw["cu_seqlens_k"][1] = t_k + 1  # out of order or past the end
        else:
            kw["cu_seqlens_q"] = torch.tensor([0, t_q + 1], dtype=torch.int32)
            kw["cu_seqlens_k"] = torch.tensor([0, t_k], dtype=torch.int32)
    elif mutation == "cu_dtype":
        kw["cu_seqlens_q"] = kw["cu_seqlens_q"].long()
    elif mutation == "causal":
        kw["causal"] = d.pick([1, None, "yes"])
    elif mutation == "scale":
        kw["softmax_scale"] = d.pick([-1.0, 0.0, math.inf, None, "1"])
    elif mutation == "scale_nan":
        kw["softmax_scale"] = math.nan
    elif mutation == "meta":
        kw["v"] = on_meta(kw["v"])
    elif mutation == "v_type":
        kw["v"] = d.pick(NOT_A_TENSOR)
    expect(ops.attention_varlen, kw, mutation, shaped((t_q, heads, d_v), dtype))


@mutations("latent_dtype latent_ndim rank cache_width slot_dtype slot_length format meta slot_range slot_duplicate")
@fuzz(15)
@given(data=st.data())
def test_write_kv_cache_validation(mutation, data):
    """write_kv_cache: returns None and writes in place, or InputError."""
    d = Draw(data)
    fp8 = d(st.booleans(), label="fp8 cache")
    lora, rope = (128, d.int(1, 4)) if fp8 else (d.int(1, 8), d.int(1, 4))
    two = mutation == "slot_duplicate"  # needs two written tokens
    num_blocks, block_size = d.int(2 if two else 0, 3), d.int(1, 3)
    width = lora + 4 * (lora // 128) + 2 * rope if fp8 else lora + rope
    cache = torch.zeros(num_blocks, block_size, width, dtype=torch.uint8 if fp8 else torch.bfloat16)
    slots_total = num_blocks * block_size
    tokens = d.int(2 if two else int(mutation == "slot_range"), 4)
    slots = torch.randperm(max(slots_total, tokens), generator=d.gen)[:tokens].long()
    slots[slots >= slots_total] = -1
    if tokens > 2 and d(st.booleans(), label="skip one"):
        slots[-1] = -1
    if two:
        slots[:2] = torch.randperm(slots_total, generator=d.gen)[:2]
        slots[2:] = -1
    latent = d.randn(tokens, lora + rope, dtype=d.pick(FLOATS))
    kw = dict(latent=latent, kv_cache=cache, slot_mapping=slots, kv_lora_rank=lora)
    kw["kv_format"] = d.pick([None, "fp8_ds_mla" if fp8 else "bf16"])
    if mutation == "latent_dtype":
        kw["latent"] = latent.to(d.pick(NOT_FLOAT))
    elif mutation == "latent_ndim":
        kw["latent"] = latent[None]
    elif mutation == "rank":
        kw["kv_lora_rank"] = d.pick([0, lora + rope, lora + rope + 5])
    elif mutation == "cache_width":
        kw["kv_cache"] = torch.zeros(num_blocks, block_size, width + 2, dtype=cache.dtype)
    elif mutation == "slot_dtype":
        kw["slot_mapping"] = slots.int()
    elif mutation == "slot_length":
        kw["slot_mapping"] = torch.cat([slots, torch.tensor([-1])])
    elif mutation == "format":
        kw["kv_format"] = d.pick(["bf16" if fp8 else "fp8_ds_mla", "int8"])
    elif mutation == "meta":
        kw["slot_mapping"] = on_meta(slots)
    elif mutation == "slot_range":
        kw["slot_mapping"] = slots.clone()
        kw["slot_mapping"][0] = d.pick([-2, slots_total, slots_total + 4])
    elif mutation == "slot_duplicate":
        used = slots[slots >= 0]
        kw["slot_mapping"] = torch.where(slots >= 0, used[0], slots)
    expect(ops.write_kv_cache, kw, mutation, lambda out: out is None or pytest.fail(f"returned {out!r}"))


@mutations(
    "logits_dtype logits_ndim bias_shape bias_dtype n_group topk_group top_k scoring scale scale_nan meta "
    "top_k_zero singleton_groups"
)
@fuzz(15)
@given(data=st.data())
def test_moe_route_validation(mutation, data):
    """moe_route: weights [T, top_k] fp32 and distinct ids [T, top_k] int32 in range, or InputError."""
    d = Draw(data)
    scoring = "sigmoid" if mutation == "singleton_groups" else d.pick(["sigmoid", "softmax"])
    n_group = d.int(2 if mutation == "singleton_groups" else 1, 4)
    group_size = d.int(2 if (scoring == "sigmoid" and n_group > 1) else 1, 4)
    experts, topk_group = n_group * group_size, d.int(1, n_group)
    top_k, tokens = d.int(1, topk_group * group_size), d.int(0, 4)
    logits = d.randn(tokens, experts)
    kw = dict(logits=logits, bias=d.randn(experts) if d(st.booleans(), label="bias") else None, top_k=top_k)
    kw.update(n_group=n_group, topk_group=topk_group, renormalize=d(st.booleans()), scoring=scoring)
    kw["routed_scaling_factor"] = d(st.floats(0, 3))
    if mutation == "logits_dtype":
        kw["logits"] = logits.to(d.pick([torch.bfloat16, torch.float64, torch.int32]))
    elif mutation == "logits_ndim":
        kw["logits"] = logits[None]
    elif mutation == "bias_shape":
        kw["bias"] = d.randn(experts + 1)
    elif mutation == "bias_dtype":
        kw["bias"] = d.randn(experts, dtype=torch.bfloat16)
    elif mutation == "n_group":
        kw["n_group"] = d.pick([0, experts + 1, -1])
    elif mutation == "topk_group":
        kw["topk_group"] = d.pick([0, n_group + 1])
    elif mutation == "top_k":
        kw["top_k"] = topk_group * group_size + d.int(1, 2)
    elif mutation == "top_k_zero":
        kw["top_k"] = d.pick([0, -1, 1.0, None])
    elif mutation == "scoring":
        kw["scoring"] = d.pick(["relu", None, "Sigmoid"])
    elif mutation == "scale":
        kw["routed_scaling_factor"] = d.pick([-1.0, "2.5", None])
    elif mutation == "scale_nan":
        kw["routed_scaling_factor"] = math.nan
    elif mutation == "meta":
        kw["bias"] = on_meta(d.randn(experts))
    elif mutation == "singleton_groups":
        kw["logits"] = d.randn(tokens, n_group)
        kw.update(bias=None, topk_group=1, top_k=1)

    def check(res):
        w, ids = res
        assert is_tensor(w, (tokens, top_k), torch.float32) and is_tensor(ids, (tokens, top_k), torch.int32)
        assert bool(((ids >= 0) & (ids < experts)).all())
        assert all(len(set(row)) == top_k for row in ids.tolist())

    expect(ops.moe_route, kw, mutation, check)


@mutations(
    "x_type x_dtype ids_dtype ids_rows weights_shape weights_dtype experts mode meta combine_y combine_handle "
    "capacity_small capacity_normal ids_range"
)
@fuzz(15)
@given(data=st.data())
def test_ep_dispatch_combine_validation(mutation, data):
    """ep_dispatch: rows, ids, weights, layout and handle of the documented shapes (then ep_combine [T, H']), or
    InputError; ep_combine rejects a wrong y or handle."""
    d = Draw(data)
    fp8 = d(st.booleans(), label="fp8 x")
    tokens = d.int(int(mutation in ("capacity_small", "ids_range")), 5)
    k, experts = d.int(1, 3), d.int(1, 4)
    hidden = 128 * d.int(1, 2) if fp8 else d.int(1, 16)
    x = d.fp8(tokens, hidden, block=(1, 128)) if fp8 else d.randn(tokens, hidden, dtype=d.pick(FLOATS))
    ids = d.randint(-1, experts, tokens, k)
    if mutation == "capacity_small":
        ids[0, 0] = d.int(0, experts - 1)  # some expert receives a row
    modes = {"capacity_small": ["low_latency"], "capacity_normal": ["normal"]}.get(mutation, ["normal", "low_latency"])
    mode = d.pick(modes)
    most = int(torch.bincount(ids[ids >= 0].long(), minlength=experts).max()) if bool((ids >= 0).any()) else 0
    capacity = d.pick([None, most, most + 2]) if mode == "low_latency" else None
    kw = dict(x=x, ids=ids, weights=torch.rand(tokens, k, generator=d.gen), num_experts=experts, mode=mode)
    if capacity is not None:
        kw["capacity"] = capacity
    if mutation == "x_type":
        kw["x"] = d.pick(NOT_A_TENSOR)
    elif mutation == "x_dtype":
        kw["x"] = QTensor(x.data, x.scale, (128, 128)) if fp8 else x.to(d.pick(NOT_FLOAT))
    elif mutation == "ids_dtype":
        kw["ids"] = ids.long()
    elif mutation == "ids_rows":
        kw["ids"] = d.randint(0, experts, tokens + 1, k)
    elif mutation == "weights_shape":
        kw["weights"] = torch.rand(tokens, k + 1)
    elif mutation == "weights_dtype":
        kw["weights"] = kw["weights"].to(d.pick([torch.bfloat16, torch.float64]))
    elif mutation == "experts":
        kw["num_experts"] = d.pick([0, -2, 2.0, None])
    elif mutation == "mode":
        kw["mode"] = d.pick(["fast", None])
    elif mutation == "meta":
        kw["weights"] = on_meta(kw["weights"])
    elif mutation == "capacity_small":
        kw["capacity"] = most - 1
    elif mutation == "capacity_normal":
        kw["capacity"] = d.int(0, 4)
    elif mutation == "ids_range":
        kw["ids"] = ids.clone()
        kw["ids"][0, 0] = d.pick([-2, experts, experts + 3])
    dispatch_mutation = None if mutation in ("combine_y", "combine_handle") else mutation
    room = kw.get("capacity") if kw.get("capacity") is not None else tokens
    if dispatch_mutation is None and mode == "low_latency" and most > room:
        dispatch_mutation = mutation = "overflow"  # a token naming one expert twice can overflow the default T
    lead = None

    def check(res):
        nonlocal lead
        recv_x, recv_ids, recv_w, layout, handle = res
        # one process, normal mode: a row per pair, the skipped ones (id -1, weight 0) last
        lead = (tokens * k,) if mode == "normal" else (experts, capacity if capacity is not None else tokens)
        assert tuple(recv_x.shape) == (*lead, hidden) and isinstance(recv_x, QTensor) == fp8
        assert is_tensor(recv_ids, lead, torch.int32) and is_tensor(recv_w, lead, torch.float32)
        offsets, masked = layout.expert_offsets, layout.masked_m
        if mode == "normal":
            assert masked is None and is_tensor(offsets, (experts + 1,), torch.int32)
            valid_pairs = int((ids >= 0).sum())
            assert int(offsets[-1]) == tokens * k and bool((recv_ids[:valid_pairs] >= 0).all())
            assert bool((recv_ids[valid_pairs:] == -1).all()) and bool((recv_w[valid_pairs:] == 0).all())
        else:
            assert offsets is None and is_tensor(masked, (experts,), torch.int32)
        assert isinstance(handle, DispatchHandle)

    dispatched = []
    expect(lambda **a: dispatched.append(ops.ep_dispatch(**a)) or dispatched[-1], kw, dispatch_mutation, check)
    if dispatch_mutation is not None:
        return
    out_hidden = d.int(1, 5)
    y = d.randn(*lead, out_hidden, dtype=d.pick(FLOATS))
    ckw = dict(y=y, handle=dispatched[0][4])
    if mutation == "combine_y":
        ckw["y"] = d.pick([d.randn(*lead[:-1], lead[-1] + 1, out_hidden), y.to(torch.int32), y[..., 0], None])
    elif mutation == "combine_handle":
        ckw["handle"] = d.pick([None, "handle", (1, 2)])
    expect(ops.ep_combine, ckw, mutation, shaped((tokens, out_hidden), y.dtype))


@mutations("x_0d x_dtype w_shape res_dtype res_shape eps eps_nan meta w_type")
@fuzz(15)
@given(data=st.data())
def test_rms_norm_validation(mutation, data):
    """rms_norm: (y, h) both like x, or InputError."""
    d = Draw(data)
    shape = d(st.lists(st.integers(0, 3), min_size=1, max_size=3), label="shape")
    dtype = d.pick(FLOATS)
    x = d.randn(*shape, dtype=dtype)
    residual = d.randn(*shape, dtype=dtype) if d(st.booleans(), label="residual") else None
    kw = dict(x=x, w=d.randn(shape[-1], dtype=d.pick(FLOATS)), eps=d(st.floats(0, 1e-3)), residual=residual)
    if mutation == "x_0d":
        kw["x"], kw["residual"] = torch.tensor(1.5, dtype=dtype), None
    elif mutation == "x_dtype":
        kw["x"] = x.to(d.pick(NOT_FLOAT))
    elif mutation == "w_shape":
        kw["w"] = d.randn(shape[-1] + 1)
    elif mutation == "res_dtype":
        kw["residual"] = x.to(d.pick([t for t in (*FLOATS, torch.int32) if t != dtype]))
    elif mutation == "res_shape":
        kw["residual"] = d.randn(*shape, 1, dtype=dtype)
    elif mutation == "eps":
        kw["eps"] = d.pick([-1e-6, "1e-6", None])
    elif mutation == "eps_nan":
        kw["eps"] = math.nan
    elif mutation == "meta":
        kw["w"] = on_meta(kw["w"])
    elif mutation == "w_type":
        kw["w"] = d.pick(NOT_A_TENSOR)

    def check(res):
        assert is_tensor(res[0], shape, dtype) and is_tensor(res[1], shape, dtype)

    expect(ops.rms_norm, kw, mutation, check)


V3_YARN_FIELDS = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096}


@pytest.mark.parametrize(
    ("args", "arg"),
    [
        ((0, 32), "rotary_dim"),
        ((5, 32), "rotary_dim"),
        ((64, 0), "max_position"),
        ((64, 8, math.inf), "base"),
        ((64, 8, 0.0), "base"),
        ((64, 8, 10000.0, {"rope_type": "linear", "factor": 2.0}), "scaling"),
        ((64, 8, 10000.0, [("rope_type", "yarn")]), "scaling"),
        ((64, 8, 10000.0, {"rope_type": "yarn", "original_max_position_embeddings": 4}), "scaling"),
        ((64, 8, 10000.0, {"rope_type": "yarn", "factor": 4.0}), "scaling"),
        ((64, 8, 10000.0, {"rope_type": "yarn", "factor": 0, "original_max_position_embeddings": 4}), "scaling"),
        ((64, 8, 10000.0, {"rope_type": "yarn", "factor": -2, "original_max_position_embeddings": 4}), "scaling"),
        ((64, 8, 10000.0, {"rope_type": "yarn", "factor": math.nan, "original_max_position_embeddings": 4}), "scaling"),
        ((64, 8, 10000.0, {"rope_type": "yarn", "factor": "4", "original_max_position_embeddings": 4}), "scaling"),
        ((64, 8, 10000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}), "scaling"),
        ((64, 8, 10000.0, {**V3_YARN_FIELDS, "beta_fast": -1.0}), "scaling"),
        ((64, 8, 10000.0, {**V3_YARN_FIELDS, "mscale": math.nan, "mscale_all_dim": 1.0}), "scaling"),
        ((64, 8, 10000.0, {**V3_YARN_FIELDS, "attention_factor": -1.0}), "scaling"),
        ((64, 8, 1.0, V3_YARN_FIELDS), "base"),
    ],
)
def test_rope_table_rejects_arguments_that_give_no_table(args, arg):
    """A rotary dim of 0 (an empty table), an odd one, no positions, a base that makes every angle 0 or NaN, an
    unknown scaling, a scaling that is not a dict, YaRN fields missing or giving a NaN, infinite or negative table
    (or dividing by log(base) = 0): InputError naming the argument, never a table or a KeyError."""
    with pytest.raises(InputError) as raised:
        ops.rope_cos_sin_cache(*args)
    assert raised.value.arg == arg


@mutations("odd_dim pos_dtype pos_length table_dtype table_dim interleaved x_ndim meta pos_range")
@fuzz(15)
@given(data=st.data())
def test_rope_validation(mutation, data):
    """rope: a tensor like x, or InputError."""
    d = Draw(data)
    tokens = d.int(int(mutation == "pos_range"), 4)
    heads, dim, max_pos = d.int(0, 3), 2 * d.int(0, 8), d.int(1, 20)
    dtype = d.pick(FLOATS)
    table = ops.rope_cos_sin_cache(dim, max_pos) if dim else torch.zeros(max_pos, 0)
    x = d.randn(tokens, heads, dim, dtype=dtype)
    kw = dict(x=x, positions=d.randint(0, max_pos, tokens), cos_sin_cache=table, interleaved=d(st.booleans()))
    if mutation == "odd_dim":
        kw["x"] = d.randn(tokens, heads, dim + 1, dtype=dtype)
        kw["cos_sin_cache"] = torch.zeros(max_pos, dim + 1)
    elif mutation == "pos_dtype":
        kw["positions"] = kw["positions"].long()
    elif mutation == "pos_length":
        kw["positions"] = d.randint(0, max_pos, tokens + 1)
    elif mutation == "table_dtype":
        kw["cos_sin_cache"] = table.to(d.pick([torch.bfloat16, torch.float64]))
    elif mutation == "table_dim":
        kw["cos_sin_cache"] = torch.zeros(max_pos, dim + 2)
    elif mutation == "interleaved":
        kw["interleaved"] = d.pick([1, None, "true"])
    elif mutation == "x_ndim":
        kw["x"] = x.flatten(1)
    elif mutation == "meta":
        kw["cos_sin_cache"] = on_meta(table)
    elif mutation == "pos_range":
        kw["positions"] = kw["positions"].clone()
        kw["positions"][0] = d.pick([-1, max_pos, max_pos + 9])
    expect(ops.rope, kw, mutation, shaped(x.shape, dtype))


@mutations("odd ndim dtype quantize_flag scale_format unaligned")
@fuzz(15)
@given(data=st.data())
def test_silu_and_mul_validation(mutation, data):
    """silu_and_mul: [..., I] in x's dtype, or an FP8 QTensor [..., I] with (1, 128) scales; or InputError."""
    d = Draw(data)
    quantize = d(st.booleans(), label="quantize")
    lead = d(st.lists(st.integers(0, 3), min_size=1, max_size=2), label="lead")
    inner = 128 * d.int(0, 2) if quantize else d.int(0, 9)
    dtype = d.pick(FLOATS)
    x = d.randn(*lead, 2 * inner, dtype=dtype)
    kw = dict(x=x, quantize=quantize, scale_format=d.pick(["fp32", "ue8m0"]))
    if mutation == "odd":
        kw["x"] = d.randn(*lead, 2 * inner + 1, dtype=dtype)
    elif mutation == "ndim":
        kw["x"] = d.randn(2 * inner) if d(st.booleans()) else d.randn(1, 1, 1, 2 * inner)
    elif mutation == "dtype":
        kw["x"] = x.to(d.pick(NOT_FLOAT))
    elif mutation == "quantize_flag":
        kw["quantize"] = d.pick([1, None, "yes"])
    elif mutation == "scale_format":
        kw["scale_format"] = d.pick(["e8m0", None])
    elif mutation == "unaligned":
        kw["quantize"], kw["x"] = True, d.randn(*lead, 2 * (128 * d.int(0, 1) + d.int(1, 127)))

    def check(out):
        if quantize:
            assert isinstance(out, QTensor) and out.block == (1, 128) and out.scale_format == kw["scale_format"]
            assert is_tensor(out.data, (*lead, inner), FP8) and is_tensor(
                out.scale, (*lead, inner // 128), torch.float32
            )
        else:
            assert is_tensor(out, (*lead, inner), dtype)

    expect(ops.silu_and_mul, kw, mutation, check)


SAMPLE_VALUES = ["temp_negative", "temp_inf", "top_p_zero", "top_p_big", "top_p_nan", "top_k_negative"]


@mutations("vocab logits_ndim temp_dtype top_p_shape top_k_dtype seeds_dtype meta " + " ".join(SAMPLE_VALUES))
@fuzz(15)
@given(data=st.data())
def test_sample_validation(mutation, data):
    """sample: [B] int32 tokens in [0, V), or InputError."""
    d = Draw(data)
    values = SAMPLE_VALUES
    batch, vocab = d.int(int(mutation in values), 4), d.int(1, 6)
    logits = d.randn(batch, vocab, dtype=d.pick(FLOATS))
    kw = dict(
        logits=logits, temperature=torch.rand(batch, generator=d.gen) * 2 * (torch.rand(batch, generator=d.gen) > 0.3),
        top_p=1 - torch.rand(batch, generator=d.gen) * 0.99, top_k=d.randint(0, vocab + 2, batch),
        seeds=d.randint(-(2**62), 2**62, batch, dtype=torch.int64),
    )  # fmt: skip
    if mutation == "vocab":
        kw["logits"] = d.randn(batch, 0)
    elif mutation == "logits_ndim":
        kw["logits"] = logits[None]
    elif mutation == "temp_dtype":
        kw["temperature"] = kw["temperature"].to(d.pick([torch.float64, torch.bfloat16]))
    elif mutation == "top_p_shape":
        kw["top_p"] = torch.ones(batch + 1)
    elif mutation == "top_k_dtype":
        kw["top_k"] = kw["top_k"].long()
    elif mutation == "seeds_dtype":
        kw["seeds"] = kw["seeds"].int()
    elif mutation == "meta":
        kw["seeds"] = on_meta(kw["seeds"])
    elif mutation in values:
        arg, value = {
            "temp_negative": ("temperature", -0.5), "temp_inf": ("temperature", d.pick([math.inf, math.nan])),
            "top_p_zero": ("top_p", d.pick([0.0, -0.1])), "top_p_big": ("top_p", 1.01),
            "top_p_nan": ("top_p", math.nan), "top_k_negative": ("top_k", -1),
        }[mutation]  # fmt: skip
        kw[arg] = kw[arg].clone()
        kw[arg][d.int(0, batch - 1)] = value

    def check(out):
        assert is_tensor(out, (batch,), torch.int32) and bool(((out >= 0) & (out < vocab)).all())

    expect(ops.sample, kw, mutation, check)


# ---------------------------------------------------------------------------------------------------------------
# References against the independent formulations, at hypothesis-chosen shapes
# ---------------------------------------------------------------------------------------------------------------


@fuzz(40)
@given(st.data())
def test_gemm_reference_fuzz(data):
    """gemm equals F.linear in fp64 (float operands) or the per-K-block FP8 accumulation (FP8 weight, FP8 or
    float activation quantised per 1x128), within the fp32 dot-product bound."""
    d = Draw(data)
    m, n = d.int(0, 6), d.int(1, 300)
    kind = d.pick(["float", "fp8", "fp8_float_a"])
    if kind == "float":
        k, dtype = d.int(1, 64), d.pick(FLOATS)
        a, w = d.randn(m, k, dtype=dtype), d.randn(n, k, dtype=dtype)
        av, wv = a.double(), w.double()
        expected = F.linear(av, wv)
    else:
        k, fmt = 128 * d.int(1, 3), d.pick(["fp32", "ue8m0"])
        w = random_fp8_weight(d.gen, n, k, scale_format=fmt)
        x = d.randn(m, k, scale=d(st.floats(1e-6, 1e3)), dtype=d.pick(FLOATS))
        data_, scale = act_quant(x, 128, fmt)
        a = x if kind == "fp8_float_a" else QTensor(data_, scale, (1, 128), fmt)
        av, wv = dequant(data_, scale, (1, 128)), dequant(w.data, w.scale, (128, 128))
        expected = blockwise_fp8_gemm(data_, scale, w.data, w.scale)
    out = ops.gemm(a, w, out_dtype=torch.float32)
    assert out.shape == (m, n)
    bound = dot_bound(av.abs(), wv.abs(), k)
    assert bool(((out.double() - expected).abs() <= bound).all())


@fuzz(30)
@given(st.data())
def test_grouped_gemm_reference_fuzz(data):
    """grouped_gemm (contiguous or masked, bf16 or FP8) equals a per-expert F.linear loop on dequantised values."""
    d = Draw(data)
    experts, n = d.int(1, 4), d.int(1, 140)
    fp8, masked = d(st.booleans(), label="fp8"), d(st.booleans(), label="masked")
    k = 128 * d.int(1, 2) if fp8 else d.int(1, 48)
    counts = [d.int(0, 3) for _ in range(experts)]
    lead = (experts, max(counts) + d.int(0, 1)) if masked else (sum(counts),)
    if fp8:
        fmt = d.pick(["fp32", "ue8m0"])
        w = random_fp8_weight(d.gen, experts, n, k, scale_format=fmt)
        wv = dequant(w.data, w.scale, (128, 128))
        x = d.randn(*lead, k, dtype=torch.bfloat16)
        data_, scale = act_quant(x, 128, fmt)
        a = x if d(st.booleans(), label="float a") else QTensor(data_, scale, (1, 128), fmt)
        av = dequant(data_, scale, (1, 128))
    else:
        a = d.randn(*lead, k, dtype=d.pick(FLOATS))
        w = d.randn(experts, n, k, dtype=a.dtype)
        av, wv = a.double(), w.double()
    if masked:
        out = ops.grouped_gemm(a, w, masked_m=torch.tensor(counts, dtype=torch.int32), out_dtype=torch.float32)
        rows = [(out[e, :c], av[e, :c]) for e, c in enumerate(counts)]
    else:
        offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
        out = ops.grouped_gemm(a, w, expert_offsets=offsets, out_dtype=torch.float32)
        rows = [(out[offsets[e] : offsets[e + 1]], av[offsets[e] : offsets[e + 1]]) for e in range(experts)]
    for e, (got, a_e) in enumerate(rows):
        err = (got.double() - F.linear(a_e, wv[e])).abs()
        assert bool((err <= dot_bound(a_e.abs(), wv[e].abs(), k)).all()), f"expert {e}"


@fuzz(30)
@given(st.data())
def test_mla_decode_reference_fuzz(data):
    """Absorbed mla_decode over scattered pages equals decompressed MLA for hypothesis-chosen sizes, page sizes,
    sequence lengths (including 0 and shorter than S_q) and S_q."""
    d = Draw(data)
    dims = dict(heads=d.int(1, 3), nope=d.int(1, 8), rope=d.int(1, 8), v=d.int(1, 6), lora=d.int(1, 24))
    s_q, block_size = d.int(1, 3), d.int(1, 5)
    seq_lens = d(st.lists(st.integers(0, 14), min_size=1, max_size=4), label="seq_lens")
    p = mla_problem(d.gen, seq_lens, s_q, block_size, **dims)
    scale = (dims["nope"] + dims["rope"]) ** -0.5
    out, lse = ops.mla_decode(
        p["q"], p["cache"], p["table"], torch.tensor(seq_lens, dtype=torch.int32), softmax_scale=scale,
        kv_lora_rank=dims["lora"],
    )  # fmt: skip
    check_mla_against_decompressed(p, out, lse, seq_lens, s_q, scale, dims["lora"])


@fuzz(30)
@given(st.data())
def test_moe_route_reference_fuzz(data):
    """moe_route equals transformers' DeepseekV3TopkRouter (ids as sets, weights to fp32 rounding) for
    hypothesis-chosen group layouts, top-k, renormalisation and scaling."""
    d = Draw(data)
    n_group = d.int(1, 4)
    group_size = d.int(2, 8)
    topk_group = d.int(1, n_group)
    top_k = d.int(1, topk_group * group_size)
    kw = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, renormalize=d(st.booleans()))
    scale = d(st.floats(0.1, 4))
    logits = d.randn(d.int(1, 8), n_group * group_size, scale=d(st.floats(0.1, 5)))
    bias = d.randn(n_group * group_size, scale=d(st.floats(0, 1))) if d(st.booleans(), label="bias") else None
    w, ids = sorted_by_id(*ops.moe_route(logits, bias, **kw, routed_scaling_factor=scale))
    hw, hids = sorted_by_id(*hf_route(logits, bias, **kw, scale=scale))
    assert torch.equal(ids, hids)
    torch.testing.assert_close(w, hw, rtol=4 * 2.0**-23, atol=0.0)


def test_value_checks_context(monkeypatch):
    """``value_checks(False)`` skips the checks that read index values inside its block only; nested blocks and
    ``DEEPINFER_VALUE_CHECKS=0`` combine as documented."""
    x, cache = torch.randn(3, 2, 8), torch.randn(16, 8)
    bad = torch.tensor([0, 5, 16])  # 16 is past the cache
    with pytest.raises(InputError, match="positions"):
        ops.rope(x, bad, cache)
    with deepinfer.value_checks(False):
        assert not deepinfer.validation.value_checks_enabled(bad)
        with deepinfer.value_checks(True):
            assert deepinfer.validation.value_checks_enabled(bad)
            with pytest.raises(InputError, match="positions"):
                ops.rope(x, bad, cache)
        assert not deepinfer.validation.value_checks_enabled(bad)
    assert deepinfer.validation.value_checks_enabled(bad)
    monkeypatch.setenv("DEEPINFER_VALUE_CHECKS", "0")
    with deepinfer.value_checks(True):
        assert not deepinfer.validation.value_checks_enabled(bad)


def test_messages_name_dtypes_and_ranges_in_one_format():
    """Dtypes as torch prints them (``torch.bfloat16``) in every message, whichever check raised; a one-sided range
    is written as a bound, never with ``None``."""
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(InputError) as by_list:
        ops.rms_norm(x.int(), torch.ones(64, dtype=torch.bfloat16), 1e-6)
    assert "expected dtype torch.bfloat16 or torch.float16 or torch.float32, got dtype torch.int32" in str(
        by_list.value
    )
    with pytest.raises(InputError) as by_operand:
        ops.gemm(x, torch.zeros(8, 64, dtype=torch.float16), out_dtype=torch.bfloat16)
    assert "expected dtype torch.bfloat16 (the dtype of 'a') or torch.float32, got dtype torch.float16" in str(
        by_operand.value
    )
    with pytest.raises(InputError) as by_range:
        ops.rms_norm(x, torch.ones(64, dtype=torch.bfloat16), -1.0)
    assert str(by_range.value) == "rms_norm: argument 'eps': expected a finite number >= 0.0, got -1.0"
