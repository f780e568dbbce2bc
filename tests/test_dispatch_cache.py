"""The choice cache of ``dispatch.cached_choices``: inside a block a call signature seen before takes the remembered
implementation without asking the ``supports``, and that is always the implementation the uncached walk
(``dispatch.explain``) gives: the key covers dtypes, shapes, strides, devices, pointer alignment, Python values and
batch-invariant mode; a change between blocks, ``clear_choice_cache()`` and ``registry.reload`` are seen; a transient
decline and an argument the key cannot describe are never remembered; fallbacks still warn once and still raise under
``DEEPINFER_STRICT=1``."""

from __future__ import annotations

import importlib
import textwrap
import warnings

import pytest
import torch
from fake_plugins import backend_module

import deepinfer
from deepinfer import QTensor, TransientDecline, dispatch, registry
from deepinfer.errors import FallbackWarning, NotSupportedError
from deepinfer.qtensor import quantize_blocks, quantize_rows

# Four rms_norm kernels, tried in this order. "waiting" serves 3 rows once its probe has run (READY) and declines
# transiently before; "odd" serves a residual that is an object with ``ok`` set (which the key cannot describe);
# "picky" reads everything the key covers (device, dtype, strides, alignment, rows against the module constant
# MAX_ROWS, a residual given or not, eps); "plain" serves every call but is not batch-invariant. ASKED records each
# supports call.
FOUR_KERNELS = backend_module("fake_c", impls="KERNELS") + textwrap.dedent("""
    import torch
    from deepinfer import Decline, TransientDecline

    MAX_ROWS = 8
    READY = [False]
    ASKED = []

    def waiting_supports(x, w, eps, residual):
        ASKED.append("waiting")
        if x.shape[0] != 3:
            return Decline("serves 3 rows only")
        return True if READY[0] else TransientDecline("its probe has not run yet")

    def odd_supports(x, w, eps, residual):
        ASKED.append("odd")
        return bool(getattr(residual, "ok", False)) or Decline("no residual with ok set")

    def picky_supports(x, w, eps, residual):
        ASKED.append("picky")
        if x.device.type != "cpu":
            return Decline(f"x is on {x.device.type}")
        if x.dtype != torch.bfloat16:
            return Decline(f"x is {x.dtype}")
        if x.stride(-1) != 1 or x.stride(0) != x.shape[-1]:
            return Decline("x's rows are not contiguous")
        if x.data_ptr() % 16:
            return Decline("x is not 16-byte aligned")
        if x.shape[0] > MAX_ROWS:
            return Decline(f"{x.shape[0]} rows > {MAX_ROWS}")
        if residual is not None:
            return Decline("a residual is given")
        return eps < 1e-3 or Decline(f"eps {eps} >= 1e-3")

    def run(x, w, eps, residual):
        return x, x

    KERNELS = [
        OpImpl("rms_norm", "fake_c", "waiting", run, supports=waiting_supports, batch_invariant=True, priority=4),
        OpImpl("rms_norm", "fake_c", "odd", run, supports=odd_supports, batch_invariant=True, priority=3),
        OpImpl("rms_norm", "fake_c", "picky", run, supports=picky_supports, batch_invariant=True, priority=2),
        OpImpl("rms_norm", "fake_c", "plain", run, priority=1),
    ]
    """)


