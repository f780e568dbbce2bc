"""The DeepSeek-V4 ops' references against transformers' DeepseekV4 modules (the oracle), on fresh random weights
and inputs; and the conformance cases of those ops checked to catch the bugs they are meant to catch.

Each run draws new data; ``DEEPINFER_TEST_SEED=<n>`` replays a run (the seed is printed with a failure).
"""

from __future__ import annotations

import pytest
import torch
from reference_helpers import U32, g_fixture, on_reference_fixture, randn  # noqa: F401 (fixtures)

from deepinfer import ops
from deepinfer.conformance import activation as activation_cases
from deepinfer.conformance.cases import Gen, error
from deepinfer.conformance.tolerances import tolerance

transformers_v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config  # noqa: E402


def config(**over) -> DeepseekV4Config:
    kw = dict(
        hidden_size=64,
        intermediate_size=32,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        vocab_size=100,
        n_routed_experts=16,
        num_experts_per_tok=4,
        hc_mult=4,
    )
    return DeepseekV4Config(**{**kw, **over})


# ---------------------------------------------------------------------------------------------------------------
# Clipped SwiGLU
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [10.0, 1.5])
def test_clipped_silu_and_mul_matches_the_v4_experts_gate(g, dtype, limit):
    """silu_and_mul(limit=) equals DeepseekV4Experts._apply_gate (gate clamped above, up both ways, then
    silu(gate) * up) on a packed gate_up with many values beyond the limit, transformers run on the fp32 values:
    fp32 to a few ulps, bf16 within the output's one rounding."""
    experts = transformers_v4.DeepseekV4Experts(config(swiglu_limit=limit))
    x = randn(g, 9, 2 * 96, scale=1.2 * limit, dtype=dtype)
    assert (x.float().abs() > limit).float().mean() > 0.2  # the clamp matters
    expected = experts._apply_gate(x.float())
    out = ops.silu_and_mul(x, limit=limit)
    assert out.dtype == dtype and out.shape == (9, 96)
    rtol = 2.0**-8 if dtype == torch.bfloat16 else 8 * U32
    torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=1e-6)
    unclipped = ops.silu_and_mul(x)
    assert not torch.allclose(unclipped.float(), expected, rtol=0.05)


def test_clipped_silu_and_mul_matches_the_v4_shared_mlp(g):
    """The shared expert's DeepseekV4MLP (gate and up as two projections) gives the same as gemm outputs packed
    [gate | up] through silu_and_mul(limit=)."""
    cfg = config(swiglu_limit=2.0)
    mlp = transformers_v4.DeepseekV4MLP(cfg)
    with torch.no_grad():
        for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            lin.weight.copy_(randn(g, *lin.weight.shape, scale=0.3))
    x = randn(g, 5, cfg.hidden_size)
    h = torch.cat([x @ mlp.gate_proj.weight.T, x @ mlp.up_proj.weight.T], dim=-1)
    out = ops.silu_and_mul(h, limit=2.0) @ mlp.down_proj.weight.T
    with torch.no_grad():
        torch.testing.assert_close(out, mlp(x), rtol=1e-5, atol=1e-6)


def test_every_clipped_case_fails_an_implementation_that_ignores_the_limit():
    """The conformance cases with a limit put enough values beyond it that the unclipped product misses the
    tolerance (masked rows included)."""
    limited = [c for shapes in ("small", "full") for c in activation_cases.cases(shapes) if "limit=" in c.name]
    assert len(limited) >= 10
    for case in limited:
        kw = case.make(Gen(5, "cpu")) if "8192" not in case.name else None
        if kw is None or kw["x"].numel() > 2**24:
            continue
        run = case.run or (lambda op, k: op(**k))
        clipped = run(ops.silu_and_mul, kw)
        ignored = run(ops.silu_and_mul, {**kw, "limit": None})
        tol, _ = tolerance("silu_and_mul", case.variant)
        assert error(ignored, clipped) > 10 * tol, case.name


