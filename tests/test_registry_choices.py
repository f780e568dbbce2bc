"""Why an implementation declines a call, which one runs instead, and where that is shown: ``Decline`` answers of
``supports``, ``dispatch.explain`` / ``explain_call``, ``deepinfer info --ops --shapes``, conformance reports naming
the kernel that ran, and ``cuda_sm100``'s ``mla_decode`` kernels as registered implementations (their choice checked
with fake GPU facts: the Gluon kernels cannot run on the CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from fake_plugins import backend_module

import deepinfer
from deepinfer import Decline, dispatch, ops, registry
from deepinfer.cli import main
from deepinfer.conformance import run_conformance
from deepinfer.conformance.choices import case_choices
from deepinfer.errors import FallbackWarning
from deepinfer.records import verdict

# Two rms_norm kernels: "narrow" serves at most 4 rows and says why it declines more; "any" serves every call and is
# not batch-invariant. Each scales differently, so the output shows which one ran.
TWO_KERNELS = backend_module("fake_k", impls="KERNELS") + textwrap.dedent("""
    def narrow_supports(x, w, eps, residual):
        return True if x.shape[0] <= 4 else deepinfer.Decline(f"{x.shape[0]} rows > 4")

    KERNELS = [
        OpImpl("rms_norm", "fake_k", "narrow", lambda x, w, eps, residual: (x * 0.5, x), supports=narrow_supports,
               batch_invariant=True, priority=2),
        OpImpl("rms_norm", "fake_k", "any", lambda x, w, eps, residual: (x * 0.25, x), priority=1),
    ]
    """)


def test_decline_is_falsy_and_carries_its_reason():
    answer = Decline("q is float32, expected bfloat16")
    assert not answer
    assert verdict(answer) == (False, "q is float32, expected bfloat16")
    assert verdict(False) == (False, "no reason given")
    assert verdict(True) == (True, "")


def test_a_declining_kernel_hands_the_call_to_the_next_and_says_why(plugins):
    plugins("fake_k", {"fake_k": "fake_k"}, {"fake_k": TWO_KERNELS})
    w = torch.rand(8) + 0.5
    few, many = torch.randn(3, 8), torch.randn(6, 8)
    with deepinfer.use("fake_k"):
        assert torch.equal(ops.rms_norm(few, w, 1e-6)[0], few * 0.5)
        assert dispatch.last_resolution("rms_norm")[0].provider == "narrow"
        assert torch.equal(ops.rms_norm(many, w, 1e-6)[0], many * 0.25)
        assert dispatch.last_resolution("rms_norm")[0].provider == "any"
        args = {"w": w, "eps": 1e-6, "residual": None}
        got = [(c.impl.provider, c.status, c.reason) for c in dispatch.explain("rms_norm", {"x": many, **args})]
        assert got == [("narrow", "declined", "6 rows > 4"), ("any", "taken", "")]
        got = [(c.impl.provider, c.status) for c in dispatch.explain("rms_norm", {"x": few, **args})]
        assert got == [("narrow", "taken"), ("any", "not tried")]
        with deepinfer.batch_invariant():  # "any" is not batch-invariant: nothing is left for 6 rows
            got = [(c.impl.provider, c.status, c.reason) for c in dispatch.explain("rms_norm", {"x": many, **args})]
            assert got == [
                ("narrow", "declined", "6 rows > 4"),
                ("any", "skipped", "not batch-invariant"),
                ("torch", "fallback", "no implementation of 'fake_k' accepts these arguments"),
            ]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FallbackWarning)
                out = ops.rms_norm(many, w, 1e-6)[0]
            assert dispatch.last_resolution("rms_norm") == (registry.get().impls_for("reference", "rms_norm")[0], True)
            ref = many / many.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * w
            torch.testing.assert_close(out, ref)


def test_explain_call_runs_no_kernel_and_sees_the_validated_arguments(plugins):
    source = backend_module("fake_j", impls="KERNELS") + textwrap.dedent("""
        RAN = []
        KERNELS = [OpImpl("rms_norm", "fake_j", "k", lambda x, w, eps, residual: RAN.append(1) or (x, x))]
        """)
    plugins("fake_j", {"fake_j": "fake_j"}, {"fake_j": source})
    ran = registry.get().impls_for("fake_j", "rms_norm")[0].fn.__globals__["RAN"]
    x = torch.randn(2, 8)
    with deepinfer.use("fake_j"):
        choices = dispatch.explain_call("rms_norm", lambda: ops.rms_norm(x, torch.ones(8), 1e-6))
        assert [(c.impl.provider, c.status) for c in choices] == [("k", "taken")]
        assert ran == []
        with pytest.raises(deepinfer.InputError):  # validation comes first, as in a real call
            dispatch.explain_call("rms_norm", lambda: ops.rms_norm(x, torch.ones(5), 1e-6))
        with pytest.raises(LookupError):
            dispatch.explain_call("rms_norm", lambda: None)
        ops.rms_norm(x, torch.ones(8), 1e-6)  # the interception is gone
    assert ran == [1]


def test_case_choices_of_the_example_plugin_name_providers_and_reasons():
    choices = case_choices("example_cpu", "small", only_ops=["gemm", "silu_and_mul"])
    gemm = {(c.case, c.mode): c for c in choices if c.op == "gemm"}
    fp8 = [c for (case, _), c in gemm.items() if " fp8 " in f" {case} " or case.endswith(" fp8")]
    bf16 = [c for (case, _), c in gemm.items() if "bf16" in case]
    assert fp8 and bf16
    assert all(c.taken == "torch-blocked" and c.declined == () for c in fp8)
    # a plain False from gemm_supports: the fallback, without a reason
    assert all(
        c.taken == "reference (fallback)" and c.declined == (("torch-blocked", "no reason given"),) for c in bf16
    )
    silu = [c for c in choices if c.op == "silu_and_mul"]
    quantized = [c for c in silu if c.taken == "reference (fallback)"]
    assert quantized and all(c.declined == (("torch", "quantize=True: no FP8 output here"),) for c in quantized)
    assert {c.mode for c in silu} == {"default", "batch-invariant"}  # its silu_and_mul is declared batch-invariant
    assert {c.mode for c in choices if c.op == "gemm"} == {"default"}
    assert not [c for c in choices if c.error]


def test_case_choices_agree_with_the_kernel_the_conformance_report_names():
    only = ["gemm", "silu_and_mul", "rms_norm"]
    report = run_conformance("example_cpu", seed=5, only_ops=only)
    ran = {}
    for r in report.results:
        if r.check == "accuracy":
            mode = "batch-invariant" if "batch-invariant mode" in r.detail else "default"
            ran[(r.op, r.case, mode)] = r.impl
    choices = case_choices("example_cpu", "small", only_ops=only)
    assert {(c.op, c.case, c.mode) for c in choices} >= set(ran)
    assert {(c.op, c.case) for c in choices if c.mode == "default"} == {(op, case) for op, case, _ in ran}
    for c in choices:  # the report checks batch-invariant mode apart only where another implementation runs there
        name = c.taken if "fallback" in c.taken else f"example_cpu/{c.taken}"
        assert ran.get((c.op, c.case, c.mode), ran[(c.op, c.case, "default")]) == name, c


def test_info_ops_lists_providers_in_order_and_the_choice_per_case(capsys):
    assert main(["info", "--ops", "--backend", "example_cpu", "--shapes", "small", "--only", "silu_and_mul"]) == 0
    out = capsys.readouterr().out
    assert "in the order tried" in out
    assert "Implementation taken per conformance case on example_cpu (small shapes)" in out
    assert "quantize=True: no FP8 output here" in out
    assert "batch-invariant" in out and "reference (fallback)" in out
    assert main(["info", "--ops", "--shapes", "small", "--only", "nope"]) == 2
    assert "argument --only: expected ops among" in capsys.readouterr().out


# --- cuda_sm100: mla_decode's kernels -----------------------------------------------------------------------------

attention = pytest.importorskip("deepinfer_cuda_sm100.attention")
SMS = 132


@pytest.fixture
def hopper(monkeypatch):
    """cuda_sm100 as it sees an H100/H200 (132 SMs, SM90) while the tensors stay on the CPU."""
    if attention.mla_gluon is None:
        pytest.skip("this Triton has no Gluon Hopper language")
    monkeypatch.setattr(attention, "num_sms", lambda index=0: SMS)
    monkeypatch.setattr(attention, "on_device", lambda *tensors: True)
    monkeypatch.setattr(attention.mla_gluon, "on_hopper", lambda t: True)
    if "cuda_sm100" not in registry.get().backends or not registry.get().impls_for("cuda_sm100", "mla_decode"):
        pytest.skip("cuda_sm100 registers no kernels here")


def _mla_args(batch: int, context: int, kv_format: str = "bf16", heads: int = 128, page: int = 64) -> dict:
    """DeepSeek-V3's mla_decode arguments (latent 512, rope 64) at one query per row; only shapes decide the kernel."""
    q = torch.randn(batch, 1, heads, 576, dtype=torch.bfloat16)
    if kv_format == "fp8_ds_mla":
        cache = torch.randint(0, 255, (4, page, 656), dtype=torch.uint8)
    else:
        cache = torch.randn(4, page, 576, dtype=torch.bfloat16)
    table = torch.randint(0, 4, (batch, context // page), dtype=torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    return dict(
        q=q, kv_cache=cache, block_table=table, seq_lens=lens, softmax_scale=0.1, kv_lora_rank=512, kv_format=kv_format
    )


def _expected(batch: int, context: int, invariant: bool, gluon: bool = True) -> str:
    """The kernel mla_decode ran before its kernels were registered, as that code branched: the Gluon kernels where
    they apply, scores first in batch-invariant mode at up to a quarter of the SMs' programs, else the split kernel,
    in latent halves up to half of them. Spans: 2048 tokens in batch-invariant mode; else 4096 halved while the grid
    holds fewer than half a program per SM, down to 64."""
    if not gluon:
        return "triton-fixed-split" if invariant else "triton-split"
    split = 2048
    if not invariant:
        split = 4096
        while split > 64 and batch * 2 * -(-context // split) < 0.5 * SMS:
            split //= 2
    programs = batch * 2 * -(-context // split)  # 128 heads: two blocks of 64
    if invariant and programs <= 0.25 * SMS:
        return "gluon-scores-first"
    name = "gluon-split-halves" if programs <= 0.5 * SMS else "gluon-split"
    return name.replace("split", "fixed-split") if invariant else name


GRID = [(b, ctx) for b in (1, 2, 8, 16, 32, 64, 128) for ctx in (512, 1024, 4096, 16384)]


def test_mla_decode_registers_each_kernel_in_the_order_tried():
    if not registry.get().impls_for("cuda_sm100", "mla_decode"):
        pytest.skip("cuda_sm100 registers no kernels here")
    impls = registry.get().impls_for("cuda_sm100", "mla_decode")
    names = [(i.provider, i.batch_invariant) for i in impls]
    expected = ["gluon-split-halves", "gluon-split", "triton-split"]
    expected += ["gluon-scores-first", "gluon-fixed-split-halves", "gluon-fixed-split", "triton-fixed-split"]
    if attention.mla_gluon is None:
        expected = [e for e in expected if not e.startswith("gluon")]
    assert [n for n, _ in names] == expected
    assert all(inv == ("fixed" in n or "scores" in n) for n, inv in names)


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("invariant", [False, True])
def test_mla_decode_takes_the_kernel_it_took_before_and_says_why(hopper, kv_format, invariant):
    for batch, context in GRID:
        kwargs = _mla_args(batch, context, kv_format)
        with deepinfer.batch_invariant(invariant):
            choices = dispatch.explain("mla_decode", kwargs, "cuda_sm100")
        taken = next(c for c in choices if c.status == "taken").impl.provider
        assert taken == _expected(batch, context, invariant), (batch, context)
        kernel = attention.mla_kernel(
            kwargs["q"], kwargs["kv_cache"], kwargs["block_table"], kv_lora_rank=512, kv_format=kv_format,
            invariant=invariant,
        )  # fmt: skip
        assert taken.replace("fixed-", "") == kernel  # a direct call without ``kernel`` launches the same one
        for c in choices:
            if c.status == "declined" and c.impl.provider in ("gluon-scores-first", "gluon-split-halves"):
                share = 0.25 if "scores" in c.impl.provider else 0.5
                assert c.reason.endswith(f"programs > {share:g} x {SMS} SMs"), c.reason


def test_mla_decode_gluon_kernels_decline_with_the_unmet_condition(hopper, monkeypatch):
    def reasons(**changes) -> dict[str, str]:
        kwargs = _mla_args(64, 4096, **changes)
        return {c.impl.provider: c.reason for c in dispatch.explain("mla_decode", kwargs, "cuda_sm100")}

    got = reasons(heads=32)
    assert got["gluon-split-halves"] == got["gluon-split"] == "32 heads < 64"
    assert reasons(page=32)["gluon-split"] == "pages of 32 tokens, not a multiple of 64"
    kwargs = _mla_args(64, 4096)
    kwargs["kv_cache"] = torch.randn(4 * 64 * 576 + 1, dtype=torch.bfloat16)[1:].view(4, 64, 576)  # 2-byte aligned
    got = {c.impl.provider: c.reason for c in dispatch.explain("mla_decode", kwargs, "cuda_sm100")}
    assert got["gluon-split"] == "the cache's records cannot be read by TMA copies"
    monkeypatch.setattr(attention.mla_gluon, "on_hopper", lambda t: False)
    assert reasons()["gluon-split"] == "q is not on an SM90 (Hopper) GPU"
    monkeypatch.setattr(attention.mla_gluon, "on_hopper", lambda t: True)
    monkeypatch.setattr(attention, "MLA_GLUON", False)
    got = reasons()
    assert got["gluon-split"] == "MLA_GLUON is off" and got["triton-split"] == ""
    kwargs = _mla_args(2, 512)
    kwargs["q"] = kwargs["q"].float()
    got = {c.impl.provider: (c.status, c.reason) for c in dispatch.explain("mla_decode", kwargs, "cuda_sm100")}
    assert got["triton-split"] == ("declined", "q is torch.float32, expected torch.bfloat16")
    assert got["torch"][0] == "fallback"


INTERPRETER_REPORT = """
import json, sys
from deepinfer.conformance import run_conformance
from deepinfer.conformance.choices import case_choices
report = run_conformance("cuda_sm100", device="cpu", seed=3, only_ops=["mla_decode"])
choices = case_choices("cuda_sm100", "small", "cpu", ["mla_decode"])
ran = [[r.case, "batch-invariant" if "batch-invariant mode" in r.detail else "default", r.impl, r.status]
       for r in report.results if r.check == "accuracy"]
json.dump({"ran": ran, "choices": [[c.case, c.mode, c.taken] for c in choices]}, sys.stdout)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the Triton interpreter is installed on Linux")
def test_conformance_report_names_the_mla_decode_kernel_that_ran():
    """Through the interpreter the Triton split kernels run; the report names them as the choices do."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", INTERPRETER_REPORT], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    ran = {(case, mode): (impl, status) for case, mode, impl, status in body["ran"]}
    assert {impl for impl, _ in ran.values()} == {"cuda_sm100/triton-split", "cuda_sm100/triton-fixed-split"}
    assert all(status == "pass" for _, status in ran.values())
    assert len(body["choices"]) == len(ran)
    for case, mode, taken in body["choices"]:
        assert ran[(case, mode)][0] == f"cuda_sm100/{taken}"


def test_gemm_kernels_say_why_they_decline(monkeypatch):
    """The Gluon FP8 kernels as an SM90 GPU of 132 SMs sees them: the short-K kernel wants 384 rows, the few-row one
    a grid that fits the SMs once."""
    gemm_gluon = pytest.importorskip("deepinfer_cuda_sm100.gemm_gluon")
    if not any(i.provider == "gluon-fp8-few" for i in registry.get().impls_for("cuda_sm100", "gemm")):
        pytest.skip("cuda_sm100 registers no Gluon gemm here")
    from deepinfer.qtensor import quantize_blocks, quantize_rows

    monkeypatch.setattr(gemm_gluon, "INTERPRET", False)
    monkeypatch.setattr(gemm_gluon, "on_device", lambda *tensors: True)
    monkeypatch.setattr(gemm_gluon, "hopper", lambda index: True)
    monkeypatch.setattr(gemm_gluon, "num_sms", lambda *_: SMS)
    w = quantize_blocks(torch.randn(7168, 2048))

    def explain(m: int) -> dict[str, tuple[str, str]]:
        kwargs = dict(a=quantize_rows(torch.randn(m, 2048), 128, "fp32"), w=w, out_dtype=torch.bfloat16, bias=None)
        return {c.impl.provider: (c.status, c.reason) for c in dispatch.explain("gemm", kwargs, "cuda_sm100")}

    got = explain(4)
    assert got["gluon-fp8-ws"] == ("declined", f"4 rows < {gemm_gluon.MIN_M}")
    assert got["gluon-fp8-few"] == ("taken", "")
    got = explain(65)  # 7168 / 64 weight-row tiles x 2 row tiles of A
    assert got["gluon-fp8-few"] == ("declined", f"224 programs > {SMS} SMs")


# --- every backend's declines say why ------------------------------------------------------------------------------

DECLINES = """
import json, sys
from deepinfer.conformance.choices import case_choices
rows = []
for c in case_choices(sys.argv[1], "small", "cpu"):
    assert not c.error, (c.op, c.case, c.error)
    rows += [[c.op, c.case, provider, why] for provider, why in c.declined]
    rows += [[c.op, c.case, c.taken, ""]] if "fallback" in c.taken else []
json.dump(rows, sys.stdout)
"""
ASCEND_DOUBLE = os.path.join(os.path.dirname(__file__), "ascend", "double")


def _declines(backend: str, **env: str) -> list[list[str]]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    done = subprocess.run(
        [sys.executable, "-c", DECLINES, backend], capture_output=True, text=True, env={**environ, **env}, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


@pytest.mark.skipif(sys.platform != "linux", reason="the Triton interpreter is installed on Linux")
def test_cuda_sm100_declines_say_why_over_the_small_grid():
    rows = _declines("cuda_sm100", TRITON_INTERPRET="1")
    assert rows, "the Gluon kernels decline on the CPU: there must be rows"
    assert not [r for r in rows if "fallback" in r[2]]  # every small case runs a kernel of the backend
    assert not [r for r in rows if r[3] in ("", "no reason given")], [r for r in rows if not r[3]][:5]


@pytest.mark.parametrize("soc", ["", "Ascend910B3"])
def test_ascend_declines_say_why_over_the_small_grid(soc):
    """The emulated 950 and A2: each fused operator that declines says which argument or capability it lacks."""
    env = {"PYTHONPATH": os.pathsep.join([ASCEND_DOUBLE, os.environ.get("PYTHONPATH", "")])}
    if soc:
        env["DEEPINFER_TORCH_NPU_DOUBLE_SOC"] = soc
    rows = _declines("ascend", **env)
    declined = [r for r in rows if "fallback" not in r[2]]
    assert declined and not [r for r in declined if r[3] in ("", "no reason given")]
    reasons = {(op, why) for op, _, _, why in declined}
    assert ("gemm", "w is dense, not an FP8 QTensor") in reasons
    assert ("quantize_fp8", "scale_format 'ue8m0', expected 'fp32'") in reasons or soc
    if soc:  # the A2 has no FP8: the FP8 cases of the fused operators decline by the capability, then fall back
        assert ("gemm", "this chip (Ascend910B3) lacks the fp8_block_gemm capability") in reasons
        fallbacks = {op for op, _, taken, _ in rows if "fallback" in taken}
        assert fallbacks and fallbacks <= {"silu_and_mul", "write_index_cache", "write_kv_cache"}, fallbacks
        for op, case, taken, _ in rows:
            if "fallback" in taken:
                assert any(r[0] == op and r[1] == case and r[3] for r in declined), (op, case)


def test_cuda_sm100_supports_name_the_argument_and_the_condition(monkeypatch):
    """Direct ``supports`` calls with inputs each outside one condition, the kernels' device taken to be the CPU (as
    under the interpreter): a tensor elsewhere declines by its name."""
    try:
        from deepinfer_cuda_sm100 import _triton, compressed_attention, moe, norm, rope
    except ImportError:
        pytest.skip("cuda_sm100's kernels need Triton")
    monkeypatch.setattr(_triton, "device_type", lambda: "cpu")
    here = "cpu"
    x = torch.randn(3, 8, device=here)
    assert verdict(norm.supports(x, torch.ones(8, device="meta"), 1e-6, None)) == (
        False,
        f"w is on meta, expected {here}",
    )
    assert verdict(norm.supports(torch.randn(2, 70000, device=here), torch.ones(70000, device=here), 1e-6, None)) == (
        False,
        "x's rows of 70000 > 65536 elements",
    )
    q = torch.randn(2, 4, 12, device=here)  # rotary half 6
    pos = torch.arange(2, device=here)
    assert verdict(rope.supports(q, pos, torch.randn(4, 12, device=here), False)) == (
        False,
        "x's rotary half 6 is not a power of two",
    )
    assert verdict(rope.supports(q[:, :, ::2], pos, torch.randn(4, 6, device=here), False))[1] == (
        "x's last dimension is not contiguous"
    )
    logits = torch.randn(2, 2048, device=here)
    got = moe.route_supports(logits, None, top_k=8, n_group=1, topk_group=1, renormalize=True,
                             routed_scaling_factor=1.0, scoring="sigmoid")  # fmt: skip
    assert verdict(got) == (False, "logits has 2048 experts > 1024")
    kv = torch.randn(2, 300, 8, device=here)
    assert verdict(compressed_attention.compress_supports(kv, kv, torch.randn(300, 8, device=here))) == (
        False,
        "kv has 300 slots per window > 256",
    )
    assert norm.supports(x, torch.ones(8, device=here), 1e-6, None) is True


# --- cuda_sm100: gemm's and grouped_gemm's Triton kernels ------------------------------------------------------------


@pytest.fixture
def triton_only(monkeypatch):
    """cuda_sm100's ``supports`` with the kernels' device taken to be the CPU and cuBLAS and Gluon declining (as under
    the interpreter): the Triton kernels' choice alone, for an H200's 132 SMs."""
    gemm = pytest.importorskip("deepinfer_cuda_sm100.gemm")
    if not registry.get().impls_for("cuda_sm100", "grouped_gemm"):
        pytest.skip("cuda_sm100 registers no kernels here")
    from deepinfer_cuda_sm100 import _triton, gemm_cublas

    monkeypatch.setattr(_triton, "device_type", lambda: "cpu")
    monkeypatch.setattr(gemm_cublas, "INTERPRET", True)
    monkeypatch.setattr(gemm, "num_sms", lambda *_: SMS)
    try:
        from deepinfer_cuda_sm100 import gemm_gluon, gemm_gluon_grouped
    except ImportError:
        pass
    else:
        monkeypatch.setattr(gemm_gluon, "INTERPRET", True)
        monkeypatch.setattr(gemm_gluon_grouped, "INTERPRET", True)
    return gemm


def _taken(op: str, kwargs: dict, invariant: bool) -> str:
    with deepinfer.batch_invariant(invariant):
        choices = dispatch.explain(op, kwargs, "cuda_sm100")
    return next(c for c in choices if c.status == "taken").impl.provider


@pytest.mark.parametrize("invariant", [False, True])
def test_fp8_gemm_takes_the_triton_kernel_it_took_before(triton_only, invariant):
    """The old branching inside ``gemm_fp8``: the swapped kernel up to 16 rows, the tiled one above; ``-unsplit``
    in batch-invariant mode. The tile ``gemm_fp8`` launches without ``swap`` agrees."""
    from deepinfer.qtensor import quantize_blocks, quantize_rows

    gemm = triton_only
    for n, k in [(7168, 2048), (2112, 7168), (384, 640)]:
        w = quantize_blocks(torch.randn(n, k))
        for m in (0, 1, 5, 16, 17, 64, 200):
            for a in (quantize_rows(torch.randn(m, k), 128, "fp32"), torch.randn(m, k, dtype=torch.bfloat16)):
                kwargs = dict(a=a, w=w, out_dtype=torch.bfloat16, bias=None)
                want = ("triton-fp8-swapped" if m <= 16 else "triton-fp8") + ("-unsplit" if invariant else "")
                taken = _taken("gemm", kwargs, invariant)
                assert taken == want, (m, n, k, taken)
                if m:
                    assert gemm._tile(m, n, k, True, invariant).swap == ("swapped" in taken)
    kwargs = dict(a=torch.randn(17, 640), w=w, out_dtype=torch.bfloat16, bias=None)
    choices = dispatch.explain("gemm", kwargs, "cuda_sm100")
    reasons = {c.impl.provider: c.reason for c in choices}
    assert reasons["triton-fp8-swapped"] == "a has 17 rows > 16"


@pytest.mark.parametrize("invariant", [False, True])
def test_fp4_grouped_gemm_takes_triton_fp4_and_the_native_place_says_why_not(triton_only, invariant, monkeypatch):
    """FP4 weights: in both layouts for bf16 and fp32 activations, ``triton-fp4-few`` in the masked layout and at a
    few rows per expert in the default mode, ``triton-fp4`` beyond them and in batch-invariant mode; ``tcgen05-fp4``
    declines, naming the missing capability on SM90 and, where the device has ``fp4``, that it has not run there
    yet; the dense and FP8 kernels decline an FP4 weight; an fp16 activation falls back to the reference."""
    from deepinfer.conformance.cases import Gen
    from deepinfer.conformance.gemm import fp4_weight

    gemm = triton_only
    w = fp4_weight(Gen(0, "cpu"), 3, 64, 128)
    layouts = [
        dict(a=(4, 128), expert_offsets=torch.tensor([0, 1, 1, 4], dtype=torch.int32), masked_m=None),
        dict(a=(3, 2, 128), expert_offsets=None, masked_m=torch.tensor([2, 0, 1], dtype=torch.int32)),
    ]
    for layout in layouts:
        for dtype in (torch.bfloat16, torch.float32):
            kwargs = dict(layout, a=torch.randn(*layout["a"], dtype=dtype), w=w, out_dtype=torch.bfloat16)
            assert _taken("grouped_gemm", kwargs, invariant) == ("triton-fp4" if invariant else "triton-fp4-few")
        if layout["masked_m"] is None:  # beyond a few rows per expert (the masked layout is decode's)
            offsets = torch.tensor([0, 17, 34, 51], dtype=torch.int32)
            many = dict(layout, a=torch.randn(51, 128), expert_offsets=offsets, w=w, out_dtype=torch.bfloat16)
            assert _taken("grouped_gemm", many, invariant) == "triton-fp4"
        with deepinfer.batch_invariant(invariant):
            kwargs["a"] = kwargs["a"].half()
            choices = {c.impl.provider: c for c in dispatch.explain("grouped_gemm", kwargs, "cuda_sm100")}
        assert choices["triton-fp4"].reason == "a is torch.float16, expected bfloat16 or float32"
        assert all(c.status in ("declined", "skipped", "fallback") for c in choices.values())
        for kernel in gemm.GROUPED_KERNELS:
            if choices[kernel].status == "declined":
                assert "FP4Tensor" in choices[kernel].reason or "FP8 QTensor" in choices[kernel].reason, kernel
    reasons = {c.impl.provider: c.reason for c in dispatch.explain("grouped_gemm", kwargs, "cuda_sm100")}
    assert reasons["tcgen05-fp4"].startswith("no fp4 capability")
    gemm._capabilities.cache_clear()
    monkeypatch.setattr(gemm.probe, "capabilities", lambda: frozenset({"fp4", "tcgen05"}))
    try:
        reasons = {c.impl.provider: c.reason for c in dispatch.explain("grouped_gemm", kwargs, "cuda_sm100")}
        assert reasons["tcgen05-fp4"].startswith("FP4_TCGEN05 is off")
    finally:
        gemm._capabilities.cache_clear()


def test_fp8_masked_layout_takes_64_row_tiles_past_decode_rows(triton_only):
    """The swapped walk reads each weight tile once per 16 rows: a prefill chunk through a grouped projection (more
    than ``MASKED_SWAPPED_MAX_M`` rows per expert) takes the 64-row tiles, in both modes."""
    from deepinfer.qtensor import quantize_blocks

    gemm = triton_only
    w = quantize_blocks(torch.randn(2, 128, 128))
    for rows, want in [(gemm.MASKED_SWAPPED_MAX_M, "triton-masked-swapped"), (gemm.MASKED_SWAPPED_MAX_M + 1, "triton")]:
        a = torch.randn(2, rows, 128, dtype=torch.bfloat16)
        kwargs = dict(a=a, w=w, expert_offsets=None, masked_m=torch.tensor([rows, 3], dtype=torch.int32))
        for invariant in (False, True):
            assert _taken("grouped_gemm", kwargs | {"out_dtype": torch.bfloat16}, invariant) == want


GROUPED_CASES = [(fp8, masked, rows) for fp8 in (False, True) for masked in (False, True) for rows in (1, 63, 64, 200)]


@pytest.mark.parametrize("invariant", [False, True])
def test_grouped_gemm_takes_the_kernel_it_took_before(triton_only, invariant):
    """The old branching inside ``grouped_gemm``: FP8 in the masked layout swapped; outside batch-invariant mode the
    dense masked layout at up to 63 rows per expert by the decode tile; else the 64 x 128 tiles."""
    from deepinfer.qtensor import quantize_blocks

    gemm = triton_only
    experts, n, k = 3, 256, 256
    for fp8, masked, rows in GROUPED_CASES:
        w = torch.randn(experts, n, k, dtype=torch.bfloat16)
        w = quantize_blocks(w.float()) if fp8 else w
        if masked:
            a = torch.randn(experts, rows, k, dtype=torch.bfloat16)
            layout = dict(expert_offsets=None, masked_m=torch.tensor([rows, 0, rows // 2], dtype=torch.int32))
        else:
            a = torch.randn(experts * rows, k, dtype=torch.bfloat16)
            layout = dict(expert_offsets=torch.arange(0, experts + 1, dtype=torch.int32) * rows, masked_m=None)
        kwargs = dict(a=a, w=w, **layout, out_dtype=torch.bfloat16)
        if fp8 and masked:
            want = "triton-masked-swapped"
        elif masked and rows <= 63 and not invariant:
            want = "triton-decode"
        else:
            want = "triton"
        taken = _taken("grouped_gemm", kwargs, invariant)
        assert taken == want, (fp8, masked, rows, taken)
        assert gemm.grouped_kernel(a, w, masked_m=layout["masked_m"], invariant=invariant) == taken