@pytest.fixture
def fake_c(plugins):
    """The ``fake_c`` backend selected; returns its module (constants, READY, ASKED). Fallback warnings are
    silenced."""
    plugins("fake_c", {"fake_c": "fake_c"}, {"fake_c": FOUR_KERNELS})
    with deepinfer.use("fake_c"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        yield importlib.import_module("fake_c")


def at(residue: int, shape: tuple[int, ...], dtype=torch.bfloat16, row_pad: int = 0) -> torch.Tensor:
    """A tensor of ``shape`` (rows padded by ``row_pad`` elements) whose data starts ``residue`` bytes past a multiple
    of ``dispatch.POINTER_ALIGNMENT``: tensors at one residue agree in every part of the key but the one a test
    varies."""
    align = dispatch.POINTER_ALIGNMENT
    size = torch.empty((), dtype=dtype).element_size()
    rows, cols = shape[0], shape[-1] + row_pad
    buf = torch.zeros(rows * cols * size + 2 * align, dtype=torch.uint8)
    start = (residue - buf.data_ptr()) % align
    flat = buf[start : start + rows * cols * size].view(dtype)
    return flat.view(rows, cols)[:, : shape[-1]]


def args(x: torch.Tensor, eps: float = 1e-6, residual=None) -> dict:
    return {"x": x, "w": at(0, (1, 64))[0], "eps": eps, "residual": residual}


def explained(kwargs: dict) -> tuple[str, bool]:
    """The uncached walk's answer: the provider that runs and whether it is the fallback."""
    choice = next(c for c in dispatch.explain("rms_norm", kwargs) if c.status in ("taken", "fallback"))
    return choice.impl.provider, choice.status == "fallback"


def resolved(kwargs: dict) -> tuple[str, bool]:
    impl, fallback = dispatch.resolve("rms_norm", kwargs)
    return impl.provider, fallback


BASE = args(at(0, (4, 64)))
# Each differs from BASE in one thing the key covers, and so does its choice (checked below).
VARIANTS = {
    "dtype": args(at(0, (4, 64), torch.float32)),
    "strides": args(at(0, (4, 64), row_pad=8)),
    "alignment": args(at(2, (4, 64))),
    "shape": args(at(0, (9, 64))),
    "device": args(torch.empty(4, 64, dtype=torch.bfloat16, device="meta")),
    "a python value": args(at(0, (4, 64)), eps=1e-2),
    "None or a tensor": args(at(0, (4, 64)), residual=at(0, (4, 64))),
}


@pytest.mark.parametrize("invariant", [False, True])
def test_a_remembered_choice_is_the_uncached_walks_for_each_part_of_the_key(fake_c, invariant):
    """BASE is remembered first; each variant agrees with it in every part of the key but one, so a key without that
    part would hand the variant BASE's choice."""
    align = dispatch.POINTER_ALIGNMENT
    assert BASE["x"].data_ptr() % align == VARIANTS["strides"]["x"].data_ptr() % align == 0
    with deepinfer.batch_invariant(invariant), dispatch.cached_choices():
        want = explained(BASE)
        assert resolved(BASE) == want == ("picky", False)
        for name, kwargs in VARIANTS.items():
            expected = explained(kwargs)
            assert expected != want, name  # the variant matters to the choice
            assert resolved(kwargs) == expected, name
            assert resolved(kwargs) == expected, name  # remembered now
        assert resolved(BASE) == want


def test_a_remembered_call_asks_no_supports_and_explain_asks_every_time(fake_c):
    with dispatch.cached_choices():
        resolved(BASE)
        asked = len(fake_c.ASKED)
        assert asked == 3  # waiting, odd, picky
        assert resolved(BASE) == ("picky", False)
        assert len(fake_c.ASKED) == asked
        explained(BASE)
        assert len(fake_c.ASKED) == 2 * asked


def test_calls_through_the_op_keep_last_resolution(fake_c):
    with dispatch.cached_choices():
        for rows, provider in ((4, "picky"), (9, "plain"), (4, "picky"), (9, "plain")):
            deepinfer.ops.rms_norm(torch.randn(rows, 64).bfloat16(), torch.ones(64).bfloat16(), 1e-6)
            assert dispatch.last_resolution("rms_norm")[0].provider == provider


def test_batch_invariant_mode_is_part_of_the_key(fake_c):
    nine = args(at(0, (9, 64)))
    with dispatch.cached_choices():
        assert resolved(nine) == ("plain", False)
        with deepinfer.batch_invariant():
            assert resolved(nine) == explained(nine) == ("torch", True)
        assert resolved(nine) == ("plain", False)


def test_a_constant_changed_between_blocks_or_after_clearing_is_seen(fake_c, monkeypatch):
    with dispatch.cached_choices():
        assert resolved(BASE) == ("picky", False)
    monkeypatch.setattr(fake_c, "MAX_ROWS", 2)
    with dispatch.cached_choices():
        assert resolved(BASE) == explained(BASE) == ("plain", False)
        monkeypatch.setattr(fake_c, "MAX_ROWS", 8)
        dispatch.clear_choice_cache()  # (the contract for a change inside a block)
        assert resolved(BASE) == explained(BASE) == ("picky", False)


def test_nothing_is_remembered_outside_a_block(fake_c, monkeypatch):
    assert resolved(BASE) == ("picky", False)
    monkeypatch.setattr(fake_c, "MAX_ROWS", 2)
    assert resolved(BASE) == ("plain", False)
    assert not dispatch._cache.choices


def test_an_inner_block_keeps_the_outer_blocks_choices(fake_c):
    with dispatch.cached_choices():
        resolved(BASE)
        with dispatch.cached_choices():
            asked = len(fake_c.ASKED)
            resolved(BASE)
            assert len(fake_c.ASKED) == asked
        resolved(BASE)
        assert len(fake_c.ASKED) == asked
    assert not dispatch._cache.choices


def test_a_choice_made_past_a_transient_decline_is_not_remembered(fake_c):
    three = args(at(0, (3, 64)))
    with dispatch.cached_choices():
        assert resolved(three) == ("picky", False)
        fake_c.READY[0] = True  # the probe ran: the same call now takes the first kernel
        assert resolved(three) == explained(three) == ("waiting", False)


def test_a_call_with_an_argument_the_key_cannot_describe_is_asked_every_time(fake_c):
    class Marker:
        ok = True

    marked = args(at(0, (4, 64)), residual=Marker())
    assert dispatch._choice_key("rms_norm", "fake_c", False, marked) is None
    with dispatch.cached_choices():
        assert resolved(marked) == ("odd", False)
        Marker.ok = False
        assert resolved(marked) == explained(marked) == ("plain", False)
        assert not dispatch._cache.choices


def test_registry_reload_forgets_the_choices(fake_c, monkeypatch):
    with dispatch.cached_choices():
        assert resolved(BASE) == ("picky", False)
        monkeypatch.setattr(fake_c, "KERNELS", [k for k in fake_c.KERNELS if k.provider != "picky"])
        registry.reload()
        assert resolved(BASE) == explained(BASE) == ("plain", False)


def test_the_cache_is_bounded(fake_c, monkeypatch):
    monkeypatch.setattr(dispatch, "MAX_CHOICES", 4)
    with dispatch.cached_choices():
        for rows in range(4, 16):
            kwargs = args(at(0, (rows, 64)))
            assert resolved(kwargs) == explained(kwargs)
            assert len(dispatch._cache.choices) <= 4


def test_a_remembered_fallback_warns_once_and_raises_under_strict_every_time(plugins, monkeypatch):
    plugins("fake_c", {"fake_c": "fake_c"}, {"fake_c": FOUR_KERNELS})
    monkeypatch.setattr(dispatch, "_warned", set())  # (earlier tests warned for fake_c)
    nine = args(at(0, (9, 64)))  # in batch-invariant mode only "picky" could take it, and it declines
    with deepinfer.use("fake_c"), deepinfer.batch_invariant(), dispatch.cached_choices():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert resolved(nine) == ("torch", True)
            assert resolved(nine) == ("torch", True)
            assert resolved(args(at(0, (10, 64)))) == ("torch", True)
        assert [w.category for w in seen] == [FallbackWarning]
        monkeypatch.setenv("DEEPINFER_STRICT", "1")
        for _ in range(2):
            with pytest.raises(NotSupportedError, match="DEEPINFER_STRICT=1"):
                dispatch.resolve("rms_norm", nine)


def test_keys_describe_quantised_tensors_containers_and_values():
    x, w = torch.randn(4, 256), quantize_blocks(torch.randn(8, 256))
    key = lambda **kwargs: dispatch._choice_key("gemm", "b", False, kwargs)
    a = quantize_rows(x, 128, "fp32")
    assert key(a=a, w=w, bias=None) == key(a=a, w=w, bias=None) is not None
    assert key(a=a, w=w, bias=None) != key(a=QTensor(a.data, a.scale, a.block, "ue8m0"), w=w, bias=None)
    assert key(a=a, w=w, bias=None) != key(a=QTensor(a.data, a.scale, (1, 64)), w=w, bias=None)
    assert key(a=a, w=w, bias=None) != key(a=a, w=w, bias=torch.zeros(8))
    by_type = [dispatch._choice_key("op", "b", False, {"v": v}) for v in (1, 1.0, True)]
    assert len(set(by_type)) == 3  # equal values of different types are different keys
    assert dispatch._choice_key("op", "b", False, {"v": (1, [2, torch.float32])}) is not None
    assert dispatch._choice_key("op", "b", False, {"v": object()}) is None
    assert dispatch._choice_key("op", "b", False, {"v": [torch.float32, object()]}) is None
    # the op and the backend are part of it, and a quantised tensor's scale layout and prepared form
    call = {"a": a, "w": w, "bias": None}
    assert key(**call) != dispatch._choice_key("grouped_gemm", "b", False, call)
    assert key(**call) != dispatch._choice_key("gemm", "c", False, call)
    wide = quantize_blocks(torch.randn(256, 256))
    by_columns = QTensor(wide.data, wide.scale.t().contiguous().t(), wide.block)
    assert key(a=a, w=wide, bias=None) != key(a=a, w=by_columns, bias=None)
    assert key(a=a, w=w, bias=None) != key(a=a, w=QTensor(w.data, w.scale, w.block, prepared=object()), bias=None)


# --- cuda_sm100's gemm and mla_decode kernels, as an SM90 GPU of 132 SMs sees them (the tensors stay on the CPU) -----


@pytest.fixture
def sm90(monkeypatch):
    gemm_gluon = pytest.importorskip("deepinfer_cuda_sm100.gemm_gluon")
    attention = pytest.importorskip("deepinfer_cuda_sm100.attention")
    if not any(i.provider == "gluon-fp8-few" for i in registry.get().impls_for("cuda_sm100", "gemm")):
        pytest.skip("cuda_sm100 registers no Gluon gemm here")
    _triton = importlib.import_module("deepinfer_cuda_sm100._triton")
    gemm_cublas = importlib.import_module("deepinfer_cuda_sm100.gemm_cublas")
    monkeypatch.setattr(_triton, "device_type", lambda: "cpu")
    for module in (gemm_gluon, gemm_cublas):
        monkeypatch.setattr(module, "INTERPRET", False)
        monkeypatch.setattr(module, "num_sms", lambda *_: 132)
    monkeypatch.setattr(gemm_gluon, "hopper", lambda index: True)
    monkeypatch.setattr(gemm_cublas, "_cublas_fp8_ready", lambda: True)

    def agreed(key: tuple, probe) -> bool:  # cuBLAS "gave the unsplit bits" at multiples of 512 rows
        rows = key[1] if key[0] == "dense" else key[0]
        return rows % 512 == 0

    monkeypatch.setattr(gemm_cublas, "_cublas_agreed", agreed)
    monkeypatch.setattr(attention, "num_sms", lambda index=0: 132)
    monkeypatch.setattr(attention, "on_device", lambda *tensors: True)
    if attention.mla_gluon is not None:
        monkeypatch.setattr(attention.mla_gluon, "on_hopper", lambda t: True)


def _gemm_calls() -> list[tuple[tuple, dict]]:
    """(label, kwargs) of gemm calls: FP8 weights against aligned, 2-bytes-past and strided bf16 rows, FP8 rows and
    an fp32 result; bf16 and fp32 weights, with and without a bias; from 1 to 1100 rows."""
    gen = torch.Generator().manual_seed(0)
    fp8 = {k: quantize_blocks(torch.randn(2112, k, generator=gen) * 0.05) for k in (512, 1536)}
    dense = torch.randn(2112, 512, generator=gen).bfloat16()
    router = torch.randn(64, 512, generator=gen)
    calls = []
    for m in (1, 4, 16, 64, 200, 384, 512, 1024, 1100):
        for k, w in fp8.items():
            a = at(0, (m, k))
            variants = {
                "aligned": a,
                "2 bytes past": at(2, (m, k)),
                "strided": at(0, (m, k), row_pad=4),  # rows 8 bytes past a multiple of 16
                "fp8 rows": quantize_rows(a.float(), 128, "fp32"),
            }
            rows = variants["fp8 rows"]
            past = at(2, (m, k), torch.float8_e4m3fn).copy_(rows.data)
            variants["fp8 rows 2 bytes past"] = QTensor(past, rows.scale, rows.block, rows.scale_format)
            calls += [((m, k, v), dict(a=x, w=w, out_dtype=torch.bfloat16, bias=None)) for v, x in variants.items()]
            calls.append(((m, k, "fp32 out"), dict(a=a, w=w, out_dtype=torch.float32, bias=None)))
        a = at(0, (m, 512))
        calls.append(((m, "bf16 w"), dict(a=a, w=dense, out_dtype=torch.bfloat16, bias=None)))
        calls.append(((m, "fp32 w"), dict(a=a, w=router, out_dtype=torch.float32, bias=None)))
        calls.append(((m, "bias"), dict(a=a, w=dense, out_dtype=torch.bfloat16, bias=torch.zeros(2112).bfloat16())))
    return calls


def _mla_calls() -> list[tuple[tuple, dict]]:
    """(label, kwargs) of DeepSeek-V3's mla_decode at a few batches and contexts, over a cache that starts 16-byte
    aligned or 2 bytes past."""
    calls = []
    for batch, context in ((1, 512), (2, 4096), (16, 4096), (64, 16384)):
        q = torch.randn(batch, 1, 128, 576, dtype=torch.bfloat16)
        table = torch.zeros(batch, context // 64, dtype=torch.int32)
        lens = torch.full((batch,), context, dtype=torch.int32)
        for residue in (0, 2):
            kv = at(residue, (4 * 64, 576)).view(4, 64, 576)
            kwargs = dict(q=q, kv_cache=kv, block_table=table, seq_lens=lens, softmax_scale=0.1, kv_lora_rank=512)
            calls.append(((batch, context, residue), kwargs | {"kv_format": "bf16"}))
    return calls


def test_cuda_sm100_remembered_choices_are_the_uncached_walks(sm90):
    """Every call twice in each mode inside one block (the second from the cache), against ``explain``; alignment
    (of a tensor, of a QTensor's data), strides, the result's dtype and the mode each change the kernel somewhere."""
    taken = {}
    calls = [("gemm", *call) for call in _gemm_calls()] + [("mla_decode", *call) for call in _mla_calls()]
    with dispatch.cached_choices(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        for invariant in (False, True):
            with deepinfer.batch_invariant(invariant):
                for op, label, kwargs in calls:
                    explained = dispatch.explain(op, kwargs, "cuda_sm100")
                    want = next(c for c in explained if c.status in ("taken", "fallback"))
                    for _ in range(2):
                        impl, fallback = dispatch.resolve(op, kwargs, "cuda_sm100")
                        assert (impl, fallback) == (want.impl, want.status == "fallback"), (op, label, invariant)
                    taken[(invariant, op, *label)] = want.impl.provider
        assert len(dispatch._cache.choices) > 100
    assert len(set(taken.values())) >= 10
    assert any(taken[(False, *call)] != taken[(True, *call)] for call in {k[1:] for k in taken})
    shapes = [(m, k) for m in (1, 4, 16, 64, 200, 384, 512, 1024, 1100) for k in (512, 1536)]
    differs = lambda base, variant: any(
        taken[(mode, "gemm", *shape, base)] != taken[(mode, "gemm", *shape, variant)]
        for mode in (False, True)
        for shape in shapes
    )
    assert differs("aligned", "2 bytes past") and differs("aligned", "strided") and differs("aligned", "fp32 out")
    assert differs("fp8 rows", "fp8 rows 2 bytes past")
    if importlib.import_module("deepinfer_cuda_sm100.attention").mla_gluon is not None:
        assert taken[(False, "mla_decode", 2, 4096, 0)] != taken[(False, "mla_decode", 2, 4096, 2)]


def test_cublas_declines_an_unasked_row_count_inside_graph_capture_transiently(monkeypatch):
    """Inside a CUDA graph capture cuBLAS's agreement is never asked for the first time: that decline may turn into a
    yes after the capture, so it is transient; an answer asked before is not."""
    gemm_cublas = pytest.importorskip("deepinfer_cuda_sm100.gemm_cublas")
    monkeypatch.setattr(importlib.import_module("deepinfer_cuda_sm100._triton"), "device_type", lambda: "cpu")
    monkeypatch.setattr(gemm_cublas, "INTERPRET", False)
    monkeypatch.setattr(gemm_cublas, "_cublas_answers", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    w, a = torch.randn(96, 512).bfloat16(), torch.randn(256, 512).bfloat16()
    dense = lambda: gemm_cublas.cublas_invariant_supports(a, w, out_dtype=torch.bfloat16, bias=None)
    assert not dense() and isinstance(dense(), TransientDecline)
    gemm_cublas._cublas_answers[("dense", 256, 96, 512, torch.bfloat16, torch.bfloat16, 0)] = False
    assert not dense() and not isinstance(dense(), TransientDecline)
    fp8 = gemm_cublas.cublas_fp8_supports(a, quantize_blocks(w.float()), out_dtype=torch.bfloat16, bias=None)
    assert not fp8 and isinstance(fp8, TransientDecline) == (gemm_cublas._cublas_fp8_agrees.cache_info().currsize == 0)
