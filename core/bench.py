"""``deepinfer bench``: each op over DeepSeek-V3 and V3.2 shapes on the selected backend, beside the peer a user
would pick.

For every case: fresh random inputs (several sets, rotated, so repeated runs do not measure the cache), a
correctness check against the reference first, then the median of many timed runs (device events on CUDA). Each
time is set against a roofline built from ceilings measured in the same run: a device-to-device copy for
bandwidth, large bf16 and FP8 matrix products for compute. The peer (a torch-native way to do the same work) is
timed the same way on the same inputs. On CUDA each is timed twice: eagerly (events around the Python call, so
host-side validation and launch costs count when they exceed the kernel's time) and replayed from a CUDA graph (the
device time alone, as a decode step replayed from a graph sees it: short calls chained in one graph, so that the
graph's own launch is not counted; ``time_graph_ms``); throughput and roofline use the graph time where the work
could be captured.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import platform
import statistics
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import ops
from .conformance.cases import Gen, error
from .dispatch import batch_invariant, last_resolution
from .index_cache import allocate_index_cache, pack_fp8_ds_index
from .kv_cache import allocate_kv_cache, pack_fp8_ds_mla
from .ops.rope import rope_cos_sin_cache
from .qtensor import QTensor, quantize_blocks, quantize_rows
from .selection import current_backend, use

GB = 1e9
TFLOP = 1e12


@dataclass
class BenchCase:
    """op: the deepinfer op (or a name for ``fn``); make: random keyword arguments; flops / bytes: the work and the
    fewest bytes moved (each input read once, each output written once); peers: name -> callable on the same keyword
    arguments; fn: a composite of ops run instead of the op itself; sets: input sets to rotate through (default:
    the run's; 1 where the inputs are far larger than the caches); compare: how the output is held to the
    reference's (default: the worst-row relative error, exact for integers)."""

    op: str
    name: str
    make: Callable[[Gen], dict[str, Any]]
    flops: float
    bytes: float | Callable[[dict[str, Any]], float]  # a callable counts them on the first input set
    peers: dict[str, Callable[[dict[str, Any]], Any]] = field(default_factory=dict)
    compute: str = "bf16"  # which peak bounds the arithmetic: bf16 or fp8
    fn: Callable[[dict[str, Any]], Any] | None = None
    sets: int | None = None
    compare: Callable[[Any, Any, dict[str, Any]], float] | None = None  # (out, ref, kwargs) -> error; default ``error``


@dataclass
class Row:
    op: str
    case: str
    impl: str
    ms: float | None
    graph_ms: float | None
    tflops: float | None
    gbps: float | None
    roofline_pct: float | None
    rel_err: float | None
    note: str = ""


# --- timing ---------------------------------------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_ms(fn: Callable[[int], Any], device: str, *, sets: int, warmup: int = 3, reps: int = 30) -> float:
    """Median milliseconds of ``fn(i)`` over ``reps`` runs, cycling through ``sets`` input sets."""
    for i in range(warmup):
        fn(i % sets)
    _sync(device)
    times = []
    for i in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(i % sets)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(i % sets)
            _sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


GRAPH_CHAIN_MS = 0.5  # calls shorter than this are timed chained in one graph, enough of them to last this long
MAX_GRAPH_CHAIN = 64


def time_graph_ms(
    fn: Callable[[int], Any], *, sets: int, reps: int = 30, chain_below_ms: float | None = GRAPH_CHAIN_MS
) -> float | None:
    """Median milliseconds per call of ``fn(i)`` replayed from CUDA graphs (captured after a warm-up on a side
    stream): device time without host launch costs. A graph replayed on an idle device also waits for its own launch
    (one trivial kernel took 15.6-17.2 us that way on the H200), so a call shorter than ``chain_below_ms`` is timed
    chained, as a decode step's graph runs it: one graph of up to ``MAX_GRAPH_CHAIN`` calls back to back, cycling
    through the input sets, its time divided by its calls. ``chain_below_ms=None``: one call per graph, launch
    included. None when ``fn`` cannot be captured (it synchronises)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())

    def capture(calls: list[int]) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in calls:
                fn(i)
        return graph

    try:
        with torch.cuda.stream(stream):
            for i in range(sets):
                fn(i)
        torch.cuda.current_stream().wait_stream(stream)
        graphs = [capture([i]) for i in range(sets)]
    except Exception:  # capture refused (a host synchronisation inside): report eager time only
        torch.cuda.synchronize()
        return None
    alone = time_ms(lambda i: graphs[i].replay(), "cuda", sets=sets, reps=reps)
    if chain_below_ms is None or alone >= chain_below_ms:
        return alone
    calls = min(MAX_GRAPH_CHAIN, math.ceil(chain_below_ms / alone) * 4)  # alone includes the launch: overshoot
    chained = capture([j % sets for j in range(calls)])
    return time_ms(lambda i: chained.replay(), "cuda", sets=1, reps=reps) / calls


def measure_ceilings(device: str, quick: bool) -> dict[str, float | None]:
    """Copy bandwidth (bytes read + written per second) and bf16 / FP8 matmul rates, measured here. None where not
    measured: every ceiling with ``quick`` (tiny sizes measure launch overhead, not a ceiling), and the FP8 rate off
    CUDA (no FP8 matmul to time). A roofline needs the ceilings of its case, so it is None too then."""
    if quick:
        return {"copy_GBps": None, "bf16_TFLOPs": None, "fp8_TFLOPs": None}
    n = 1 << 30
    src = torch.randn(n // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda i: dst.copy_(src), device, sets=1)
    size = 8192
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    mm_ms = time_ms(lambda i: a @ b, device, sets=1, reps=10)
    ceilings: dict[str, float | None] = {
        "copy_GBps": 2 * src.numel() * 2 / (copy_ms * 1e-3) / GB,
        "bf16_TFLOPs": 2 * size**3 / (mm_ms * 1e-3) / TFLOP,
    }
    if device == "cuda":
        fa, fb = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        fp8_ms = time_ms(
            lambda i: torch._scaled_mm(fa, fb, one, one, out_dtype=torch.bfloat16), device, sets=1, reps=10
        )
        ceilings["fp8_TFLOPs"] = 2 * size**3 / (fp8_ms * 1e-3) / TFLOP
    else:
        ceilings["fp8_TFLOPs"] = None
    return ceilings


# --- peers ----------------------------------------------------------------------------------------------------------


def _dense(a):
    return a.dequantize(torch.bfloat16) if isinstance(a, QTensor) else a


def _scaled_mm_blockwise(kw):
    """cuBLAS FP8 with DeepSeek block scaling (1x128 activations, 128x128 weights), SM90: torch's scaled_mm. Rows
    are padded to a multiple of 4 where they are not (cuBLAS takes no other count), as a user would."""
    a, w = kw["a"], kw["w"]
    qa = a if isinstance(a, QTensor) else quantize_rows(a, 128, w.scale_format)
    m, pad = qa.data.shape[0], -qa.data.shape[0] % 4
    data, scale = qa.data, qa.scale
    if pad:
        data, scale = F.pad(data.view(torch.uint8), (0, 0, 0, pad)).view(data.dtype), F.pad(scale, (0, 0, 0, pad))
    sa = torch.empty_strided(scale.shape, (1, scale.shape[0]), dtype=scale.dtype, device=scale.device)
    sa.copy_(scale)  # outer-dim-major scale layout
    recipe = F.ScalingType
    out = F.scaled_mm(
        data, w.data.t(), sa, recipe.BlockWise1x128, w.scale.t(), recipe.BlockWise128x128, output_dtype=torch.bfloat16
    )
    return out[:m]


def _batch_invariant_peer(op: str) -> Callable[[dict[str, Any]], Any]:
    """The same op on the same backend in batch-invariant mode (what that mode costs)."""

    def run(kw):
        with batch_invariant():
            out = getattr(ops, op)(**kw)
        return out[0] if op == "mla_decode" else out

    return run


def _grouped_mm_bf16(kw):
    a, w = _dense(kw["a"]), kw["w"]
    w = w.dequantize(torch.bfloat16) if isinstance(w, QTensor) else w
    return F.grouped_mm(a, w.transpose(1, 2), offs=kw["expert_offsets"][1:].contiguous())


_ROWWISE: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _rowwise_weights(w: QTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [E, N, K]`` re-quantised with one scale per output row, as torch's grouped FP8 GEMM takes it: the data
    ``[E, K, N]`` (each matrix K-major) and scales ``[E, N]``. Made once per weight (outside the timed calls)."""
    if id(w) not in _ROWWISE:
        data, scales = torch.empty_like(w.data), torch.empty(w.shape[:2], dtype=torch.float32, device=w.data.device)
        for e in range(w.shape[0]):  # one expert at a time: the fp32 copy of all of them would not fit
            dense = QTensor(w.data[e], w.scale[e], w.block, w.scale_format).dequantize(torch.float32)
            rows = quantize_rows(dense, dense.shape[1], "fp32")  # one block as wide as the row
            data[e], scales[e] = rows.data, rows.scale[:, 0]
        _ROWWISE[id(w)] = (data.transpose(1, 2), scales)
        weakref.finalize(w, _ROWWISE.pop, id(w), None)
    return _ROWWISE[id(w)]


def _scaled_grouped_mm_rowwise(kw):
    """torch's grouped FP8 GEMM (``torch._scaled_grouped_mm``, CUTLASS on SM90) with row-wise scales: activations
    quantised per row here, weights per output row (once, ``_rowwise_weights``). Less work than 128-blocks."""
    a, w = kw["a"], kw["w"]
    data_t, scale_w = _rowwise_weights(w)
    qa = quantize_rows(_dense(a), a.shape[1], "fp32")
    offsets = kw["expert_offsets"][1:].contiguous()
    return torch._scaled_grouped_mm(
        qa.data, data_t, qa.scale[:, 0].contiguous(), scale_w, offs=offsets, out_dtype=torch.bfloat16
    )


def _per_expert_scaled_mm(kw):
    """A loop of cuBLAS block-scaled FP8 products, one per expert with rows: the contiguous layout's
    ``expert_offsets`` or the masked layout's ``masked_m``, read on the host."""
    a, w = kw["a"], kw["w"]
    qa = a if isinstance(a, QTensor) else quantize_rows(a, 128, w.scale_format)
    out = torch.empty(*qa.shape[:-1], w.shape[1], dtype=torch.bfloat16, device=qa.data.device)
    if kw.get("masked_m") is not None:  # a [E, M, K]: expert e's first masked_m[e] rows
        rows = [(e, slice(0, m)) for e, m in enumerate(kw["masked_m"].tolist())]
    else:
        bounds = kw["expert_offsets"].tolist()
        rows = [slice(bounds[e], bounds[e + 1]) for e in range(w.shape[0])]
    for e, index in enumerate(rows):
        if out[index].numel():
            sub_w = QTensor(w.data[e], w.scale[e], w.block, w.scale_format)
            out[index] = _scaled_mm_blockwise({"a": qa[index], "w": sub_w})
    return out


def _mla_torch(kw):
    """Plain torch: gather each sequence's pages, two batched products and a softmax (bf16 cache)."""
    q, cache, table, lens = kw["q"], kw["kv_cache"], kw["block_table"], kw["seq_lens"]
    batch = q.shape[0]
    page = cache.shape[1]
    max_len = table.shape[1] * page
    kv = cache[table.long()].reshape(batch, max_len, -1)  # [B, pages * page, D]
    scores = torch.einsum("bshd,bnd->bshn", q, kv).float() * kw["softmax_scale"]
    pos = torch.arange(max_len, device=q.device)
    scores = scores.masked_fill((pos[None, :] >= lens[:, None])[:, None, None, :], float("-inf"))
    p = scores.softmax(-1).to(q.dtype)
    return torch.einsum("bshn,bnd->bshd", p, kv[..., : kw["kv_lora_rank"]])


def _sdpa(kw, flash: bool = False):
    """SDPA on the same packed sequences, one call per sequence (equal lengths here: one batched call): torch's own
    pick of kernel, or (``flash``) its flash path, which takes one head dim for q, k and v: v is padded to q's, the
    nearest shape that path supports, and the padding dropped."""
    q, k, v, cu = kw["q"], kw["k"], kw["v"], kw["cu_seqlens_q"]
    batch = cu.numel() - 1
    length = q.shape[0] // batch
    d_v = v.shape[2]
    if flash:
        v = F.pad(v, (0, q.shape[2] - d_v))
    shape = lambda t: t.view(batch, length, t.shape[1], t.shape[2]).transpose(1, 2)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]) if flash else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(
            shape(q), shape(k), shape(v), is_causal=kw["causal"], scale=kw["softmax_scale"]
        )
    return out[..., :d_v].transpose(1, 2).reshape(q.shape[0], q.shape[1], d_v)


