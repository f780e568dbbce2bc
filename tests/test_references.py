"""Each reference implementation against an independent formulation, on fresh random data.

The independent formulations are written here from the op contracts and from Hugging Face transformers'
DeepseekV3 modules: decompressed MLA in fp64, a per-K-block FP8 GEMM, per-expert ``F.linear`` loops, a dense
per-token MoE, ``scaled_dot_product_attention`` with explicit masks, a byte-level decoder of ``fp8_ds_mla`` records
and a sort-based top-k/top-p filter. Every tolerance is derived next to the comparison that uses it.

Each run draws new data; ``DEEPINFER_TEST_SEED=<n>`` replays a run (the seed is printed with a failure).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from reference_helpers import U32, g_fixture, on_reference_fixture, randn  # noqa: F401 (fixtures)

from deepinfer import FP4Tensor, InputError, QTensor, ops
from deepinfer.reference import attention as reference_attention

FP8 = torch.float8_e4m3fn


def randint(g: torch.Generator, low: int, high: int, *shape: int, dtype=torch.int32) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=g).to(dtype)


# ---------------------------------------------------------------------------------------------------------------
# Independent formulations shared with test_validation_fuzz.py
# ---------------------------------------------------------------------------------------------------------------


def pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= s (> 0), from the fp32 exponent, with no logarithm."""
    mant, exp = torch.frexp(s)  # s = mant * 2**exp, mant in [0.5, 1)
    return torch.ldexp(torch.ones_like(s), exp - (mant == 0.5).to(exp.dtype))


