"""Conformance cases for ``quantize_fp8``, ``gemm``, ``grouped_gemm`` (FP4 expert weights included)."""

from __future__ import annotations

import torch

from ..qtensor import FP4_GROUP, UE8M0_DTYPE, FP4Tensor, QTensor, quantize_blocks, quantize_rows
from .cases import BadInput, Case, Gen, error, rows_of, run_masked, take_masked_rows, take_rows

# DeepSeek-V3 projections (N, K): q_a+kv_a fused, q_b, kv_b, o, shared/dense down, kv_a alone.
V3_PROJECTIONS = [(24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048), (2112, 7168)]
# DeepSeek-V4-Flash's routed experts (N, K): gate and up fused (2 x moe_intermediate 2048 by hidden 4096), down.
V4_FLASH_EXPERTS = [(4096, 4096), (4096, 2048)]


def fp4_weight(g: Gen, *shape: int) -> FP4Tensor:
    """A random ``FP4Tensor`` of logical shape ``[..., N, K]`` drawn on the device: every byte (so every pair of
    e2m1 codes, both zeros and both signs included) equally likely, and per 32 values a power of two within a factor
    of 4 of ``1 / (2.5 sqrt(K))``, so that products stay near unit size."""
    dev = torch.Generator(device=g.device).manual_seed(int(torch.randint(0, 2**62, (1,), generator=g.cpu)))
    *lead, n, k = shape
    data = torch.randint(-128, 128, (*lead, n, k // 2), generator=dev, device=g.device, dtype=torch.int8)
    base = 127 - round(torch.log2(torch.tensor(2.5 * k**0.5)).item())
    exponents = torch.randint(base - 2, base + 2, (*lead, n, k // FP4_GROUP), generator=dev, device=g.device)
    return FP4Tensor(data, exponents.to(torch.uint8).view(UE8M0_DTYPE))


def _weight(g: Gen, *shape: int, fp8: bool, ue8m0: bool = False, dtype=torch.bfloat16):
    w = g.randn(*shape, dtype=torch.float32, scale=shape[-1] ** -0.5)
    if fp8:
        return quantize_blocks(w, (128, 128), "ue8m0" if ue8m0 else "fp32")
    return w.to(dtype)


def _act(g: Gen, *shape: int, variant: str, ue8m0: bool = False):
    x = g.randn(*shape, dtype=torch.float32 if variant == "fp32" else torch.bfloat16)
    if variant == "fp8":
        return quantize_rows(x, 128, "ue8m0" if ue8m0 else "fp32")
    return x


def _nan_groups(out: QTensor, ref: QTensor, kw: dict) -> float:
    """inf unless the scales are NaN exactly in the groups of ``x`` holding a NaN; else the error of the other
    groups (the data of a NaN group is unspecified)."""
    nan = kw["x"].isnan().unflatten(-1, (-1, kw["block"])).any(-1)
    if not (torch.equal(out.scale.isnan(), nan) and torch.equal(ref.scale.isnan(), nan)):
        return float("inf")
    keep = ~nan.repeat_interleave(kw["block"], dim=-1)
    return error(out.dequantize().where(keep, 0.0), ref.dequantize().where(keep, 0.0))


def _quantize_case(m: int, k: int, fmt: str, experts: int = 0, nans: int = 0) -> Case:
    shape = (experts, m, k) if experts else (m, k)

    def make(g: Gen):
        x = g.randn(*shape, scale=3.0)
        x.view(-1)[g.perm(x.numel())[:nans].to(x.device)] = float("nan")
        return {"x": x, "block": 128, "scale_format": fmt}

    return Case(
        "quantize_fp8",
        f"x{list(shape)} {fmt}" + (f" {nans} NaN" if nans else ""),
        fmt,
        make,
        compare=_nan_groups if nans else None,
        sub_batch=None if experts else (lambda kw, rows: (take_rows(kw, ("x",), rows), lambda o: rows_of(o, rows))),
        batch=lambda kw: kw["x"].shape[0],
    )


def _gemm_case(m: int, n: int, k: int, variant: str, *, bias: bool = False, ue8m0: bool = False) -> Case:
    """variant: bf16 | fp32 | bf16-fp32 (bf16 activation, fp32 weight) | fp8w (bf16 activation, FP8 weight) | fp8
    (both FP8)."""
    fp32_w = variant in ("fp32", "bf16-fp32")

    def make(g: Gen):
        w = _weight(
            g,
            n,
            k,
            fp8=variant.startswith("fp8"),
            ue8m0=ue8m0,
            dtype=torch.float32 if fp32_w else torch.bfloat16,
        )
        a = _act(g, m, k, variant="fp8" if variant == "fp8" else ("fp32" if variant == "fp32" else "bf16"), ue8m0=ue8m0)
        b = g.randn(n, dtype=a.dtype if isinstance(a, torch.Tensor) else torch.bfloat16) if bias else None
        fp32_out = {"out_dtype": torch.float32} if fp32_w else {}  # as the router's logits are taken
        return {"a": a, "w": w, "bias": b, **fp32_out}

    name = f"M={m} N={n} K={k} {variant}" + (" bias" if bias else "") + (" ue8m0" if ue8m0 else "")
    return Case(
        "gemm",
        name,
        "fp8" if variant.startswith("fp8") else ("fp32" if fp32_w else variant),
        make,
        sub_batch=lambda kw, rows: (take_rows(kw, ("a",), rows), lambda o: rows_of(o, rows)),
        batch=lambda kw: kw["a"].shape[0],
    )


def _contiguous_counts(g: Gen, experts: int, most: int, least: int = 0) -> list[int]:
    counts = g.ints(least, most + 1, experts)
    counts[g.ints(0, experts, 1)[0]] = 0  # always one expert with no rows
    return counts


def _expert_of_rows(offsets: torch.Tensor) -> torch.Tensor:
    counts = (offsets[1:] - offsets[:-1]).long().cpu()
    return torch.repeat_interleave(torch.arange(counts.numel()), counts)


def _sub_contiguous(kw: dict, rows: list[int], names: tuple[str, ...] = ("a",)):
    experts = _expert_of_rows(kw["expert_offsets"])[rows]
    counts = torch.bincount(experts, minlength=kw["expert_offsets"].numel() - 1)
    offsets = torch.zeros_like(kw["expert_offsets"])
    offsets[1:] = counts.cumsum(0).to(offsets.device)
    return {**take_rows(kw, names, rows), "expert_offsets": offsets}, lambda o: rows_of(o, rows)


def _out_view(shape: tuple[int, ...], dtype: torch.dtype, device, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN-filled buffer and an ``out`` of ``shape`` that is a view of it: masked ``[E, max_m, N]`` as the heads of
    a ``[max_m, E, N + pad]`` buffer (absorbed MLA's ``[tokens, heads, v]`` values, as ``o_proj`` reads them),
    contiguous ``[M, N]`` as the first ``N`` columns of ``[M, N + pad]``."""
    *lead, n = shape
    if len(lead) == 2:
        buffer = torch.full((lead[1], lead[0], n + pad), torch.nan, dtype=dtype, device=device)
        return buffer, buffer[..., :n].transpose(0, 1)
    buffer = torch.full((*lead, n + pad), torch.nan, dtype=dtype, device=device)
    return buffer, buffer[:, :n]


def _run_into(pad: int, masked: bool):
    """A ``run`` that hands the op a fresh ``out`` view (``_out_view``) each call, so that no two runs share one:
    a row left unwritten stays NaN and fails the comparison, and a write past ``out`` into the buffer's padding
    raises."""

    def run(op, kw: dict):
        buffer, out = _out_view(tuple(kw["out"].shape), kw["out"].dtype, kw["out"].device, pad)
        kw = {**kw, "out": out}
        result = run_masked(op, kw) if masked else op(**kw)
        if pad and not bool(buffer[..., -pad:].isnan().all()):
            raise AssertionError("grouped_gemm wrote outside 'out' (into the padding of its buffer)")
        return result

    return run


def _grouped_case(
    experts: int,
    n: int,
    k: int,
    most: int,
    variant: str,
    layout: str,
    least: int = 0,
    gap: int | None = None,
    into: int | None = None,
) -> Case:
    """``least``: the fewest rows of each expert but the one with none (contiguous layout). ``gap`` (masked, bf16):
    ``a`` is a view, expert e's rows the e-th of each row of a ``[max_m, E, K + gap]`` tensor, their first ``K``
    columns: the heads of an attention layer's ``[tokens, heads, head_dim + rope]`` queries, as absorbed MLA reads
    them. ``into``: the result goes into ``out``, a view of a wider buffer (``_out_view`` with this padding)."""

    def make(g: Gen):
        w = _weight(g, experts, n, k, fp8=variant.startswith("fp8"))
        act = "fp8" if variant == "fp8" else "bf16"
        if layout == "contiguous":
            counts = _contiguous_counts(g, experts, most, least)
            offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=g.device)
            kw = {"a": _act(g, sum(counts), k, variant=act), "w": w, "expert_offsets": offsets}
        else:
            masked = g.ints(0, most + 1, experts)
            masked[0], masked[-1] = 0, most  # an empty expert and a full one
            if gap is not None:
                a = g.randn(most, experts, k + gap, dtype=torch.bfloat16)[..., :k].transpose(0, 1)
            kw = {
                "a": a if gap is not None else _act(g, experts, most, k, variant=act),
                "w": w,
                "masked_m": torch.tensor(masked, dtype=torch.int32, device=g.device),
            }
        if into is not None:
            a_rows = (kw["a"].data if isinstance(kw["a"], QTensor) else kw["a"]).shape[:-1]
            kw["out"] = _out_view((*a_rows, n), torch.bfloat16, g.device, into)[1]
        return kw

    rows = f"rows {least}..{most}" if least else f"rows<={most}"
    name = f"{layout} E={experts} N={n} K={k} {rows} {variant}"
    name += f" a: heads of rows {k + gap} wide" if gap is not None else ""
    name += f" out: rows {n + into} wide" if into is not None else ""
    tol = "fp8" if variant.startswith("fp8") else variant
    return _layout_case(layout, name, tol, make, into)


def _layout_case(layout: str, name: str, tol: str, make, into: int | None = None) -> Case:
    """A ``grouped_gemm`` case of ``layout`` (``contiguous`` or ``masked``), its sub-batches taken by rows
    (``into``: with ``out`` as ``_grouped_case`` says)."""
    masked = layout == "masked"
    if masked:

        def sub_batch(kw, rows):
            sub, select = take_masked_rows(kw, "a", rows)
            return ({**sub, "out": select(kw["out"])} if into is not None else sub), select

        run = run_masked if into is None else _run_into(into, masked=True)
    else:
        names = ("a",) if into is None else ("a", "out")
        sub_batch = lambda kw, rows: _sub_contiguous(kw, rows, names)
        run = None if into is None else _run_into(into, masked=False)
    rows_dim = 1 if masked else 0
    return Case("grouped_gemm", name, tol, make, run=run, sub_batch=sub_batch, batch=lambda kw: kw["a"].shape[rows_dim])


def _fp4_grouped_case(experts: int, n: int, k: int, most: int, layout: str, dtype=torch.bfloat16) -> Case:
    """An ``FP4Tensor`` weight against a float activation of ``dtype`` (fp32: an fp32 result)."""
    fp32 = dtype == torch.float32

    def make(g: Gen):
        w = fp4_weight(g, experts, n, k)
        out = {"out_dtype": torch.float32} if fp32 else {}
        if layout == "contiguous":
            counts = _contiguous_counts(g, experts, most)
            offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=g.device)
            return {"a": g.randn(sum(counts), k, dtype=dtype), "w": w, "expert_offsets": offsets, **out}
        masked = g.ints(0, most + 1, experts)
        masked[0], masked[-1] = 0, most
        masked_m = torch.tensor(masked, dtype=torch.int32, device=g.device)
        return {"a": g.randn(experts, most, k, dtype=dtype), "w": w, "masked_m": masked_m, **out}

    name = f"{layout} E={experts} N={n} K={k} rows<={most} fp4 a={str(dtype).removeprefix('torch.')}"
    tol = "fp4-fp32" if fp32 else "fp4"
    return _layout_case(layout, name, tol, make)


def cases(shapes: str) -> list[Case]:
    out: list[Case] = []
    if shapes == "small":
        out += [_quantize_case(m, k, f) for m, k in [(1, 128), (7, 384), (33, 256)] for f in ("fp32", "ue8m0")]
        out.append(_quantize_case(5, 256, "fp32", experts=3))
        out.append(_quantize_case(0, 256, "fp32"))
        out += [_quantize_case(7, 384, f, nans=4) for f in ("fp32", "ue8m0")]
        for m in (1, 5, 37):
            out += [_gemm_case(m, n, k, v) for n, k in [(96, 256), (200, 384)] for v in ("bf16", "fp8w", "fp8")]
        out += [
            _gemm_case(9, 64, 128, "fp32"),
            _gemm_case(5, 96, 2304, "fp32"),  # K long enough for a backend to split it
            # a router whose weight is fp32 (the embedded model's) at a decode step's and a verification's rows, and
            # past the few rows a backend may take another kernel for
            *[_gemm_case(m, 8, 256, v) for m in (1, 4, 16, 17) for v in ("fp32", "bf16-fp32")],
            _gemm_case(3, 200, 384, "bf16-fp32", bias=True),
            _gemm_case(0, 96, 256, "bf16"),
            _gemm_case(0, 96, 256, "fp8w"),
            _gemm_case(5, 0, 256, "bf16"),
            _gemm_case(5, 0, 256, "fp8"),
            _gemm_case(6, 96, 256, "bf16", bias=True),
            _gemm_case(6, 130, 256, "fp8", ue8m0=True),
            _gemm_case(3, 64, 4096, "fp8w", bias=True),  # long K, one tile: a backend may split K
            # enough rows for a large-tile kernel, with partial tiles in both directions
            _gemm_case(400, 200, 384, "fp8w"),
            _gemm_case(400, 200, 384, "fp8"),
        ]
        for lay in ("contiguous", "masked"):
            out += [_grouped_case(4, 96, 256, 9, v, lay) for v in ("bf16", "fp8w", "fp8")]
        out.append(_grouped_case(3, 200, 128, 17, "fp8", "contiguous"))
        out += [_grouped_case(3, 96, 256, 0, "bf16", lay) for lay in ("contiguous", "masked")]  # no rows at all
        out += [_grouped_case(4, 96, 64, 9, "bf16", "masked", gap=gap) for gap in (0, 32)]
        # into ``out``, a view of a wider buffer: both layouts, dense and FP8 weights, no rows at all
        out += [_grouped_case(4, 96, 64, 9, "bf16", "masked", gap=32, into=pad) for pad in (0, 24)]
        out += [_grouped_case(3, 96, 256, 0, "bf16", lay, into=8) for lay in ("contiguous", "masked")]
        out += [_grouped_case(3, 96, 256, 70, v, "masked", into=8) for v in ("bf16", "fp8w")]
        out += [_grouped_case(4, 96, 256, 9, v, "contiguous", into=8) for v in ("bf16", "fp8")]
        # prefill's hundreds of rows per expert (a backend may take another kernel there), tiles cut by experts' ends
        out += [_grouped_case(3, 256, 256, 800, v, "contiguous", least=600) for v in ("fp8w", "fp8")]
        for lay in ("contiguous", "masked"):
            out.append(_fp4_grouped_case(4, 96, 256, 9, lay))
            out.append(_fp4_grouped_case(3, 200, 96, 17, lay, dtype=torch.float32))  # K not a multiple of 64
            out.append(_fp4_grouped_case(3, 64, 128, 0, lay))  # no rows at all
        out.append(_fp4_grouped_case(2, 130, 2048, 70, "contiguous"))  # long K, partial row and column tiles
        return out
    out += [_quantize_case(m, 7168, f) for m in (1, 4096) for f in ("fp32", "ue8m0")]
    out.append(_quantize_case(64, 2048, "fp32", experts=32))
    for n, k in V3_PROJECTIONS:
        for m in (1, 128, 4096):
            out += [_gemm_case(m, n, k, v) for v in ("bf16", "fp8w", "fp8")]
    out += [_gemm_case(77, 7168, 2048, "fp8", ue8m0=True), _gemm_case(0, 7168, 2048, "fp8w")]
    out += [_gemm_case(m, 256, 7168, v) for m in (1, 4, 64, 4096) for v in ("fp32", "bf16-fp32")]  # the router
    for lay in ("contiguous", "masked"):
        for n, k in [(4096, 7168), (7168, 2048)]:
            out += [_grouped_case(32, n, k, 256, v, lay) for v in ("bf16", "fp8")]
            if lay == "contiguous":  # a long prefill chunk's rows per expert
                out.append(_grouped_case(32, n, k, 640, "fp8", lay, least=400))
        out += [_fp4_grouped_case(32, n, k, 256, lay) for n, k in V4_FLASH_EXPERTS]
    # absorbed MLA at decode: the heads' queries into the latent (K 128 of 192 per head), its output out of it
    out += [_grouped_case(128, 512, 128, m, "bf16", "masked", gap=64) for m in (4, 64)]
    out += [_grouped_case(128, 128, 512, m, "bf16", "masked", gap=0, into=0) for m in (4, 64)]
    # DeepSeek-V4-Flash's grouped output projection (wo_a: 8 groups of 4096 into 1024), into wo_b's rows
    out += [_grouped_case(8, 1024, 4096, m, "fp8w", "masked", into=0) for m in (4, 64)]
    return out


def bad_inputs() -> list[BadInput]:
    def gemm_kw(g: Gen, **over):
        kw = {"a": g.randn(4, 256), "w": g.randn(64, 256)}
        return {**kw, **over}

    def fp8_w(g: Gen, n=64, k=256):
        return quantize_blocks(g.randn(n, k, dtype=torch.float32), (128, 128))

    def fp4_kw(g: Gen, **over):
        """A valid FP4 call (2 experts, N = 32, K = 64, contiguous) with ``over`` replacing arguments."""
        offsets = torch.tensor([0, 2, 4], dtype=torch.int32, device=g.device)
        return {"a": g.randn(4, 64), "w": fp4_weight(g, 2, 32, 64), "expert_offsets": offsets, **over}

    def grouped_kw(g: Gen):
        """A valid bf16 call (2 experts, N = 32, K = 128, contiguous, 4 rows)."""
        offsets = torch.tensor([0, 2, 4], dtype=torch.int32, device=g.device)
        return {"a": g.randn(4, 128), "w": g.randn(2, 32, 128), "expert_offsets": offsets}

    def fp4_parts(g: Gen, data=None, scale=None) -> FP4Tensor:
        w = fp4_weight(g, 2, 32, 64)
        return FP4Tensor(w.data if data is None else data, w.scale if scale is None else scale)

    return [
        BadInput("quantize_fp8", "K not a multiple of the block", "x", lambda g: {"x": g.randn(4, 200)}),
        BadInput("quantize_fp8", "integer input", "x", lambda g: {"x": g.randint(0, 5, 4, 128)}),
        BadInput(
            "quantize_fp8",
            "unknown scale format",
            "scale_format",
            lambda g: {"x": g.randn(4, 128), "scale_format": "e5m2"},
        ),
        BadInput("gemm", "K mismatch", "a", lambda g: gemm_kw(g, a=g.randn(4, 128))),
        BadInput("gemm", "dtype mismatch", "w", lambda g: gemm_kw(g, w=g.randn(64, 256, dtype=torch.float16))),
        BadInput("gemm", "3-D activation", "a", lambda g: gemm_kw(g, a=g.randn(2, 4, 256))),
        BadInput("gemm", "bias of the wrong length", "bias", lambda g: gemm_kw(g, bias=g.randn(63))),
        BadInput(
            "gemm",
            "FP8 weight with K not a multiple of 128",
            "w",
            lambda g: {"a": g.randn(4, 200), "w": quantize_blocks(g.randn(64, 200, dtype=torch.float32))},
        ),
        BadInput(
            "gemm",
            "FP8 weight with a wrong scale shape",
            "w.scale",
            lambda g: {"a": g.randn(4, 256), "w": QTensor(fp8_w(g).data, torch.ones(1, 1), (128, 128))},
        ),
        BadInput(
            "gemm",
            "FP8 activation against a bf16 weight",
            "w",
            lambda g: {"a": quantize_rows(g.randn(4, 256), 128, "fp32"), "w": g.randn(64, 256)},
        ),
        BadInput(
            "gemm",
            "activation with (128, 128) blocks",
            "a.block",
            lambda g: {"a": quantize_blocks(g.randn(4, 256, dtype=torch.float32)), "w": fp8_w(g)},
        ),
        BadInput(
            "grouped_gemm",
            "both layouts",
            "expert_offsets/masked_m",
            lambda g: {
                "a": g.randn(4, 128),
                "w": g.randn(2, 32, 128),
                "expert_offsets": torch.tensor([0, 2, 4], dtype=torch.int32, device=g.device),
                "masked_m": torch.tensor([1, 1], dtype=torch.int32, device=g.device),
            },
        ),
        BadInput(
            "grouped_gemm",
            "int64 offsets",
            "expert_offsets",
            lambda g: {
                "a": g.randn(4, 128),
                "w": g.randn(2, 32, 128),
                "expert_offsets": torch.tensor([0, 2, 4], device=g.device),
            },
        ),
        BadInput(
            "grouped_gemm",
            "offsets that do not end at M",
            "expert_offsets",
            lambda g: {
                "a": g.randn(4, 128),
                "w": g.randn(2, 32, 128),
                "expert_offsets": torch.tensor([0, 2, 3], dtype=torch.int32, device=g.device),
            },
        ),
        BadInput(
            "grouped_gemm",
            "decreasing offsets",
            "expert_offsets",
            lambda g: {
                "a": g.randn(4, 128),
                "w": g.randn(3, 32, 128),
                "expert_offsets": torch.tensor([0, 3, 1, 4], dtype=torch.int32, device=g.device),
            },
        ),
        BadInput(
            "grouped_gemm",
            "masked_m above max_m",
            "masked_m",
            lambda g: {
                "a": g.randn(2, 4, 128),
                "w": g.randn(2, 32, 128),
                "masked_m": torch.tensor([1, 5], dtype=torch.int32, device=g.device),
            },
        ),
        BadInput("grouped_gemm", "FP4: odd K in the activation", "a", lambda g: fp4_kw(g, a=g.randn(4, 63))),
        BadInput(
            "grouped_gemm",
            "FP4: K not a multiple of 32",
            "w",
            lambda g: fp4_kw(
                g, a=g.randn(4, 48), w=fp4_parts(g, data=g.randint(-128, 128, 2, 32, 24, dtype=torch.int8))
            ),
        ),
        BadInput(
            "grouped_gemm",
            "FP4: scales of one group per 16 values",
            "w.scale",
            lambda g: fp4_kw(g, w=fp4_parts(g, scale=fp4_weight(g, 2, 32, 128).scale)),
        ),
        BadInput(
            "grouped_gemm",
            "FP4: fp32 scales",
            "w.scale",
            lambda g: fp4_kw(g, w=fp4_parts(g, scale=torch.ones(2, 32, 2, device=g.device))),
        ),
        BadInput(
            "grouped_gemm",
            "FP4: uint8 data",
            "w.data",
            lambda g: fp4_kw(g, w=fp4_parts(g, data=torch.zeros(2, 32, 32, dtype=torch.uint8, device=g.device))),
        ),
        BadInput(
            "grouped_gemm",
            "FP4: an FP8 activation",
            "a",
            lambda g: fp4_kw(g, a=quantize_rows(g.randn(4, 128), 128, "fp32"), w=fp4_weight(g, 2, 32, 128)),
        ),
        BadInput(
            "grouped_gemm",
            "FP4: 2-D weight",
            "w.data",
            lambda g: fp4_kw(g, w=fp4_weight(g, 32, 64)),
        ),
        BadInput(
            "grouped_gemm",
            "out of the wrong shape",
            "out",
            lambda g: {**grouped_kw(g), "out": g.randn(4, 33)},
        ),
        BadInput(
            "grouped_gemm",
            "out of another dtype than out_dtype",
            "out",
            lambda g: {**grouped_kw(g), "out": g.randn(4, 32, dtype=torch.float32)},
        ),
        BadInput(
            "grouped_gemm",
            "out with a strided last dim",
            "out",
            lambda g: {**grouped_kw(g), "out": g.randn(4, 64)[:, ::2]},
        ),
        BadInput(
            "grouped_gemm",
            "out whose rows share memory",
            "out",
            lambda g: {**grouped_kw(g), "out": g.randn(1, 32).expand(4, 32)},
        ),
        BadInput(
            "grouped_gemm",
            "out in the memory of a",
            "out",
            lambda g: (lambda kw: {**kw, "out": kw["a"][:, :32]})(grouped_kw(g)),
        ),
        BadInput(
            "grouped_gemm",
            "masked layout with the wrong expert count",
            "a",
            lambda g: {
                "a": g.randn(3, 4, 128),
                "w": g.randn(2, 32, 128),
                "masked_m": torch.tensor([1, 1], dtype=torch.int32, device=g.device),
            },
        ),
    ]