def moe_layer(kw: dict[str, Any], grouped_gemm: Callable[..., Any] | None = None) -> torch.Tensor:
    """A DeepSeek-V3 routed-expert layer from ops: ``moe_route`` -> ``ep_dispatch`` (FP8 tokens) -> gate_up
    ``grouped_gemm`` -> ``silu_and_mul`` (FP8 out) -> down ``grouped_gemm`` -> ``ep_combine``, dispatching in
    ``kw["mode"]``. ``grouped_gemm`` replaces the op (a peer's products)."""
    gemm = grouped_gemm or ops.grouped_gemm
    w13, w2 = kw["w13"], kw["w2"]
    weights, ids = _route(kw)
    x = ops.quantize_fp8(kw["x"], block=128, scale_format=w13.scale_format)
    recv, _, _, layout, handle = ops.ep_dispatch(x, ids, weights, num_experts=w13.shape[0], mode=kw["mode"])
    groups = {"expert_offsets": layout.expert_offsets, "masked_m": layout.masked_m, "out_dtype": torch.bfloat16}
    h = gemm(a=recv, w=w13, **groups)
    a = ops.silu_and_mul(h, quantize=True, scale_format=w2.scale_format, masked_m=layout.masked_m)
    return ops.ep_combine(gemm(a=a, w=w2, **groups), handle)