def act_quant(x: torch.Tensor, block: int = 128, scale_format: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's per-(1, block) activation quantisation: (e4m3 data, fp32 scales [..., K / block])."""
    xb = x.float().unflatten(-1, (-1, block))
    scale = torch.maximum(xb.abs().amax(-1), torch.tensor(1e-4)) / 448.0
    if scale_format == "ue8m0":
        scale = pow2_ceil(scale)
    data = (xb / scale.unsqueeze(-1)).clamp(-448.0, 448.0).to(FP8).flatten(-2)
    return data, scale


def e4m3_error_bound(y: torch.Tensor) -> torch.Tensor:
    """Largest |e4m3(y) - y| for |y| <= 448: half the e4m3 spacing at y (2^(e-4) in binade 2^e, 2^-10 subnormal)."""
    e = torch.floor(torch.log2(y.abs().double().clamp_min(2.0**-6)))
    return torch.exp2(e - 4) * (1 + 1e-9)


def dequant(data: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp64 values of FP8 data with block scales (independent of ``QTensor.dequantize``)."""
    m, k = data.shape[-2:]
    s = scale.double()
    s = s.repeat_interleave(block[0], -2)[..., :m, :].repeat_interleave(block[1], -1)[..., :k]
    return data.double() * s


def random_fp8_weight(g: torch.Generator, *shape: int, scale_format: str = "fp32") -> QTensor:
    """A (128, 128)-block FP8 weight with random e4m3 data and random scales (not made by the code under test)."""
    data = (torch.randn(*shape, generator=g) * 64).clamp(-448, 448).to(FP8)
    sshape = (*shape[:-2], math.ceil(shape[-2] / 128), math.ceil(shape[-1] / 128))
    if scale_format == "ue8m0":
        scale = torch.exp2(torch.randint(-12, -4, sshape, generator=g).float())
    else:
        scale = (torch.rand(sshape, generator=g) + 0.5) * 2.0**-8
    return QTensor(data, scale, (128, 128), scale_format)


def dot_bound(a_abs: torch.Tensor, w_abs: torch.Tensor, k: int) -> torch.Tensor:
    """Rounding bound of an fp32 NT product whose operands carry one fp32 rounding each (dequantisation):
    |fl(a.w) - a.w| <= (K + 2) u sum|a_i w_i|, in any summation order (Higham's gamma_n)."""
    return (k + 2) * U32 * (a_abs @ w_abs.transpose(-1, -2)) * 1.01 + 1e-30


def blockwise_fp8_gemm(a_data, a_scale, w_data, w_scale) -> torch.Tensor:
    """DeepSeek's fp8_gemm: sum over 128-wide K blocks of (a_blk @ w_blk.T) * a_scale * w_scale, in fp64."""
    m, k = a_data.shape
    n = w_data.shape[0]
    w_rows = w_scale.double().repeat_interleave(128, 0)[:n]  # [N, K/128]
    out = torch.zeros(m, n, dtype=torch.float64)
    for kb in range(k // 128):
        blk = slice(kb * 128, (kb + 1) * 128)
        acc = a_data[:, blk].double() @ w_data[:, blk].double().T
        out += acc * a_scale[:, kb : kb + 1].double() * w_rows[None, :, kb]
    return out


def naive_mla(q_nope, q_rope, c, k_rope, w_uk, w_uv, scale):
    """Decompressed MLA of one sequence in fp64 (the S new queries are the last S of the n cached tokens).

    q_nope [S, H, P], q_rope [S, H, R], c [n, L], k_rope [n, R], w_uk [H, P, L], w_uv [H, L, V].
    Returns out [S, H, V], lse [S, H], probs [H, S, n].
    """
    q_nope, q_rope, c, k_rope, w_uk, w_uv = (t.double() for t in (q_nope, q_rope, c, k_rope, w_uk, w_uv))
    s_q, heads = q_nope.shape[:2]
    n = c.shape[0]
    if n == 0:
        blind = torch.full((s_q, heads), -math.inf, dtype=torch.float64)
        return torch.zeros(s_q, heads, w_uv.shape[2], dtype=torch.float64), blind, torch.zeros(heads, s_q, 0)
    k = torch.cat([torch.einsum("nl,hpl->nhp", c, w_uk), k_rope[:, None, :].expand(n, heads, -1)], dim=-1)
    v = torch.einsum("nl,hlv->nhv", c, w_uv)
    q = torch.cat([q_nope, q_rope], dim=-1)
    scores = torch.einsum("shd,nhd->hsn", q, k) * scale
    visible = torch.arange(n)[None, :] < (n - s_q + torch.arange(s_q) + 1)[:, None]  # [S, n]
    scores = scores.masked_fill(~visible, -math.inf)
    peak = scores.amax(-1, keepdim=True).nan_to_num(neginf=0.0)
    total = torch.exp(scores - peak).sum(-1)
    lse = (peak.squeeze(-1) + torch.log(total)).transpose(0, 1)  # log(0) = -inf where nothing is visible
    probs = torch.exp(scores - peak) / total.clamp_min(1e-300).unsqueeze(-1)
    return torch.einsum("hsn,nhv->shv", probs, v), lse, probs


def hf_route(logits, bias, *, top_k, n_group, topk_group, renormalize, scale):
    """transformers' DeepseekV3TopkRouter on router logits equal to ``logits`` (identity gate, hidden = logits)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    num_experts = logits.shape[1]
    config = DeepseekV3Config(
        hidden_size=num_experts,
        n_routed_experts=num_experts,
        num_experts_per_tok=top_k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=renormalize,
        routed_scaling_factor=scale,
    )
    router = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.eye(num_experts))
        router.e_score_correction_bias.copy_(torch.zeros(num_experts) if bias is None else bias)
        router_logits, weights, ids = router(logits)
    assert torch.equal(router_logits, logits)  # the identity gate passes the logits through exactly
    return weights, ids


def sorted_by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) of each row ordered by expert id, so rows compare as sets of (id, weight) pairs."""
    order = ids.long().argsort(dim=-1)
    return weights.gather(1, order), ids.long().gather(1, order)


def paged_layout(g: torch.Generator, seq_lens: list[int], block_size: int, spare: int = 3):
    """Scattered pages: (num_blocks, block_table [B, max_blocks] int32, slots of each sequence's tokens)."""
    pages = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(pages) + spare
    order = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.zeros(len(seq_lens), max(max(pages), 1), dtype=torch.int32)
    slots = []
    for b, (n, p) in enumerate(zip(seq_lens, pages)):
        table[b, :p] = torch.tensor(order[:p], dtype=torch.int32)
        order = order[p:]
        table[b, p:] = order[0]  # unused entries name a page the sequence does not own
        pos = torch.arange(n)
        slots.append(table[b, pos // block_size].long() * block_size + pos % block_size)
    return num_blocks, table, slots


# ---------------------------------------------------------------------------------------------------------------
# mla_decode: absorbed attention over the paged latent cache == decompressed MLA
# ---------------------------------------------------------------------------------------------------------------

H, NOPE, ROPE_D, V_D, LORA = 4, 16, 32, 24, 256
MLA_DIMS = dict(heads=H, nope=NOPE, rope=ROPE_D, v=V_D, lora=LORA)


def mla_problem(g, seq_lens, s_q, block_size, *, heads, nope, rope, v, lora):
    """A tiny MLA layer and a batch of sequences in a NaN-filled paged bf16 cache (bf16-representable data)."""
    bf = lambda *s, scale=1.0: randn(g, *s, scale=scale, dtype=torch.bfloat16).double()
    w_uk, w_uv = bf(heads, nope, lora, scale=lora**-0.5), bf(heads, lora, v, scale=lora**-0.5)
    latents = [bf(n, lora + rope) for n in seq_lens]
    q_nope, q_rope = bf(len(seq_lens), s_q, heads, nope), bf(len(seq_lens), s_q, heads, rope)
    num_blocks, table, slots = paged_layout(g, seq_lens, block_size)
    cache = torch.full((num_blocks, block_size, lora + rope), math.nan, dtype=torch.bfloat16)
    for lat, sl in zip(latents, slots):
        cache.view(-1, lora + rope)[sl] = lat.to(torch.bfloat16)
    q_lat = torch.einsum("bshp,hpl->bshl", q_nope, w_uk)  # q_nope absorbed into the latent space
    q = torch.cat([q_lat, q_rope], dim=-1).float()
    return dict(
        w_uk=w_uk, w_uv=w_uv, latents=latents, q_nope=q_nope, q_rope=q_rope, q=q, cache=cache, table=table,
        slots=slots,
    )  # fmt: skip


def check_mla_against_decompressed(p, out, lse, seq_lens, s_q, scale, lora, latents=None) -> None:
    """out @ W_UV and lse of each sequence equal fp64 decompressed MLA over ``latents`` (default: the cache's).

    The op differs from this formulation only by fp32 rounding: of q_lat (2^-24 relative) and of the <= 300-term
    scores and <= 40-term sums, about 300 u = 2e-5 relative on these O(1) values (measured: ~3e-7).
    """
    for b, n in enumerate(seq_lens):
        lat = (p["latents"] if latents is None else latents)[b]
        ref_out, ref_lse, _ = naive_mla(
            p["q_nope"][b], p["q_rope"][b], lat[:, :lora], lat[:, lora:], p["w_uk"], p["w_uv"], scale
        )
        got = torch.einsum("shl,hlv->shv", out[b].double(), p["w_uv"])
        where = f"sequence {b} (length {n})"
        torch.testing.assert_close(got, ref_out, atol=2e-5, rtol=0, msg=lambda m, w=where: f"{w}: {m}")
        torch.testing.assert_close(lse[b].double(), ref_lse, atol=2e-5, rtol=0, msg=lambda m, w=where: f"{w}, lse: {m}")
        blind = torch.isinf(ref_lse)  # queries that see no position (n < S_q - i)
        assert bool((blind == (n - s_q + torch.arange(s_q) + 1 <= 0)[:, None]).all())
        assert bool((out[b][blind] == 0).all()) and bool((lse[b][blind] == -math.inf).all())


def decode_fp8_ds_mla(records: torch.Tensor, lora: int) -> torch.Tensor:
    """fp64 latents of fp8_ds_mla records [n, width], read byte by byte: e4m3 | fp32 scales | bf16 rope."""
    groups = lora // 128
    field = lambda lo, hi, dtype: records[:, lo:hi].clone(memory_format=torch.contiguous_format).view(dtype).double()
    data = field(0, lora, FP8).view(-1, groups, 128)
    scales = field(lora, lora + 4 * groups, torch.float32)
    rope = field(lora + 4 * groups, None, torch.bfloat16)
    return torch.cat([(data * scales[..., None]).flatten(1), rope], dim=1)


@pytest.mark.parametrize(("s_q", "block_size"), [(1, 4), (3, 4), (3, 5)])
def test_mla_decode_absorbed_equals_decompressed(g, s_q, block_size):
    """Absorbed mla_decode over scattered pages, then out @ W_UV, equals decompressed MLA; lse equals an fp64
    logsumexp of the decompressed scores; queries that see nothing give zeros and -inf."""
    seq_lens = [0, 1, 2, 9, 23, 40]
    p = mla_problem(g, seq_lens, s_q, block_size, **MLA_DIMS)
    scale = (NOPE + ROPE_D) ** -0.5
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out, lse = ops.mla_decode(p["q"], p["cache"], p["table"], lens, softmax_scale=scale, kv_lora_rank=LORA)
    assert out.shape == (len(seq_lens), s_q, H, LORA) and out.dtype == torch.float32
    assert lse.shape == (len(seq_lens), s_q, H) and lse.dtype == torch.float32
    check_mla_against_decompressed(p, out, lse, seq_lens, s_q, scale, LORA)


def test_mla_decode_fp8_ds_mla_within_quantisation_bound(g):
    """mla_decode over an fp8_ds_mla cache equals decompressed MLA over the latents decoded byte by byte from the
    records, and stays within a derived bound of the bf16-cache result.

    Bound: each latent value carries |dc| <= 2^-4 |c| + 2^-10 s (e4m3 rounding at a power-of-two scale s), the
    rope part is stored exactly. A score moves by at most eps = scale * sum_l |q_lat_l| dc_l, so every probability
    by a factor in [e^-2eps, e^2eps]; hence |d out| <= max_j dc_j + (e^2eps - 1) max_j |c_j + dc_j| and
    |d lse| <= eps (plus fp32 noise).
    """
    seq_lens, s_q = [3, 17, 30], 3
    p = mla_problem(g, seq_lens, s_q, 8, **MLA_DIMS)
    scale = (NOPE + ROPE_D) ** -0.5
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    cache8 = torch.full((*p["cache"].shape[:2], LORA + 4 * (LORA // 128) + 2 * ROPE_D), 0xFF, dtype=torch.uint8)
    flat16 = p["cache"].view(-1, p["cache"].shape[-1])
    written = torch.nonzero(~flat16[:, 0].isnan()).squeeze(1)
    ops.write_kv_cache(flat16[written], cache8, written, kv_lora_rank=LORA)
    out16, lse16 = ops.mla_decode(p["q"], p["cache"], p["table"], lens, softmax_scale=scale, kv_lora_rank=LORA)
    out8, lse8 = ops.mla_decode(p["q"], cache8, p["table"], lens, softmax_scale=scale, kv_lora_rank=LORA)
    decoded = [decode_fp8_ds_mla(cache8.view(-1, cache8.shape[-1])[sl], LORA) for sl in p["slots"]]
    check_mla_against_decompressed(p, out8, lse8, seq_lens, s_q, scale, LORA, latents=decoded)
    for b, n in enumerate(seq_lens):
        c = p["latents"][b][:, :LORA]
        amax = c.unflatten(-1, (-1, 128)).abs().amax(-1).clamp_min(1e-4)
        s = pow2_ceil((amax / 448).float()).double().repeat_interleave(128, -1)
        dc = 2.0**-4 * c.abs() + 2.0**-10 * s  # [n, L]
        visible = torch.arange(n)[None, :] < (n - s_q + torch.arange(s_q) + 1)[:, None]  # [S, n]
        q_lat = p["q"][b, :, :, :LORA].double().abs()  # [S, H, L]
        eps = scale * torch.einsum("shl,nl->shn", q_lat, dc).masked_fill(~visible[:, None, :], 0).amax(-1)
        vis = visible[:, None, :, None]  # [S, 1, n, 1]
        max_dc = torch.where(vis, dc[None, None], 0).amax(2)  # [S, 1, L]
        max_c = torch.where(vis, (c.abs() + dc)[None, None], 0).amax(2)
        bound = max_dc + torch.expm1(2 * eps).unsqueeze(-1) * max_c + 1e-5
        err = (out8[b].double() - out16[b].double()).abs()
        assert bool((err <= bound).all()), f"sequence {b}: worst error / bound {float((err / bound).max()):.3g}"
        assert float(err.max()) > 0  # the FP8 cache was actually read
        lse_err = (lse8[b].double() - lse16[b].double()).abs().nan_to_num(0.0)
        assert bool((lse_err <= eps + 1e-5).all())


# ---------------------------------------------------------------------------------------------------------------
# moe_route == transformers' DeepseekV3TopkRouter
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("experts", "n_group", "topk_group", "top_k", "renormalize", "scale", "with_bias"),
    [
        (256, 8, 4, 8, True, 2.5, True),  # DeepSeek-V3
        (16, 4, 2, 4, True, 2.5, True),
        (8, 1, 1, 2, False, 1.0, True),
        (12, 3, 2, 5, False, 1.7, True),
        (64, 8, 3, 6, True, 1.0, False),
        (32, 4, 4, 1, True, 0.5, True),
    ],
)
def test_moe_route_matches_transformers(g, experts, n_group, topk_group, top_k, renormalize, scale, with_bias):
    """Chosen experts equal transformers' as sets per row; weights equal to fp32 rounding (the k weights are summed
    in a different order, a few ulps)."""
    logits = randn(g, 64, experts, scale=2.0)
    bias = randn(g, experts, scale=0.5) if with_bias else None  # large enough to make biased scores negative
    kw = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, renormalize=renormalize)
    w, ids = ops.moe_route(logits, bias, **kw, routed_scaling_factor=scale)
    hw, hids = hf_route(logits, bias, **kw, scale=scale)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == (64, top_k)
    w, ids = sorted_by_id(w, ids)
    hw, hids = sorted_by_id(hw, hids)
    assert torch.equal(ids, hids)
    torch.testing.assert_close(w, hw, rtol=4 * 2.0**-23, atol=0.0)


# ---------------------------------------------------------------------------------------------------------------
# quantize_fp8, gemm, grouped_gemm
# ---------------------------------------------------------------------------------------------------------------


def just_above_pow2_amax(ulps: int = 1) -> float:
    """An fp32 amax whose amax / 448 lies a few ulps above 2^-8 (where a rounded log2 picks 2^-8, too small)."""
    amax = torch.tensor(448 * 2.0**-8)
    for _ in range(ulps):
        amax = torch.nextafter(amax, torch.tensor(math.inf))
    assert float(amax / 448) > 2.0**-8
    return float(amax)


def activations(g, *lead: int, k: int, dtype=torch.bfloat16, block: int = 128) -> torch.Tensor:
    """Activations whose ``block``-groups span many magnitudes, one group below the 1e-4 amax floor and, for fp32
    (bf16 cannot hold such a value), one group whose amax / 448 lies just above a power of two."""
    spread = torch.exp(randn(g, *lead, k // block, 1, scale=4.0)).expand(*lead, k // block, block).flatten(-2)
    x = (randn(g, *lead, k) * spread).to(dtype)
    flat = x.view(-1, k)
    flat[0, :block] = (randn(g, block) * 1e-6).to(dtype)
    if dtype == torch.float32 and flat.shape[0] > 1 and k >= 2 * block:
        flat[1, block : 2 * block] = randn(g, block) * 0.1
        flat[1, block + 2] = -just_above_pow2_amax()
    return x


@pytest.mark.parametrize("scale_format", ["fp32", "ue8m0"])
@pytest.mark.parametrize(("shape", "block"), [((9, 384), 128), ((3, 5, 256), 128), ((4, 192), 64)])
def test_quantize_fp8(g, shape, block, scale_format):
    """Scales are max(amax, 1e-4)/448 per group (ue8m0: powers of two >= that and < twice it); the data is
    x / scale in e4m3; dequantisation error within half an e4m3 spacing."""
    x = activations(g, *shape[:-1], k=shape[-1], dtype=torch.float32, block=block)
    q = ops.quantize_fp8(x, block=block, scale_format=scale_format)
    assert isinstance(q, QTensor) and q.block == (1, block) and q.scale_format == scale_format
    assert q.data.dtype == FP8 and q.data.shape == x.shape and q.scale.shape == (*shape[:-1], shape[-1] // block)
    exact = torch.maximum(x.unflatten(-1, (-1, block)).abs().amax(-1), torch.tensor(1e-4)) / 448
    if scale_format == "fp32":
        assert torch.equal(q.scale, exact)
    else:
        mant, _ = torch.frexp(q.scale)
        assert bool((mant == 0.5).all()), "ue8m0 scales must be powers of two"
        assert bool((q.scale >= exact).all()) and bool((q.scale < 2 * exact).all())
    data, scale = act_quant(x, block, scale_format)
    assert torch.equal(q.scale, scale) and torch.equal(q.data.view(torch.uint8), data.view(torch.uint8))
    y = x.unflatten(-1, (-1, block)) / q.scale.unsqueeze(-1).double()
    err = (dequant(q.data, q.scale, (1, block)) - x.double()).abs()
    assert bool((err <= (e4m3_error_bound(y) * q.scale.double().unsqueeze(-1)).flatten(-2)).all())


def test_quantize_fp8_ue8m0_just_above_a_power_of_two(g):
    """A group whose amax/448 lies a few ulps above a power of two gets the next power of two (not the one below,
    which would push x / scale past 448)."""
    x = randn(g, 4, 128) * 0.01
    for i in range(4):
        x[i, 7] = just_above_pow2_amax(i + 1)
    q = ops.quantize_fp8(x, scale_format="ue8m0")
    assert bool((q.scale.squeeze(1) * 448 >= x.abs().amax(1)).all())
    assert torch.equal(q.scale, torch.full((4, 1), 2.0**-7))


@pytest.mark.parametrize("a_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale_format", ["fp32", "ue8m0"])
@pytest.mark.parametrize(("m", "n"), [(1, 128), (7, 200), (16, 384)])
def test_fp8_gemm_equals_per_k_block_accumulation(g, m, n, scale_format, a_dtype):
    """FP8 x FP8 gemm equals DeepSeek's per-K-block accumulation; a float ``a`` against an FP8 weight equals the
    same with ``a`` quantised per 1x128 exactly as quantize_fp8 does (in the weight's scale format)."""
    k = 384
    w = random_fp8_weight(g, n, k, scale_format=scale_format)
    a = activations(g, m, k=k, dtype=a_dtype)
    a_data, a_scale = act_quant(a, 128, scale_format)
    expected = blockwise_fp8_gemm(a_data, a_scale, w.data, w.scale)
    bound = dot_bound(dequant(a_data, a_scale, (1, 128)).abs(), dequant(w.data, w.scale, (128, 128)).abs(), k)
    qa = QTensor(a_data, a_scale, (1, 128), scale_format)
    for a_in in (qa, a):
        out = ops.gemm(a_in, w, out_dtype=torch.float32)
        assert out.shape == (m, n) and out.dtype == torch.float32
        err = (out.double() - expected).abs()
        assert bool((err <= bound).all()), f"worst error / bound {float((err / bound).max()):.3g}"
    assert torch.equal(ops.gemm(a, w), ops.gemm(ops.quantize_fp8(a, scale_format=scale_format), w))
    assert ops.gemm(a, w).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemm_float_with_bias(g, dtype):
    """Float gemm with bias equals F.linear in fp64 within the fp32 dot-product bound (fp32 out) and within one
    rounding to the output dtype."""
    a, w, bias = randn(g, 5, 96, dtype=dtype), randn(g, 70, 96, dtype=dtype), randn(g, 70, dtype=dtype)
    expected = F.linear(a.double(), w.double(), bias.double())
    out = ops.gemm(a, w, out_dtype=torch.float32, bias=bias)
    assert bool(((out.double() - expected).abs() <= dot_bound(a.double().abs(), w.double().abs(), 97)).all())
    out16 = ops.gemm(a, w, bias=bias)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.double(), expected, rtol=2.0**-8, atol=1e-5)


def grouped_operands(g, kind: str, num_experts: int, n: int, k: int, lead: tuple[int, ...], scale_format: str):
    """(a as passed, w as passed, a as fp64 values the op must use, w as fp64 values) for one operand kind."""
    if kind == "bf16":
        a, w = randn(g, *lead, k, dtype=torch.bfloat16), randn(g, num_experts, n, k, dtype=torch.bfloat16)
        return a, w, a.double(), w.double()
    w = random_fp8_weight(g, num_experts, n, k, scale_format=scale_format)
    wv = dequant(w.data, w.scale, (128, 128))
    a = randn(g, *lead, k, dtype=torch.bfloat16)
    data, scale = act_quant(a, 128, scale_format)
    av = dequant(data, scale, (1, 128))
    return (a if kind == "fp8_w" else QTensor(data, scale, (1, 128), scale_format)), w, av, wv


GROUPED_KINDS = [("bf16", "fp32"), ("fp8_w", "fp32"), ("fp8_w", "ue8m0"), ("fp8", "fp32"), ("fp8", "ue8m0")]


@pytest.mark.parametrize(("kind", "scale_format"), GROUPED_KINDS)
def test_grouped_gemm_contiguous_equals_per_expert_linear(g, kind, scale_format):
    """Contiguous grouped_gemm equals a per-expert loop of F.linear on dequantised weights, with empty experts
    and an all-empty batch (fp32 output, within the dot-product bound)."""
    counts = [3, 0, 6, 0, 1, 2]
    num_experts, n, k, m = len(counts), 200, 256, sum(counts)
    a, w, av, wv = grouped_operands(g, kind, num_experts, n, k, (m,), scale_format)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    out = ops.grouped_gemm(a, w, expert_offsets=offsets, out_dtype=torch.float32)
    assert out.shape == (m, n) and out.dtype == torch.float32
    for e in range(num_experts):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        expected = F.linear(av[lo:hi], wv[e])
        err = (out[lo:hi].double() - expected).abs()
        assert bool((err <= dot_bound(av[lo:hi].abs(), wv[e].abs(), k)).all()), f"expert {e}"
    empty = ops.grouped_gemm(a[:0], w, expert_offsets=torch.zeros_like(offsets))
    assert empty.shape == (0, n)


@pytest.mark.parametrize(("kind", "scale_format"), GROUPED_KINDS)
def test_grouped_gemm_masked_equals_per_expert_linear(g, kind, scale_format):
    """Masked grouped_gemm equals a per-expert F.linear on the first masked_m[e] rows; NaN in the rows past
    masked_m never reaches the valid rows; experts with no rows are allowed."""
    masked = [2, 0, 5, 5, 1]
    num_experts, max_m, n, k = len(masked), 5, 130, 384
    a, w, av, wv = grouped_operands(g, kind, num_experts, n, k, (num_experts, max_m), scale_format)
    for e, cnt in enumerate(masked):
        if isinstance(a, QTensor):
            a.data.view(torch.uint8)[e, cnt:] = 0x7F  # e4m3 NaN
        else:
            a[e, cnt:] = math.nan
    out = ops.grouped_gemm(a, w, masked_m=torch.tensor(masked, dtype=torch.int32), out_dtype=torch.float32)
    assert out.shape == (num_experts, max_m, n) and out.dtype == torch.float32
    for e, cnt in enumerate(masked):
        expected = F.linear(av[e, :cnt], wv[e])
        err = (out[e, :cnt].double() - expected).abs()
        assert bool((err <= dot_bound(av[e, :cnt].abs(), wv[e].abs(), k)).all()), f"expert {e}"


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_grouped_gemm_fp4_equals_transformers_dequantisation(g, layout):
    """FP4 expert weights (every byte value, ue8m0 scales from 2^-20 to 2^3) decoded by transformers' fine-grained FP8
    integration (its FP4 path: two e2m1 values a byte, low nibble first, one scale per 32 values), then a per-expert
    F.linear in fp64; the reference's fp32 result is within the dot-product bound of that."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    decode = Fp8Dequantize(None)._dequantize_one
    experts, n, k = 3, 40, 96
    data = randint(g, -128, 128, experts, n, k // 2, dtype=torch.int8)
    data.view(-1)[:256] = torch.arange(-128, 128, dtype=torch.int8)
    scale = randint(g, 107, 131, experts, n, k // 32, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    w = FP4Tensor(data, scale)
    wv = torch.stack([decode(data[e], scale[e], torch.float32) for e in range(experts)]).double()
    assert wv.shape == (experts, n, k) and bool(wv.isfinite().all())
    assert torch.equal(w.dequantize().double(), wv)
    counts = [4, 0, 3]
    if layout == "contiguous":
        a = randn(g, sum(counts), k)
        offsets = torch.tensor([0, 4, 4, 7], dtype=torch.int32)
        out = ops.grouped_gemm(a, w, expert_offsets=offsets, out_dtype=torch.float32)
        rows = [a[0:4], a[4:4], a[4:7]]
        got = [out[0:4], out[4:4], out[4:7]]
    else:
        a = randn(g, experts, 4, k)
        out = ops.grouped_gemm(a, w, masked_m=torch.tensor(counts, dtype=torch.int32), out_dtype=torch.float32)
        rows = [a[e, : counts[e]] for e in range(experts)]
        got = [out[e, : counts[e]] for e in range(experts)]
    for e in range(experts):
        expected = F.linear(rows[e].double(), wv[e])
        err = (got[e].double() - expected).abs()
        assert bool((err <= dot_bound(rows[e].abs(), wv[e].abs().float(), k)).all()), f"expert {e}"


# ---------------------------------------------------------------------------------------------------------------
# ep_dispatch / ep_combine
# ---------------------------------------------------------------------------------------------------------------


def routing(g, tokens: int, k: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct expert ids per token, as a router gives, with random -1 ("no expert") entries and token 0 routed
    nowhere; distinct positive weights."""
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(tokens)]).int()
    ids[torch.rand(tokens, k, generator=g) < 0.25] = -1
    ids[0] = -1
    weights = torch.rand(tokens, k, generator=g) + 0.1
    return ids, weights


def x_values(x) -> torch.Tensor:
    return dequant(x.data, x.scale, x.block) if isinstance(x, QTensor) else x.double()


def unused_rows(layout, recv_shape) -> torch.Tensor | None:
    """Bool mask of received rows past masked_m (low_latency), or None."""
    if layout.masked_m is None:
        return None
    return torch.arange(recv_shape[1])[None, :] >= layout.masked_m[:, None]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_dispatch_identity_combine(g, mode, fp8):
    """Dispatch then combine with an identity expert gives sum_k w[t, k] x[t] over the valid pairs (zeros for a
    token with none); rows past masked_m, and the skipped pairs' rows of normal mode, hold NaN and are never read;
    normal mode groups rows by ascending expert then token, one row per skipped pair last (id -1, weight 0, in the
    last expert's range), low_latency holds each expert's pairs in its first masked_m rows."""
    tokens, k, num_experts, hidden = 11, 3, 5, 256
    x = randn(g, tokens, hidden, dtype=torch.bfloat16)
    if fp8:
        x = QTensor(*act_quant(x), (1, 128))
    ids, weights = routing(g, tokens, k, num_experts)
    recv_x, recv_ids, recv_w, layout, handle = ops.ep_dispatch(x, ids, weights, num_experts=num_experts, mode=mode)
    pairs = sorted((int(ids[t, j]), t, j) for t in range(tokens) for j in range(k) if ids[t, j] >= 0)
    counts = torch.bincount(torch.tensor([p[0] for p in pairs]), minlength=num_experts)
    xv = x_values(x)
    rv = x_values(recv_x)
    if mode == "normal":
        skipped = tokens * k - len(pairs)
        assert skipped > 0  # the routing skips some pairs
        offsets = torch.cat([torch.zeros(1), counts.cumsum(0)]).to(torch.int32)
        offsets[-1] = tokens * k
        assert torch.equal(layout.expert_offsets, offsets)
        assert layout.masked_m is None and rv.shape == (tokens * k, hidden)
        assert torch.equal(rv[: len(pairs)], xv[[t for _, t, _ in pairs]])
        assert recv_ids.tolist() == [e for e, _, _ in pairs] + [-1] * skipped
        assert recv_w.tolist() == [float(weights[t, j]) for _, t, j in pairs] + [0.0] * skipped
        y = rv.float()
        y[len(pairs) :] = math.nan
    else:
        assert layout.expert_offsets is None and torch.equal(layout.masked_m, counts.to(torch.int32))
        assert rv.shape[0] == num_experts and rv.shape[2] == hidden
        for e in range(num_experts):
            mine = sorted((float(weights[t, j]), t) for ee, t, j in pairs if ee == e)
            got = sorted(zip(recv_w[e, : counts[e]].tolist(), range(int(counts[e]))))
            assert [w for w, _ in got] == [w for w, _ in mine]
            assert bool((recv_ids[e, : counts[e]] == e).all())
            for (_, row), (_, t) in zip(got, mine):
                assert torch.equal(rv[e, row], xv[t])
        y = rv.float().masked_fill(unused_rows(layout, rv.shape)[..., None], math.nan)
    y = y if fp8 else y.to(torch.bfloat16)
    out = ops.ep_combine(y, handle)
    assert out.shape == (tokens, hidden) and out.dtype == y.dtype
    expected = (weights.double() * (ids >= 0)).sum(1, keepdim=True) * xv
    # bf16: one rounding of the fp32 sum to bf16 (2^-9 relative); fp32: k-term sums of exact products.
    rtol = 2.0**-8 if not fp8 else 1e-6
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=1e-6)
    assert bool((out[0] == 0).all())


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_dispatch_grouped_gemm_combine_equals_dense_moe(g, mode, fp8):
    """The received layout is what grouped_gemm takes: dispatch -> grouped_gemm with a distinct weight per expert
    -> combine equals the dense per-token sum_k w[t, k] * (x[t] @ W[ids[t, k]].T)."""
    tokens, k, num_experts, hidden, n = 13, 4, 6, 256, 72
    ids, weights = routing(g, tokens, k, num_experts)
    x = randn(g, tokens, hidden, dtype=torch.bfloat16)
    if fp8:
        x = QTensor(*act_quant(x), (1, 128))
        w = random_fp8_weight(g, num_experts, n, hidden)
        wv = dequant(w.data, w.scale, (128, 128))
    else:
        w = randn(g, num_experts, n, hidden, scale=hidden**-0.5, dtype=torch.bfloat16)
        wv = w.double()
    xv = x_values(x)
    recv_x, _, _, layout, handle = ops.ep_dispatch(x, ids, weights, num_experts=num_experts, mode=mode)
    y = ops.grouped_gemm(
        recv_x, w, expert_offsets=layout.expert_offsets, masked_m=layout.masked_m, out_dtype=torch.float32
    )
    unused = unused_rows(layout, y.shape)
    if unused is not None:
        y = y.masked_fill(unused[..., None], math.nan)
    out = ops.ep_combine(y, handle)
    per_expert = torch.einsum("th,enh->ten", xv, wv)  # [T, E, N]
    valid = ids >= 0
    picked = per_expert[torch.arange(tokens)[:, None], ids.clamp_min(0).long()]  # [T, k, N]
    expected = (picked * (weights.double() * valid)[..., None]).sum(1)
    # Each expert row carries the fp32 dot-product bound; the k-term weighted fp32 sum adds k u relative.
    row_bound = dot_bound(xv.abs(), wv.abs().reshape(-1, hidden), hidden).view(tokens, num_experts, n)
    bound = row_bound[torch.arange(tokens)[:, None], ids.clamp_min(0).long()] * (weights.double() * valid)[..., None]
    bound = bound.sum(1) + (k + 1) * U32 * (picked.abs() * weights.double()[..., None]).sum(1) + 1e-12
    err = (out.double() - expected).abs()
    assert bool((err <= bound).all()), f"worst error / bound {float((err / bound).max()):.3g}"


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_dispatch_combine_empty_batch(mode, fp8):
    """A batch of no token dispatches to no row (every expert empty) and combines to an empty [0, H'] result."""
    x = torch.zeros(0, 128, dtype=torch.bfloat16)
    if fp8:
        x = ops.quantize_fp8(x)  # scales [0, 1]
    ids, weights = torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, 2)
    recv_x, recv_ids, recv_w, layout, handle = ops.ep_dispatch(x, ids, weights, num_experts=3, mode=mode)
    assert recv_x.shape[-1] == 128 and recv_x.shape[:-1] == recv_ids.shape == recv_w.shape
    counts = layout.expert_offsets if mode == "normal" else layout.masked_m
    assert bool((counts == 0).all())
    y = torch.zeros(*recv_ids.shape, 8)
    assert ops.ep_combine(y, handle).shape == (0, 8)


# ---------------------------------------------------------------------------------------------------------------
# rope, YaRN tables, MLA softmax scale
# ---------------------------------------------------------------------------------------------------------------

V3_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
YARN_CONFIGS = {
    "v3": V3_YARN,
    "mscale_differs": {**V3_YARN, "mscale": 0.707, "mscale_all_dim": 1.0},
    "mscale_all_dim_only": {**V3_YARN, "mscale": 0.0, "mscale_all_dim": 0.707},
    "no_mscale": {k: v for k, v in V3_YARN.items() if not k.startswith("mscale")},
    "untruncated": {**V3_YARN, "truncate": False},
}


def hf_config(rope_parameters: dict | None, rope_dim: int = 64):
    from transformers import DeepseekV3Config

    extra = {} if rope_parameters is None else {"rope_parameters": dict(rope_parameters)}
    return DeepseekV3Config(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=128, qk_rope_head_dim=rope_dim, v_head_dim=16, max_position_embeddings=163840, **extra,
    )  # fmt: skip


@pytest.mark.parametrize("dim", [16, 64])
def test_rope_interleaved_matches_transformers(g, dim):
    """Interleaved rope equals transformers' apply_rotary_pos_emb_interleave once its de-interleaved output
    ([rotated evens..., rotated odds...]) is put back in pair order; same fp32 formula, so 1-ulp agreement."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    table = ops.rope_cos_sin_cache(dim, 5000, 10000.0, V3_YARN)
    x, pos = randn(g, 11, 3, dim), randint(g, 0, 5000, 11)
    out = ops.rope(x, pos, table, interleaved=True)
    cos, sin = table[pos.long(), : dim // 2], table[pos.long(), dim // 2 :]
    hf_cos, hf_sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]
    hf, _ = apply_rotary_pos_emb_interleave(x.transpose(0, 1)[None], x.transpose(0, 1)[None], hf_cos, hf_sin)
    hf = hf[0].transpose(0, 1)  # [T, H, D] as [evens | odds]
    torch.testing.assert_close(torch.cat([out[..., 0::2], out[..., 1::2]], -1), hf, rtol=2.0**-23, atol=1e-6)
    assert not torch.allclose(out, x)


def test_rope_neox_matches_transformers(g):
    """Non-interleaved rope equals transformers' apply_rotary_pos_emb (rotate_half), with bf16 input."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb

    dim = 32
    table = ops.rope_cos_sin_cache(dim, 300)
    x, pos = randn(g, 9, 4, dim), randint(g, 0, 300, 9)
    cos = torch.cat([table[pos.long(), : dim // 2]] * 2, -1)[None]
    sin = torch.cat([table[pos.long(), dim // 2 :]] * 2, -1)[None]
    hf, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    hf = hf[0].transpose(0, 1)
    torch.testing.assert_close(ops.rope(x, pos, table, interleaved=False), hf, rtol=2.0**-23, atol=1e-6)
    xb = x.to(torch.bfloat16)
    out = ops.rope(xb, pos, table, interleaved=False)
    assert out.dtype == torch.bfloat16
    hf_b = apply_rotary_pos_emb(xb.float().transpose(0, 1)[None], xb.float().transpose(0, 1)[None], cos, sin)[0]
    torch.testing.assert_close(out.float(), hf_b[0].transpose(0, 1), rtol=2.0**-8, atol=1e-6)


@pytest.mark.parametrize("name", list(YARN_CONFIGS))
def test_yarn_table_matches_transformers(name):
    """rope_cos_sin_cache under YaRN equals cos/sin of transformers' yarn inv_freq times its attention_factor.

    transformers computes inv_freq in fp32 (a few roundings: <= 16 u relative), ours in fp64 and stores the table
    in fp32, so |d| <= af * p * inv_freq * 16 u + 2 u at position p; a wrong ramp, factor or blend moves some
    frequency by far more at the large positions checked.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = YARN_CONFIGS[name]
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config(params))
    table = ops.rope_cos_sin_cache(64, 65536, 10000.0, params)
    assert table.shape == (65536, 64) and table.dtype == torch.float32
    pos = torch.tensor([0, 1, 2, 77, 4095, 4096, 30000, 65535], dtype=torch.float64)
    angles = pos[:, None] * inv_freq.double()[None, :]
    expected = torch.cat([angles.cos(), angles.sin()], -1) * attention_factor
    tol = attention_factor * pos[:, None] * inv_freq.double()[None, :] * 16 * U32 + 2 * U32
    err = (table[pos.long()].double() - expected).abs()
    assert bool((err <= torch.cat([tol, tol], -1)).all()), (
        f"worst error / bound {float((err / tol.repeat(1, 2)).max())}"
    )
    norm = table[1, :32].double().hypot(table[1, 32:].double())
    torch.testing.assert_close(norm, torch.full_like(norm, attention_factor), rtol=4 * U32, atol=0)


@pytest.mark.parametrize("name", [None, *YARN_CONFIGS])
def test_mla_softmax_scale_matches_transformers(name):
    """mla_softmax_scale equals DeepseekV3Attention.scaling (qk_head_dim^-0.5 times mscale^2 under YaRN), both
    from the v5 rope_parameters dict and from a legacy rope_scaling dict."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    config = hf_config(None if name is None else YARN_CONFIGS[name])
    expected = DeepseekV3Attention(config, 0).scaling
    assert ops.mla_softmax_scale(128 + 64, config.rope_parameters) == pytest.approx(expected, rel=1e-14)
    if name is not None:
        legacy = {("type" if k == "rope_type" else k): v for k, v in YARN_CONFIGS[name].items()}
        assert ops.mla_softmax_scale(192, legacy) == pytest.approx(expected, rel=1e-14)
    if name == "v3":
        assert expected == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-14)


# ---------------------------------------------------------------------------------------------------------------
# rms_norm, silu_and_mul
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_transformers(g, dtype, with_residual):
    """rms_norm equals transformers' DeepseekV3RMSNorm applied to h = x + residual (h rounded to x's dtype, equal
    to torch's own add); fp32 to an ulp, bf16 within two bf16 roundings (transformers rounds the normalised value
    to bf16 before the weight multiply, the contract rounds once)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    x, w = randn(g, 3, 5, 96, dtype=dtype), randn(g, 96, dtype=dtype) + 1
    residual = randn(g, 3, 5, 96, scale=3.0, dtype=dtype) if with_residual else None
    y, h = ops.rms_norm(x, w, 1e-6, residual)
    expected_h = x + residual if with_residual else x
    assert torch.equal(h, expected_h) and h.dtype == dtype
    norm = DeepseekV3RMSNorm(96, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
        expected = norm(expected_h)
    assert y.dtype == dtype and y.shape == x.shape
    rtol = 4 * U32 if dtype == torch.float32 else 2.0**-7
    torch.testing.assert_close(y.float(), expected.float(), rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("shape", [(7, 512), (3, 4, 256)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_and_mul(g, shape, dtype):
    """silu_and_mul equals F.silu(gate) * up (one rounding to the output dtype); with quantize=True it equals
    quantize_fp8 of the fp32 product, data and scales bitwise, for both scale formats."""
    x = randn(g, *shape, scale=2.0, dtype=dtype)
    gate, up = x.double().chunk(2, dim=-1)
    exact = gate * torch.sigmoid(gate) * up
    out = ops.silu_and_mul(x)
    assert out.dtype == dtype and out.shape == (*shape[:-1], shape[-1] // 2)
    rtol = 2.0**-8 if dtype == torch.bfloat16 else 8 * U32
    torch.testing.assert_close(out.double(), exact, rtol=rtol, atol=1e-7)
    product = F.silu(x.float()[..., : shape[-1] // 2]) * x.float()[..., shape[-1] // 2 :]
    for fmt in ("fp32", "ue8m0"):
        q = ops.silu_and_mul(x, quantize=True, scale_format=fmt)
        ref = ops.quantize_fp8(product, scale_format=fmt)
        assert isinstance(q, QTensor) and q.scale_format == fmt and q.block == (1, 128)
        assert torch.equal(q.scale, ref.scale) and torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8))


# ---------------------------------------------------------------------------------------------------------------
# attention_varlen == scaled_dot_product_attention per sequence
# ---------------------------------------------------------------------------------------------------------------


def offsets(parts: list[torch.Tensor]) -> torch.Tensor:
    """cu_seqlens of packed parts."""
    return torch.tensor([0, *torch.tensor([p.shape[0] for p in parts]).cumsum(0).tolist()], dtype=torch.int32)


VARLEN_CASES = {
    "causal": ([(5, 5), (1, 1), (9, 9)], 4, 4, True),
    "non_causal": ([(5, 8), (3, 2), (1, 6)], 4, 4, False),
    "gqa": ([(6, 6), (2, 2)], 6, 2, True),
    "mqa_non_causal": ([(4, 7)], 4, 1, False),
    "cached_prefix": ([(3, 10), (1, 7), (4, 4)], 4, 2, True),
    "zero_length": ([(0, 0), (4, 4), (0, 3), (2, 5)], 2, 2, True),
    "more_queries_than_keys": ([(5, 3), (2, 2)], 2, 1, True),
}


@pytest.mark.parametrize("one_head_at_a_time", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(VARLEN_CASES))
def test_attention_varlen_matches_sdpa(g, case, dtype, one_head_at_a_time, monkeypatch):
    """Each packed sequence equals scaled_dot_product_attention with an explicit bottom-right causal mask
    (j <= i + L_k - L_q), GQA by enable_gqa, D_qk 24 != D_v 16; queries that see no key give zeros. fp32 agrees
    to fp32 rounding of short sums; bf16 output within one bf16 rounding of the fp32 result. Also with the scores
    budget that makes long sequences go one head at a time."""
    if one_head_at_a_time:
        monkeypatch.setattr(reference_attention, "SCORES_PER_CHUNK", 1)
    lens, heads, kv_heads, causal = VARLEN_CASES[case]
    d_qk, d_v, scale = 24, 16, 24**-0.5
    qs = [randn(g, lq, heads, d_qk, dtype=dtype) for lq, _ in lens]
    ks = [randn(g, lk, kv_heads, d_qk, dtype=dtype) for _, lk in lens]
    vs = [randn(g, lk, kv_heads, d_v, dtype=dtype) for _, lk in lens]
    out = ops.attention_varlen(
        torch.cat(qs), torch.cat(ks), torch.cat(vs), offsets(qs), offsets(ks), softmax_scale=scale, causal=causal
    )
    assert out.shape == (sum(lq for lq, _ in lens), heads, d_v) and out.dtype == dtype
    start = 0
    for (lq, lk), q, k, v in zip(lens, qs, ks, vs):
        got = out[start : start + lq].float()
        start += lq
        if lq == 0:
            continue
        i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
        mask = (j <= i + lk - lq) if causal else torch.ones(lq, lk, dtype=torch.bool)
        if lk:
            expected = F.scaled_dot_product_attention(
                q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1),
                attn_mask=mask, scale=scale, enable_gqa=True,
            ).transpose(0, 1)  # fmt: skip
        else:
            expected = torch.zeros(lq, heads, d_v)
        seen = mask.any(1)
        expected = torch.where(seen[:, None, None], expected, 0.0)
        rtol = 2.0**-8 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(got, expected, rtol=rtol, atol=2e-6, msg=f"{case}: sequence ({lq}, {lk})")
        assert bool((got[~seen] == 0).all())


# ---------------------------------------------------------------------------------------------------------------
# write_kv_cache and the fp8_ds_mla record
# ---------------------------------------------------------------------------------------------------------------


def slots_with_skips(g, tokens: int, num_slots: int) -> torch.Tensor:
    slots = torch.randperm(num_slots, generator=g)[:tokens].long()
    slots[torch.randperm(tokens, generator=g)[:3]] = -1
    return slots


def test_write_kv_cache_bf16_read_back(g):
    """bf16 write then read back through the page layout: written slots hold the latent, -1 tokens and every
    other slot are untouched (bitwise)."""
    num_blocks, block_size, width, tokens = 6, 4, 40, 12
    cache = randn(g, num_blocks, block_size, width, dtype=torch.bfloat16)
    before = cache.clone()
    latent = randn(g, tokens, width, dtype=torch.bfloat16)
    slots = slots_with_skips(g, tokens, num_blocks * block_size)
    ops.write_kv_cache(latent, cache, slots, kv_lora_rank=32)
    keep = slots >= 0
    for t in range(tokens):
        if keep[t]:
            s = int(slots[t])
            assert torch.equal(cache[s // block_size, s % block_size], latent[t])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert torch.equal(cache.view(-1, width)[untouched], before.view(-1, width)[untouched])


@pytest.mark.parametrize("latent_dtype", [torch.bfloat16, torch.float32])
def test_fp8_ds_mla_record_layout(g, latent_dtype):
    """fp8_ds_mla for (512, 64): 656 bytes per token; bytes 0:512 are e4m3 values of c / s, 512:528 four fp32
    scales s = 2^ceil(log2(max(amax, 1e-4) / 448)) (powers of two), 528:656 the rope part as bf16 bytes; -1 tokens
    and unwritten slots untouched; dequantisation error within half an e4m3 spacing."""
    num_blocks, block_size, tokens = 5, 3, 9
    cache = torch.randint(0, 256, (num_blocks, block_size, 656), generator=g, dtype=torch.uint8)
    before = cache.clone()
    latent = torch.cat([activations(g, tokens, k=512, dtype=latent_dtype), randn(g, tokens, 64, dtype=latent_dtype)], 1)
    slots = slots_with_skips(g, tokens, num_blocks * block_size)
    ops.write_kv_cache(latent, cache, slots, kv_lora_rank=512)
    flat = cache.view(-1, 656)
    for t in range(tokens):
        if slots[t] < 0:
            continue
        rec = flat[int(slots[t])]
        c = latent[t, :512].double()
        data, scales = rec[:512].view(FP8), rec[512:528].view(torch.float32)
        mant, _ = torch.frexp(scales)
        assert bool((mant == 0.5).all()), "scales must be powers of two"
        exact = torch.maximum(latent[t, :512].float().view(4, 128).abs().amax(-1), torch.tensor(1e-4)) / 448
        assert torch.equal(scales, pow2_ceil(exact))
        expected = (latent[t, :512].float().view(4, 128) / scales[:, None]).to(FP8).flatten()
        assert torch.equal(rec[:512], expected.view(torch.uint8))
        assert torch.equal(rec[528:], latent[t, 512:].to(torch.bfloat16).contiguous().view(torch.uint8))
        y = c.view(4, 128) / scales[:, None].double()
        err = (data.double().view(4, 128) * scales[:, None].double() - c.view(4, 128)).abs()
        assert bool((err <= e4m3_error_bound(y) * scales[:, None].double()).all())
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(flat[untouched], before.view(-1, 656)[untouched])


def test_fp8_ds_mla_edge_records(g):
    """Writing no token (T = 0, or every slot -1) leaves an fp8_ds_mla cache untouched; a record whose width is no
    multiple of 4 (odd rope_dim) is read back correctly even when a sequence holds a single token."""
    lora, rope = 128, 3
    cache = torch.randint(0, 256, (4, 2, lora + 4 + 2 * rope), generator=g, dtype=torch.uint8)
    before = cache.clone()
    ops.write_kv_cache(randn(g, 0, lora + rope), cache, torch.zeros(0, dtype=torch.int64), kv_lora_rank=lora)
    ops.write_kv_cache(randn(g, 2, lora + rope), cache, torch.tensor([-1, -1]), kv_lora_rank=lora)
    assert torch.equal(cache, before)
    latent = randn(g, 1, lora + rope, dtype=torch.bfloat16)
    ops.write_kv_cache(latent, cache, torch.tensor([4]), kv_lora_rank=lora)  # page 2, offset 0
    q = randn(g, 1, 1, 2, lora + rope)
    table = torch.tensor([[2]], dtype=torch.int32)
    out, lse = ops.mla_decode(
        q, cache, table, torch.tensor([1], dtype=torch.int32), softmax_scale=0.1, kv_lora_rank=lora
    )
    c = decode_fp8_ds_mla(cache.view(-1, cache.shape[-1])[4:5], lora)
    torch.testing.assert_close(out[0, 0].double(), c[:, :lora].expand(2, -1), rtol=1e-6, atol=0)  # one token: p = 1
    torch.testing.assert_close(lse[0, 0].double(), 0.1 * (q[0, 0].double() @ c[0]), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# sample
# ---------------------------------------------------------------------------------------------------------------


def kept_set(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, slack: float = 0.0) -> torch.Tensor:
    """Sort-based top-k then top-p filter in fp64 (``slack`` widens top_p to absorb fp32 cumulative-sum noise)."""
    z = logits.double() / temperature
    values, order = z.sort(descending=True)
    keep_sorted = torch.ones_like(values, dtype=torch.bool)
    if 0 < top_k < z.numel():
        keep_sorted &= values >= values[top_k - 1]
    if top_p < 1.0:
        p = torch.softmax(values.masked_fill(~keep_sorted, -math.inf), 0)
        mass_before = torch.cat([torch.zeros(1, dtype=torch.float64), p.cumsum(0)[:-1]])
        keep_sorted &= mass_before < top_p + slack
    keep = torch.zeros_like(keep_sorted)
    keep[order] = keep_sorted
    return keep


def sample_args(logits, temperature, top_p, top_k, seeds):
    b = logits.shape[0]
    as_t = lambda v, dt: torch.as_tensor(v, dtype=dt).expand(b).contiguous()
    return logits, as_t(temperature, torch.float32), as_t(top_p, torch.float32), as_t(top_k, torch.int32), seeds


def test_sample_greedy_is_first_argmax(g):
    """temperature 0 returns the first index of the row's maximum, whatever top_k / top_p / seed."""
    logits = randn(g, 6, 50)
    logits[2, 7] = logits[2, 30] = logits[2].max() + 1  # a tie: the first wins
    seeds = randint(g, 0, 2**62, 6, dtype=torch.int64)
    out = ops.sample(*sample_args(logits, 0.0, 0.3, 5, seeds))
    assert out.dtype == torch.int32
    assert out.tolist() == [int((row == row.max()).nonzero()[0]) for row in logits]


def test_sample_stays_in_kept_set(g):
    """Every sampled token lies in the kept set of an independent sort-based top-k / top-p filter."""
    rows = 96
    logits = randn(g, rows, 40, scale=3.0)
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.05
    top_p = torch.where(torch.rand(rows, generator=g) < 0.3, 1.0, torch.rand(rows, generator=g) * 0.9 + 0.05)
    top_k = torch.where(torch.rand(rows, generator=g) < 0.3, 0, randint(g, 1, 45, rows))
    seeds = randint(g, 0, 2**62, rows, dtype=torch.int64)
    out = ops.sample(logits, temperature, top_p.float(), top_k.int(), seeds)
    for b in range(rows):
        keep = kept_set(logits[b], float(temperature[b]), int(top_k[b]), float(top_p[b]), slack=1e-5)
        assert keep[int(out[b])], f"row {b}: token {int(out[b])} not in the kept set"


def test_sample_is_per_request(g):
    """A row's token depends only on its logits, parameters and seed: alone, in a shuffled batch with other rows,
    or called again, it is the same."""
    rows = 8
    logits = randn(g, rows, 64, scale=2.0)
    temperature = torch.rand(rows, generator=g) + 0.5
    top_p = torch.rand(rows, generator=g) * 0.5 + 0.5
    top_k = randint(g, 0, 20, rows)
    seeds = randint(g, 0, 2**62, rows, dtype=torch.int64)
    batch = ops.sample(logits, temperature, top_p, top_k, seeds)
    alone = [int(ops.sample(logits[b : b + 1], temperature[b : b + 1], top_p[b : b + 1], top_k[b : b + 1],
                           seeds[b : b + 1])) for b in range(rows)]  # fmt: skip
    assert batch.tolist() == alone
    extra = 5
    mixed = torch.randperm(rows + extra, generator=g)
    cat = lambda a, b: torch.cat([a, b])[mixed]
    out = ops.sample(
        cat(logits, randn(g, extra, 64)), cat(temperature, torch.ones(extra)), cat(top_p, torch.ones(extra)),
        cat(top_k, torch.zeros(extra, dtype=torch.int32)), cat(seeds, randint(g, 0, 100, extra, dtype=torch.int64)),
    )  # fmt: skip
    back = torch.empty_like(out)
    back[mixed] = out
    assert back[:rows].tolist() == alone
    assert torch.equal(ops.sample(logits, temperature, top_p, top_k, seeds), batch)


def test_sample_distribution(g):
    """Over 3000 seeds the token frequencies match the filtered, temperature-scaled softmax.

    The empirical distribution over the K kept tokens satisfies P(TV >= eps) <= 2^K exp(-2 N eps^2)
    (Bretagnolle-Huber-Carol); eps is set for a false-failure probability of 1e-6. The logits are chosen so that
    dropping the temperature, the top-k or the top-p step moves the distribution by more than eps.
    """
    logits = torch.tensor([1.2, 0.2, 2.0, -0.4, 0.9, 1.6, -1.0, 0.5])[torch.randperm(8, generator=g)]
    temperature, top_k, top_p, n = 0.6, 6, 0.85, 3000
    keep = kept_set(logits, temperature, top_k, top_p)
    probs = torch.softmax((logits.double() / temperature).masked_fill(~keep, -math.inf), 0)
    seeds = torch.randint(0, 2**62, (n,), generator=g)
    out = ops.sample(*sample_args(logits.expand(n, -1).contiguous(), temperature, top_p, top_k, seeds))
    freq = torch.bincount(out.long(), minlength=8).double() / n
    assert bool((freq[~keep] == 0).all())
    kept = int(keep.sum())
    eps = math.sqrt(math.log(2**kept / 1e-6) / (2 * n))
    tv = 0.5 * float((freq - probs).abs().sum())
    assert tv < eps, f"total variation {tv:.4f} >= {eps:.4f}"


def test_sample_rejects_bad_parameters():
    """Out-of-contract sampling parameters (NaN top_p, an empty vocabulary) raise InputError."""
    seeds = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(InputError, match="top_p"):
        ops.sample(*sample_args(torch.randn(2, 5), 1.0, math.nan, 0, seeds))
    with pytest.raises(InputError, match="logits"):
        ops.sample(*sample_args(torch.randn(2, 0), 1.0, 1.0, 0, seeds))