# ---------------------------------------------------------------------------------------------------------------
# Routing: sqrtsoftplus top-k and hash routing
# ---------------------------------------------------------------------------------------------------------------


def _router(cls, cfg, g):
    router = cls(cfg)
    with torch.no_grad():
        router.weight.copy_(randn(g, *router.weight.shape, scale=0.5))
    return router


def _sorted(weights: torch.Tensor, ids: torch.Tensor):
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("tokens", [1, 37])
def test_sqrtsoftplus_route_matches_the_v4_topk_router(g, tokens):
    """moe_route(scoring="sqrtsoftplus", n_group=1) chooses the experts of DeepseekV4TopKRouter (top-k of
    sqrt(softplus(logit)) + bias) and gives its weights (unbiased scores over their sum + 1e-20, times the scaling
    factor) to a few fp32 ulps."""
    cfg = config(n_routed_experts=64, num_experts_per_tok=6, routed_scaling_factor=1.5)
    router = _router(transformers_v4.DeepseekV4TopKRouter, cfg, g)
    with torch.no_grad():
        router.e_score_correction_bias.copy_(randn(g, 64, scale=0.3))
        x = randn(g, tokens, cfg.hidden_size)
        logits, want_w, want_ids = router(x)
    w, ids = ops.moe_route(
        logits.float(),
        router.e_score_correction_bias,
        top_k=6,
        routed_scaling_factor=1.5,
        scoring="sqrtsoftplus",
    )
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (tokens, 6)
    w, ids = _sorted(w, ids)
    want_w, want_ids = _sorted(want_w, want_ids.to(torch.int32))
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, rtol=8 * U32, atol=0)


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid"])
def test_hash_route_matches_the_v4_hash_router(g, scoring):
    """moe_route_hash(logits, tid2eid[input_ids]) equals DeepseekV4HashRouter: ids exactly, in the table's order,
    and weights to a few fp32 ulps."""
    cfg = config(n_routed_experts=32, num_experts_per_tok=4, routed_scaling_factor=2.5, scoring_func=scoring)
    router = _router(transformers_v4.DeepseekV4HashRouter, cfg, g)
    table = torch.stack([torch.randperm(32, generator=g)[:4] for _ in range(cfg.vocab_size)])
    with torch.no_grad():
        router.tid2eid.copy_(table)
        input_ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=g)
        x = randn(g, 2, 9, cfg.hidden_size)
        logits, want_w, want_ids = router(x, input_ids)
    expert_ids = table[input_ids.reshape(-1)].to(torch.int32)
    w, ids = ops.moe_route_hash(logits, expert_ids, routed_scaling_factor=2.5, scoring=scoring)
    assert torch.equal(ids, want_ids.to(torch.int32)) and torch.equal(ids, expert_ids)
    torch.testing.assert_close(w, want_w, rtol=8 * U32, atol=0)