def _route(kw: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing of the layer's tokens: (weights, expert ids), each [T, 8]."""
    return ops.moe_route(
        kw["logits"], kw["bias"], top_k=8, n_group=8, topk_group=4, renormalize=True, routed_scaling_factor=2.5,
        scoring="sigmoid",
    )  # fmt: skip


def _moe_layer_bytes(kw: dict[str, Any]) -> float:
    """The fewest bytes the layer moves: the FP8 weights of the experts its routing picks (group-limited routing picks
    fewer distinct experts than it has pairs), each read once, and the bf16 tokens in and out."""
    with use("reference"):
        used = _route(kw)[1].unique().numel()
    tokens, hidden = kw["x"].shape
    return used * 3 * kw["w2"].shape[2] * hidden + tokens * hidden * 2 * 2


def _moe_layer_torch_peers(kw):
    """The same layer with each expert's products by cuBLAS (a per-expert loop of block-scaled ``scaled_mm``) and
    the rest as plain torch composites."""
    with use("reference"):
        return moe_layer(kw, lambda **g: _per_expert_scaled_mm(g))


def _reference_peer(op: str) -> Callable[[dict[str, Any]], Any]:
    """The core's plain-torch reference on the same device: the composite a user would write by hand."""

    def run(kw):
        with use("reference"):
            return getattr(ops, op)(**kw)

    return run


# --- cases ----------------------------------------------------------------------------------------------------------


def _gemm_cases(quick: bool) -> list[BenchCase]:
    shapes = (
        [(7168, 2048), (2112, 7168)]
        if quick
        else [(24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048), (2112, 7168)]
    )
    ms = [1, 8, 64, 128, 512, 2048, 4096, 8192]
    if quick:
        shapes, ms = [(256, 256)], [1, 16]
    out = []
    for n, k in shapes:
        for m in ms:

            def make(g, m=m, n=n, k=k):
                # Activations arrive quantised (by the op before, as in the model): both sides time the GEMM alone.
                w = quantize_blocks(g.randn(n, k, dtype=torch.float32, scale=k**-0.5))
                a = quantize_rows(g.randn(m, k), 128, w.scale_format)
                return {"a": a, "w": w, "out_dtype": torch.bfloat16, "bias": None}

            out.append(
                BenchCase(
                    "gemm",
                    f"fp8 M={m} N={n} K={k}",
                    make,
                    2 * m * n * k,
                    m * k + n * k + m * n * 2,
                    {"torch scaled_mm blockwise": _scaled_mm_blockwise}
                    | ({"same op, batch-invariant mode": _batch_invariant_peer("gemm")} if m in (1, 128, 4096) else {}),
                    compute="fp8",
                )
            )
    return out


def _grouped_cases(quick: bool) -> list[BenchCase]:
    experts = 4 if quick else 32
    shapes = [(256, 256)] if quick else [(4096, 7168), (7168, 2048)]
    per_expert = [8] if quick else [8, 128, 512]
    out = []
    for n, k in shapes:
        for m in per_expert:

            def make(g, n=n, k=k, m=m):
                w = quantize_blocks(g.randn(experts, n, k, dtype=torch.float32, scale=k**-0.5))
                offsets = torch.arange(0, experts + 1, device=g.device, dtype=torch.int32) * m
                return {
                    "a": g.randn(experts * m, k),
                    "w": w,
                    "expert_offsets": offsets,
                    "masked_m": None,
                    "out_dtype": torch.bfloat16,
                }

            rows = experts * m
            out.append(
                BenchCase(
                    "grouped_gemm",
                    f"fp8 contiguous E={experts} N={n} K={k} rows/expert={m}",
                    make,
                    2 * rows * n * k,
                    rows * k * 2 + experts * n * k + rows * n * 2,
                    {
                        "per-expert torch scaled_mm": _per_expert_scaled_mm,
                        "torch _scaled_grouped_mm, row-wise scales": _scaled_grouped_mm_rowwise,
                        "torch grouped_mm bf16 (dequantised weights)": _grouped_mm_bf16,
                    },
                    compute="fp8",
                )
            )
    return out


def _mla_cases(quick: bool) -> list[BenchCase]:
    grid = [(2, 128, 64)] if quick else [(b, ctx, 64) for b in (32, 64, 128) for ctx in (1024, 4096, 16384)]
    heads, rank, rope = (16, 512, 64) if quick else (128, 512, 64)
    out = []
    for fmt in ("bf16", "fp8_ds_mla"):
        for batch, ctx, page in grid:

            def make(g, batch=batch, ctx=ctx, page=page, fmt=fmt):
                pages = ctx // page
                cache = allocate_kv_cache(
                    batch * pages, page, kv_lora_rank=rank, rope_dim=rope, kv_format=fmt, device=g.device
                )
                latent = g.randn(batch * pages * page, rank + rope)
                flat = cache.view(batch * pages * page, -1)
                flat.copy_(latent if fmt == "bf16" else pack_fp8_ds_mla(latent, rank))
                table, _ = _scattered_sequences(g, batch, ctx, page)
                return {
                    "q": g.randn(batch, 1, heads, rank + rope),
                    "kv_cache": cache,
                    "block_table": table,
                    "seq_lens": torch.full((batch,), ctx, dtype=torch.int32, device=g.device),
                    "softmax_scale": 192**-0.5,
                    "kv_lora_rank": rank,
                }

            width = (rank + rope) * 2 if fmt == "bf16" else 656
            nbytes = batch * ctx * width + batch * heads * (rank + rope) * 2 + batch * heads * rank * 2
            flops = 2 * batch * heads * ctx * (rank + rope + rank)
            peers = {"torch composite": _mla_torch} if fmt == "bf16" else {}
            if batch == 64 or quick:
                peers["same op, batch-invariant mode"] = _batch_invariant_peer("mla_decode")
            out.append(BenchCase("mla_decode", f"{fmt} B={batch} H={heads} ctx={ctx}", make, flops, nbytes, peers))
    return out


def _device_randn(g: Gen, *shape: int) -> torch.Tensor:
    """bf16 normal values drawn on the device (caches too large to draw on the CPU)."""
    dev = torch.Generator(device=g.device).manual_seed(int(torch.randint(0, 2**62, (1,), generator=g.cpu)))
    return torch.randn(shape, generator=dev, device=g.device).to(torch.bfloat16)


def _scattered_sequences(g: Gen, batch: int, ctx: int, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random page order for ``batch`` sequences of ``ctx`` tokens: ``(block_table [B, pages] int32, slots [B,
    ctx] int64)``."""
    pages = -(-ctx // page)
    table = torch.randperm(batch * pages, generator=g.cpu).view(batch, pages).int().to(g.device)
    pos = torch.arange(ctx, device=g.device)
    return table, table[:, pos // page].long() * page + pos % page


def _sparse_mla_torch(kw):
    """Plain torch: gather each query's listed rows (bf16 cache), two batched products and a softmax."""
    q, idx, rank = kw["q"], kw["indices"], kw["kv_lora_rank"]
    kv = kw["kv_cache"].view(-1, kw["kv_cache"].shape[-1])[idx.clamp_min(0).long()]  # [T, topk, D]
    scores = torch.einsum("thd,tnd->thn", q, kv).float() * kw["softmax_scale"]
    p = scores.masked_fill((idx < 0)[:, None, :], float("-inf")).softmax(-1).to(q.dtype)
    return torch.einsum("thn,tnd->thd", p, kv[..., :rank])


def _indexer_torch(kw):
    """Plain torch over sequences of one length, one query each (decode): gather the keys (bf16 cache), scores,
    top-k by ``torch.topk``; slots ascending."""
    q, w, cache, table, topk = kw["q"], kw["weights"], kw["index_cache"], kw["block_table"], kw["topk"]
    page, ctx = cache.shape[1], int(kw["seq_lens"][0])
    pos = torch.arange(ctx, device=q.device)
    slots = table[:, pos // page].long() * page + pos % page  # [B, ctx]
    keys = cache.view(-1, cache.shape[-1])[slots]  # [B, ctx, D]
    scores = (torch.einsum("bhd,bnd->bhn", q, keys).float().relu() * w[:, :, None]).sum(1)
    chosen = scores.topk(topk, dim=-1).indices.sort(-1).values
    return slots.gather(1, chosen).int()


def _dsa_cases(quick: bool) -> list[BenchCase]:
    """DeepSeek-V3.2's sparse attention: ``sparse_mla`` in decode (one or two queries per sequence: MTP) and in
    prefill (8k queries of one sequence), ``indexer_topk`` in decode at 64k context and over an 8k prefill chunk,
    and dense ``mla_decode`` over as many tokens as the sparse decode attends (the same work, contiguous pages)."""
    from .conformance.sparse_attention import _compare_topk

    heads, rank, rope, topk, page = (16, 512, 64, 64, 64) if quick else (128, 512, 64, 2048, 64)
    i_heads, i_dim = (8, 128) if quick else (64, 128)
    # (batch, queries per sequence, context); 128 x 2 is the shape of FlashMLA's published sparse decode figure
    decode = [(64, 1, 8192), (64, 1, 131072), (64, 2, 8192), (128, 1, 8192), (128, 2, 8192)]
    decode = [(2, 1, 256)] if quick else decode
    prefill = [] if quick else [(8192, 16384)]
    out: list[BenchCase] = []
    for fmt in ("bf16", "fp8_ds_mla"):
        record = (rank + rope) * 2 if fmt == "bf16" else 656
        for batch, s_q, ctx in [(b, s, c) for b, s, c in decode] + [(1, t, c) for t, c in prefill]:

            def make(g, batch=batch, s_q=s_q, ctx=ctx, fmt=fmt):
                table, slots = _scattered_sequences(g, batch, ctx, page)
                cache = allocate_kv_cache(
                    table.numel(), page, kv_lora_rank=rank, rope_dim=rope, kv_format=fmt, device=g.device
                )
                flat = cache.view(-1, cache.shape[-1])
                for start in range(0, flat.shape[0], 1 << 20):
                    latent = _device_randn(g, min(1 << 20, flat.shape[0] - start), rank + rope)
                    flat[start : start + latent.shape[0]] = latent if fmt == "bf16" else pack_fp8_ds_mla(latent, rank)
                rows = batch * s_q  # every query lists `topk` random positions of its sequence, ascending
                picks = torch.rand(rows, ctx, device=g.device).topk(topk, dim=-1).indices.sort(-1).values
                owner = torch.arange(batch, device=g.device).repeat_interleave(s_q)
                return {
                    "q": g.randn(rows, heads, rank + rope),
                    "kv_cache": cache,
                    "indices": slots[owner[:, None], picks].int(),
                    "softmax_scale": 192**-0.5,
                    "kv_lora_rank": rank,
                }

            rows = batch * s_q
            flops = 2 * rows * heads * topk * (rank + rope + rank)
            nbytes = rows * topk * record + rows * heads * (rank + rope + rank) * 2 + rows * topk * 4
            shape = f"T={rows} prefill" if batch == 1 else f"B={batch} S_q={s_q}"
            name = f"{fmt} {shape} H={heads} topk={topk} ctx={ctx}"
            peers = {"torch gather + einsum": _sparse_mla_torch} if fmt == "bf16" and rows <= 256 else {}
            out.append(BenchCase("sparse_mla", name, make, flops, nbytes, peers, sets=1 if ctx > 8192 else None))
    if not quick:  # the dense decode that reads as many tokens as the sparse one: its time is the sparse target

        def make_dense(g):
            table, _ = _scattered_sequences(g, 64, topk, page)
            cache = allocate_kv_cache(table.numel(), page, kv_lora_rank=rank, rope_dim=rope, device=g.device)
            cache.view(-1, rank + rope).copy_(_device_randn(g, table.numel() * page, rank + rope))
            return {
                "q": g.randn(64, 1, heads, rank + rope),
                "kv_cache": cache,
                "block_table": table,
                "seq_lens": torch.full((64,), topk, dtype=torch.int32, device=g.device),
                "softmax_scale": 192**-0.5,
                "kv_lora_rank": rank,
            }

        flops = 2 * 64 * heads * topk * (rank + rope + rank)
        name = f"dense mla_decode, bf16 B=64 H={heads} ctx={topk}: the work of sparse decode over contiguous pages"
        nbytes = 64 * topk * (rank + rope) * 2
        dense = lambda kw: ops.mla_decode(**kw)  # listed with sparse_mla (``--ops sparse_mla``) as its yardstick
        out.append(BenchCase("sparse_mla", name, make_dense, flops, nbytes, fn=dense))
    indexer = [(2, 1, 512)] if quick else [(64, 1, 65536), (1, 8192, 8192)]
    for fmt in ("bf16", "fp8_ds_index"):
        record = i_dim * 2 if fmt == "bf16" else i_dim + 4
        for batch, length, ctx in indexer:

            def make_index(g, batch=batch, length=length, ctx=ctx, fmt=fmt):
                table, _ = _scattered_sequences(g, batch, ctx, page)
                cache = allocate_index_cache(table.numel(), page, head_dim=i_dim, index_format=fmt, device=g.device)
                flat = cache.view(-1, cache.shape[-1])
                for start in range(0, flat.shape[0], 1 << 20):
                    keys = _device_randn(g, min(1 << 20, flat.shape[0] - start), i_dim)
                    flat[start : start + keys.shape[0]] = keys if fmt == "bf16" else pack_fp8_ds_index(keys)
                t = batch * length
                return {
                    "q": g.randn(t, i_heads, i_dim),
                    "weights": g.randn(t, i_heads, dtype=torch.float32, scale=i_heads**-0.5),
                    "index_cache": cache,
                    "block_table": table,
                    "cu_seqlens_q": torch.arange(0, t + 1, length, dtype=torch.int32, device=g.device),
                    "seq_lens": torch.full((batch,), ctx, dtype=torch.int32, device=g.device),
                    "topk": topk,
                }

            scored = batch * (length * ctx - length * (length - 1) // 2)  # (query, visible key) pairs
            flops = 2 * scored * i_heads * i_dim
            nbytes = batch * ctx * record + batch * length * (i_heads * i_dim * 2 + i_heads * 4 + topk * 4)
            name = f"{fmt} B={batch} L={length} ctx={ctx} H={i_heads} D={i_dim} topk={topk}"
            peers = {"torch gather + einsum + topk": _indexer_torch} if fmt == "bf16" and length == 1 else {}
            out.append(BenchCase("indexer_topk", name, make_index, flops, nbytes, peers, sets=1, compare=_compare_topk))
    return out


def _varlen_cases(quick: bool) -> list[BenchCase]:
    seqs, length, heads = (2, 256, 4) if quick else (4, 8192, 128)

    def make(g):
        t = seqs * length
        cu = torch.arange(0, seqs + 1, device=g.device, dtype=torch.int32) * length
        return {
            "q": g.randn(t, heads, 192),
            "k": g.randn(t, heads, 192),
            "v": g.randn(t, heads, 128),
            "cu_seqlens_q": cu,
            "cu_seqlens_k": cu,
            "softmax_scale": 192**-0.5,
            "causal": True,
        }

    flops = seqs * heads * length * length * (192 + 128)  # causal: half of 2 * L^2 * (D_qk + D_v)
    nbytes = seqs * length * heads * (192 * 2 + 128 * 2) * 2
    return [
        BenchCase(
            "attention_varlen",
            f"causal {seqs}x{length} H={heads} D=192/128",
            make,
            flops,
            nbytes,
            {"torch SDPA (its own pick)": _sdpa, "torch SDPA flash path, v padded": lambda kw: _sdpa(kw, flash=True)},
        )
    ]


def _small_op_cases(quick: bool) -> list[BenchCase]:
    t = 64 if quick else 4096
    hidden = 256 if quick else 7168
    experts = 16 if quick else 256
    out = [
        BenchCase(
            "rms_norm",
            f"T={t} H={hidden} residual",
            lambda g: {"x": g.randn(t, hidden), "w": g.randn(hidden), "eps": 1e-6, "residual": g.randn(t, hidden)},
            8 * t * hidden,
            4 * t * hidden * 2,
            {"torch composite": _reference_peer("rms_norm")},
        ),
        BenchCase(
            "silu_and_mul",
            f"T={t} I=2048 fp8 out",
            lambda g: {"x": g.randn(t, 4096), "quantize": True, "scale_format": "fp32"},
            4 * t * 2048,
            t * 4096 * 2 + t * 2048 * 1,
            {"torch composite": _reference_peer("silu_and_mul")},
        ),
        BenchCase(
            "quantize_fp8",
            f"T={t} K={hidden}",
            lambda g: {"x": g.randn(t, hidden), "block": 128, "scale_format": "fp32"},
            3 * t * hidden,
            t * hidden * 3,
            {"torch composite": _reference_peer("quantize_fp8")},
        ),
        BenchCase(
            "moe_route",
            f"T={t} E={experts} top-8 of 8 groups",
            lambda g: {
                "logits": g.randn(t, experts, dtype=torch.float32),
                "bias": g.randn(experts, dtype=torch.float32),
                "top_k": 8,
                "n_group": 8,
                "topk_group": 4,
                "renormalize": True,
                "routed_scaling_factor": 2.5,
                "scoring": "sigmoid",
            },
            10 * t * experts,
            t * experts * 4,
            {"torch composite": _reference_peer("moe_route")},
        ),
    ]
    for label, width in (("", 64), (" of 192 (MLA's query)", 192)):  # the model rotates the query's last 64 channels
        out.append(
            BenchCase(
                "rope",
                f"T={t} H=128 D=64{label}",
                lambda g, width=width: {
                    "x": g.randn(t, 128, width)[..., width - 64 :],
                    "positions": g.randint(0, 4096, t),
                    "cos_sin_cache": rope_cos_sin_cache(64, 4096).to(g.device),
                    "interleaved": True,
                },
                6 * t * 128 * 64,
                2 * t * 128 * 64 * 2,
                {"torch composite": _reference_peer("rope")},
            )
        )
    return out


def _moe_layer_cases(quick: bool) -> list[BenchCase]:
    """``normal`` dispatch at every size, and for decode-sized batches also ``low_latency`` (what a decode step under
    CUDA graphs runs: no host synchronisation, so it has a graph time; capacity T rows per expert)."""
    experts, hidden, inter = (16, 256, 128) if quick else (256, 7168, 2048)
    sizes = [(1, "normal"), (16, "normal"), (1, "low_latency")]
    if not quick:
        sizes = [(t, "normal") for t in (1, 16, 128, 1024, 8192)] + [(t, "low_latency") for t in (1, 16)]
    out = []
    for t, mode in sizes:

        def make(g, t=t, mode=mode):
            return {
                "x": g.randn(t, hidden),
                "logits": g.randn(t, experts, dtype=torch.float32),
                "bias": g.randn(experts, dtype=torch.float32, scale=0.1),
                "w13": g.fp8_weight(experts, 2 * inter, hidden),
                "w2": g.fp8_weight(experts, hidden, inter),
                "mode": mode,
            }

        flops = 2 * t * 8 * (2 * inter * hidden + hidden * inter)
        out.append(
            BenchCase(
                "moe_layer",
                f"T={t} E={experts} top-8 H={hidden} I={inter} fp8 {mode}",
                make,
                flops,
                _moe_layer_bytes,
                {"torch peers (per-expert cuBLAS, torch composites)": _moe_layer_torch_peers},
                compute="fp8",
                fn=moe_layer,
                sets=1,
            )
        )
    return out


def cases(quick: bool = False) -> list[BenchCase]:
    return [
        *_gemm_cases(quick),
        *_grouped_cases(quick),
        *_moe_layer_cases(quick),
        *_mla_cases(quick),
        *_varlen_cases(quick),
        *_dsa_cases(quick),
        *_small_op_cases(quick),
    ]


# --- running --------------------------------------------------------------------------------------------------------


def _row(
    case: BenchCase,
    impl: str,
    ms: float | None,
    graph_ms: float | None,
    ceilings: dict[str, float | None],
    rel_err: float | None,
    note: str = "",
) -> Row:
    if ms is None:
        return Row(case.op, case.name, impl, None, None, None, None, None, rel_err, note)
    seconds = (graph_ms if graph_ms is not None else ms) * 1e-3
    peak, bandwidth = ceilings["fp8_TFLOPs" if case.compute == "fp8" else "bf16_TFLOPs"], ceilings["copy_GBps"]
    roofline = None  # not measured: a share of an unmeasured ceiling means nothing
    if peak is not None and bandwidth is not None:
        roofline = 100 * max(case.bytes / (bandwidth * GB), case.flops / (peak * TFLOP)) / seconds
    return Row(
        case.op,
        case.name,
        impl,
        ms,
        graph_ms,
        case.flops / seconds / TFLOP,
        case.bytes / seconds / GB,
        roofline,
        rel_err,
        note,
    )


def graph_time(fn: Callable[[int], Any], device: str, sets: int) -> float | None:
    return time_graph_ms(fn, sets=sets) if device == "cuda" else None


def _bench_case(case: BenchCase, index: int, backend: str, device: str, n_sets: int, ceilings) -> list[dict]:
    """The rows of one case: the selected backend's implementation, then each peer."""
    rows: list[dict] = []
    inputs = [case.make(Gen(1000 * index + s, device)) for s in range(n_sets)]
    if callable(case.bytes):
        case = replace(case, bytes=case.bytes(inputs[0]))
    fn = (lambda _f=case.fn, **kw: _f(kw)) if case.fn else getattr(ops, case.op)
    with use("reference"):
        ref = fn(**inputs[0])
    out = fn(**inputs[0])
    if case.fn:
        label = f"{backend} ops"
    else:
        impl, fallback = last_resolution(case.op)
        label = f"{backend}/{impl.provider}" + (" (fallback)" if fallback else "")
    err = case.compare(out, ref, inputs[0]) if case.compare else error(out, ref)
    run = lambda i, fn=fn, inputs=inputs: fn(**inputs[i])
    ms = time_ms(run, device, sets=n_sets)
    rows.append(asdict(_row(case, label, ms, graph_time(run, device, n_sets), ceilings, err)))
    for peer, peer_fn in case.peers.items():
        try:
            peer_out = peer_fn(inputs[0])
            if case.compare:
                peer_err = case.compare(peer_out, ref, inputs[0])
            else:
                peer_err = error(peer_out, ref if case.op not in ("mla_decode", "sparse_mla") else ref[0])
            run = lambda i, p=peer_fn, inputs=inputs: p(inputs[i])
            peer_ms = time_ms(run, device, sets=n_sets)
            peer_row = _row(case, f"peer: {peer}", peer_ms, graph_time(run, device, n_sets), ceilings, peer_err)
        except Exception as e:  # a peer this torch or device lacks is reported, not fatal
            note = f"unavailable: {type(e).__name__}: {e}"[:200]
            peer_row = _row(case, f"peer: {peer}", None, None, ceilings, None, note)
        rows.append(asdict(peer_row))
    return rows


def run_bench(
    *,
    quick: bool = False,
    only_ops: list[str] | None = None,
    sets: int = 3,
    progress: Callable[[str], None] | None = None,
    on_case: Callable[[dict[str, Any]], None] | None = None,
    device: str | None = None,
) -> dict[str, Any]:
    """Times every case on the selected backend and its peers; returns the results as a JSON-able dict, and hands
    the results so far to ``on_case`` after each case (a long run stopped early keeps what it measured). ``device``:
    where the inputs live (default: the backend's device type)."""
    backend = current_backend()
    if device is None:
        device = backend.device_type  # device types are torch device names
        if backend.name == "reference" and torch.cuda.is_available():
            device = "cuda"
    env = {"torch": torch.__version__, "python": platform.python_version()}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "backend": backend.name,
        "device": device,
        "environment": env,
        "ceilings": measure_ceilings(device, quick),
        "rows": [],
    }
    ceilings, rows = result["ceilings"], result["rows"]
    for index, case in enumerate(c for c in cases(quick) if only_ops is None or c.op in only_ops):
        if progress:
            progress(f"{case.op}: {case.name}")
        try:
            rows.extend(_bench_case(case, index, backend.name, device, case.sets or sets, ceilings))
        except torch.OutOfMemoryError as e:  # one case too large for this device: say so, go on with the rest
            note = f"not run: out of memory ({str(e).splitlines()[0][:120]})"
            rows.append(asdict(_row(case, backend.name, None, None, ceilings, None, note)))
        if device == "cuda":
            torch.cuda.empty_cache()
        if on_case:
            on_case(result)
    return result


def markdown(result: dict[str, Any], command: str) -> str:
    """A dated RESULTS.md section for ``result``."""
    c = result["ceilings"]
    measured = ceilings_text(c)
    lines = [
        f"## {result['date']} — `deepinfer bench` on {result['environment'].get('gpu', result['device'])} "
        f"({result['backend']})",
        "",
        f"Command: `{command}`. torch {result['environment']['torch']}.",
        f"Ceilings measured in this run: {measured}. Times are medians, eager (host "
        "launch included) and replayed from a CUDA graph (device time; blank where the work cannot be captured); "
        "throughput and roofline % = max(bytes / bandwidth, FLOPs / peak) / time use the graph time where there "
        "is one (n/a where a ceiling was not measured).",
        "",
        "| op | case | implementation | ms eager | ms graph | TFLOP/s | GB/s | % roofline | rel. error | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda v, spec: "" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)
    for r in result["rows"]:
        lines.append(
            f"| {r['op']} | {r['case']} | {r['impl']} | {fmt(r['ms'], '.4f')} | {fmt(r['graph_ms'], '.4f')} | "
            f"{fmt(r['tflops'], '.1f')} | "
            f"{fmt(r['gbps'], '.0f')} | {roofline_text(r)} | {fmt(r['rel_err'], '.1e')} | "
            f"{r['note']} |"
        )
    return "\n".join(lines) + "\n"


def ceilings_text(c: dict[str, float | None]) -> str:
    """The ceilings of a run in words, ``n/a`` for those not measured."""
    fmt = lambda v, unit: "n/a" if v is None else f"{v:.0f} {unit}"
    return (
        f"copy {fmt(c['copy_GBps'], 'GB/s (read + write)')}, bf16 matmul {fmt(c['bf16_TFLOPs'], 'TFLOP/s')}, "
        f"FP8 matmul {fmt(c['fp8_TFLOPs'], 'TFLOP/s')}"
    )


def roofline_text(row: dict[str, Any]) -> str:
    """A row's roofline percentage; ``n/a`` for a timed row whose ceilings were not measured."""
    if row["roofline_pct"] is not None:
        return f"{row['roofline_pct']:.0f}"
    return "" if row["ms"] is None else "n/a"


def save(result: dict[str, Any], json_path: str | None, results_md: str | None, command: str) -> None:
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    if results_md:
        with open(results_md, "a") as f:
            f.write("\n" + markdown(result, command))