def test_sqrtsoftplus_keeps_precision_far_below_zero():
    """Scores of very negative logits are sqrt(exp(x)), not the 0 a naive log(1 + exp(x)) gives."""
    logits = torch.tensor([[-30.0, -20.0, -18.0, 0.0]])
    w, _ = ops.moe_route_hash(logits, torch.tensor([[0, 1, 2]], dtype=torch.int32), renormalize=False)
    torch.testing.assert_close(w, torch.exp(logits[:, :3].double() / 2).float(), rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# Hyper-connections
# ---------------------------------------------------------------------------------------------------------------


def _hc_module(cls, cfg, g, n: int, mixes: int, scales: int):
    module = cls(cfg).to(torch.float32)
    fn, base, scale = (
        (module.fn, module.base, module.scale)
        if hasattr(module, "fn")
        else (
            module.hc_fn,
            module.hc_base,
            module.hc_scale,
        )
    )
    with torch.no_grad():
        fn.copy_(randn(g, mixes, n * cfg.hidden_size, scale=(n * cfg.hidden_size) ** -0.5))
        base.copy_(randn(g, mixes, scale=0.5))
        scale.copy_(torch.rand(scales, generator=g) * 1.5 + 0.5)
    return module, fn.detach(), base.detach(), scale.detach()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_pre_matches_the_v4_hyper_connection(g, dtype):
    """hc_pre returns DeepseekV4HyperConnection's collapsed input, post and comb (Sinkhorn included) on random
    weights: post and comb to fp32 accuracy of a reordered N*D-term sum, collapsed within one rounding."""
    cfg = config(hidden_size=96, hc_mult=4, hc_sinkhorn_iters=20)
    module, fn, base, scale = _hc_module(transformers_v4.DeepseekV4HyperConnection, cfg, g, 4, 24, 3)
    streams = randn(g, 2, 5, 4, 96, scale=1.5, dtype=dtype)
    with torch.no_grad():
        want_post, want_comb, want_collapsed = module(streams)
    collapsed, post, comb = ops.hc_pre(
        streams.reshape(10, 4, 96), fn, base, scale, sinkhorn_iters=20, eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps
    )
    assert collapsed.dtype == dtype and post.dtype == comb.dtype == torch.float32
    torch.testing.assert_close(post, want_post.reshape(10, 4), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb, want_comb.reshape(10, 4, 4), rtol=1e-5, atol=1e-6)
    rtol = 2.0**-8 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(collapsed.float(), want_collapsed.reshape(10, 96).float(), rtol=rtol, atol=1e-5)
    columns, rows = comb.sum(dim=-2), comb.sum(dim=-1)  # columns normalised last; rows close to one
    assert torch.allclose(columns, torch.ones_like(columns), atol=1e-5)
    assert torch.allclose(rows, torch.ones_like(rows), atol=0.1)
    assert not torch.allclose(comb, comb.transpose(-1, -2), atol=1e-3)  # and not symmetric: the transpose matters


def test_hc_post_matches_the_v4_decoder_layer(g):
    """hc_post is the decoder layer's expansion and mix (comb applied transposed), on hc_pre's own outputs: fp32
    streams give the layer's formula to fp32 accuracy, and comb untransposed would not."""
    cfg = config(hidden_size=64, hc_mult=4)
    module, *_ = _hc_module(transformers_v4.DeepseekV4HyperConnection, cfg, g, 4, 24, 3)
    streams = randn(g, 1, 6, 4, 64)
    block_out = randn(g, 1, 6, 64)
    with torch.no_grad():
        post, comb, _ = module(streams)
        # The decoder layer's expression, verbatim (DeepseekV4DecoderLayer.forward).
        want = post.unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)
    out = ops.hc_post(block_out[0], streams[0], post[0], comb[0])
    torch.testing.assert_close(out, want[0], rtol=1e-5, atol=1e-6)
    untransposed = post[0].unsqueeze(-1) * block_out[0].unsqueeze(-2) + torch.matmul(comb[0], streams[0])
    assert not torch.allclose(out, untransposed, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_head_matches_the_v4_hyper_head(g, dtype):
    """hc_head equals DeepseekV4HyperHead on random weights."""
    cfg = config(hidden_size=80, hc_mult=3)
    module, fn, base, scale = _hc_module(transformers_v4.DeepseekV4HyperHead, cfg, g, 3, 3, 1)
    streams = randn(g, 2, 4, 3, 80, scale=1.5, dtype=dtype)
    with torch.no_grad():
        want = module(streams)
    out = ops.hc_head(streams.reshape(8, 3, 80), fn, base, scale, eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
    assert out.dtype == dtype
    rtol = 2.0**-8 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), want.reshape(8, 80).float(), rtol=rtol, atol=1e-5)


def test_a_comb_applied_untransposed_fails_every_hc_post_case():
    """example_buggy's hc_post forgets comb's transpose: conformance fails each of its cases (T > 0)."""
    from deepinfer.conformance import run_conformance

    report = run_conformance("example_buggy", seed=53, only_ops=["hc_post"])
    accuracy = {r.case: r.status for r in report.results if r.check == "accuracy"}
    assert accuracy and all(s == ("pass" if case.startswith("T=0 ") else "fail") for case, s in accuracy.items())
