"""Prefill speed of the model on a DeepSeek-V3-shaped (V3.2-, V4-shaped) cut, against its compute roofline.

    python benchmarks/bench_prefill.py results.json [--backend cuda_sm100] [--layers 4] [--model v32|v4]

The checkpoint is ``bench_model.py``'s: full DeepSeek-V3 (or V3.2) shapes, ``--layers`` layers, random FP8 weights;
with ``--model v4`` DeepSeek-V4-Flash's (FP8 linears, FP4 routed experts, the first layer hash-routed, the attention
types in V4's default schedule). Three measurements, each a whole engine step (``ModelRunner.execute``: inputs,
forward, sampling), CUDA events, median of ``--steps`` after two untimed ones:

- **chunk**: one sequence's prompt tokens ``[start, start + --chunk)`` in one step, for each ``--starts`` (0: a
  fresh prompt; later starts: the earlier tokens are already in the cache), the chunk ending the prompt, so the step
  samples its first token. V3 and V3.2: the earlier tokens' latents (and indexer keys) are random
  (``fill_cache``). V4: a sequence's state (its window ring, its compressors' unfinished windows, its compressed
  entries and indexer keys) is a function of its whole prefix, so the earlier tokens are prefilled by real engine
  steps of ``--chunk`` tokens before the timing. Each timed step rewrites the chunk's own records (and V4's rings),
  which later timed steps read back with other values: the work is the same.
- **mixed**: a chunk of ``--mixed-chunk`` tokens at start 0 beside ``--mixed-decodes`` sequences decoding at
  ``--context`` tokens each (``bench_model.fake_context``: random latents, or V4's pages filled with small random
  values), in one step.
- **time to first token**: a ``--ttft-prompt``-token prompt through ``LLM.generate(max_tokens=1)`` with
  ``--chunk``-token prefill chunks, wall clock, median of ``--ttft-repeats`` fresh prompts after one untimed
  (prefix caching off).

Roofline of a step: its FP8 GEMM FLOPs at the FP8 peak plus its other FLOPs (attention, the indexer's scores on a
bf16 key cache, the per-head absorbed products, the router and ``lm_head``) at the bf16 peak, both peaks measured in
the same run (``deepinfer bench``'s ceilings: cuBLAS on 8192-cube products, median of 10). The FLOPs are counted
from the config for the formulation the model runs (``prefill_flops``): DeepSeek-V3's prefill expands the latents of
every context token through ``kv_b_proj`` and attends causally in 192 + 128 dimensions per head; DeepSeek-V3.2
attends in the absorbed form (576 + 512) over at most ``index_topk`` tokens per query, and its indexer scores every
earlier token (64 heads of 128, at the FP8 peak on an FP8 key cache). Norms, rope, routing and quantisation count as
zero. DeepSeek-V4 (``prefill_flops_v4``) attends one shared key=value head of 512 per query head over its window of
128 and the compressed entries visible to it (every one in a heavily compressed layer, at most ``index_topk`` in a
compressed sparse one, whose indexer scores every visible entry), and adds its compressors', hyper-connections' and
grouped output projection's products. Its routed experts are FP4, upcast to bf16 in the kernels: bf16 peak. Its FP8
linears count at the FP8 peak where the model holds them in FP8 (the loader dequantises a weight whose scales the FP8
ops cannot use: ``V4Checkpoint.read_fp8``). The bytes the step must read (its weights once, every
routed expert among them, the cache it attends; V4: ``bench_model.decode_bytes_v4``'s cache terms at each
sequence's context) over the measured copy bandwidth are reported beside it.

``--tiny`` runs the whole script at toy sizes on the CPU (a dry run of the logic, no numbers worth reading).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_model import (
    TINY,
    TINY_V4,
    V3,
    V4,
    V32,
    Timer,
    checkpoint_path,
    copy_bandwidth,
    decode_bytes_v4,
    device_timeline,
    fake_context,
    fill_cache,
    kernel_profile,
    log,
    nbytes,
    write_checkpoint,
    write_checkpoint_v4,
)

import deepinfer
from deepinfer import QTensor, bench
from deepinfer.model import LLM, ModelConfig, SamplingParams, config_v4
from deepinfer.model.scheduler import PrefillChunk, ScheduledBatch
from deepinfer.model.sequence import Sequence, Status


def ceilings(device: torch.device) -> tuple[dict[str, float], float]:
    """The FP8 and bf16 matmul peaks (FLOP/s) and the copy bandwidth (bytes/s), measured as ``deepinfer bench``
    measures its ceilings; on the CPU (a dry run) one small fp32 product stands in for both peaks."""
    if device.type == "cuda":
        c = bench.measure_ceilings("cuda", quick=False)
        return {"fp8": c["fp8_TFLOPs"] * bench.TFLOP, "bf16": c["bf16_TFLOPs"] * bench.TFLOP}, c["copy_GBps"] * bench.GB
    a = torch.randn(512, 512)
    rate = 2 * 512**3 / min(Timer(device).time(lambda: a @ a) for _ in range(5)) * 1e3
    return {"fp8": rate, "bf16": rate}, copy_bandwidth(device, 1 << 26)


def prefill_flops(
    cfg: ModelConfig, chunks: list[tuple[int, int]], decodes: list[int], index_fp8: bool
) -> dict[str, float]:
    """FLOPs of one step: prompt ``chunks`` ``(start, tokens)`` and decode rows at ``decodes`` context lengths
    (positions attended, the new token included), by class: ``fp8`` (block-scaled GEMMs) and ``bf16`` (the rest).
    Each product of ``m x k`` by ``k x n`` counts ``2 m k n``; the parts are returned too."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    nope, rope, v, rank = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    rows = sum(n for _, n in chunks) + len(decodes)
    q_proj = (
        h * cfg.q_lora_rank + cfg.q_lora_rank * heads * (nope + rope) if cfg.q_lora_rank else h * heads * (nope + rope)
    )
    per_row = q_proj + h * (rank + rope) + heads * v * h  # q, kv_a, o_proj
    parts = dict.fromkeys(
        ("projections", "ffn", "router", "kv_b", "absorb", "attention", "indexer", "indexer_scores", "rotation"), 0.0
    )
    # query-key pairs: every prompt position attends to itself and all before it; sparse attention to at most top-k
    pairs = [(start + i + 1) for start, n in chunks for i in range(n)] + list(decodes)
    for layer in range(cfg.num_hidden_layers):
        parts["projections"] += 2 * rows * per_row
        if cfg.is_moe_layer(layer):
            experts = cfg.num_experts_per_tok + cfg.n_shared_experts
            parts["ffn"] += 2 * rows * 3 * h * cfg.moe_intermediate_size * experts
            parts["router"] += 2 * rows * h * cfg.n_routed_experts
        else:
            parts["ffn"] += 2 * rows * 3 * h * cfg.intermediate_size
        if cfg.sparse_attention:
            ih, idim = cfg.index_n_heads, cfg.index_head_dim
            parts["indexer"] += 2 * rows * (cfg.q_lora_rank * ih * idim + h * idim)  # wq_b, wk (FP8)
            parts["router"] += 2 * rows * h * ih  # weights_proj (fp32)
            parts["indexer_scores"] += 2 * sum(pairs) * ih * idim
            if index_fp8:  # the Hadamard rotation of queries and keys (bf16)
                parts["rotation"] += 2 * rows * (ih + 1) * idim * idim
            parts["absorb"] += 2 * rows * heads * (nope * rank + rank * v)
            parts["attention"] += 2 * sum(min(p, cfg.index_topk) for p in pairs) * heads * (2 * rank + rope)
        else:
            parts["kv_b"] += 2 * sum(start + n for start, n in chunks) * rank * heads * (nope + v)
            parts["absorb"] += 2 * len(decodes) * heads * (nope * rank + rank * v)
            prompt_pairs = sum(pairs[: len(pairs) - len(decodes)])
            parts["attention"] += 2 * prompt_pairs * heads * (nope + rope + v)
            parts["attention"] += 2 * sum(decodes) * heads * (2 * rank + rope)
    parts["lm_head"] = 2 * (len(chunks) + len(decodes)) * h * cfg.vocab_size
    fp8 = parts["projections"] + parts["ffn"] + parts["kv_b"] + parts["indexer"]
    fp8 += parts["indexer_scores"] if index_fp8 else 0.0
    total = sum(parts.values())
    return {"fp8": fp8, "bf16": total - fp8, "total": total, "parts": parts}


def prefill_flops_v4(
    cfg: config_v4.V4Config, chunks: list[tuple[int, int]], decodes: list[int], fp8_linears: bool
) -> dict[str, float]:
    """DeepSeek-V4's ``prefill_flops``: FLOPs of one step of prompt ``chunks`` ``(start, tokens)``, each ending its
    prompt, and decode rows at ``decodes`` context lengths (the new token included), by class, ``fp8`` and
    ``bf16``, with the parts. Each product of ``m x k`` by ``k x n`` counts ``2 m k n``, per layer:

    - ``projections``: ``wq_a``, ``wq_b``, ``wkv``, the grouped ``wo_a`` and ``wo_b``; ``shared_expert``; ``indexer``:
      its ``wq_b``. FP8 linears of the checkpoint: in the ``fp8`` class where the model holds them as FP8
      (``fp8_linears``), in ``bf16`` where it runs them dequantised.
    - ``experts``: ``num_experts_per_tok`` routed experts per row (hash-routed layers too). FP4 weights, in
      ``bf16``: the kernels upcast them to bf16 before the tensor cores (``tl.dot_scaled`` on Hopper), so the bf16
      peak bounds them.
    - ``compressor``: the compressors' ``wkv`` and ``wgate`` (``2 head_dim`` wide in compressed sparse layers,
      ``head_dim`` in heavily compressed ones; the indexer's ``2 index_head_dim``), kept in bf16 by DeepSeek.
    - ``router``: the fp32 ``gate`` and the indexer's ``weights_proj`` (fp32 products at the bf16 peak, as V3's router:
      a roofline slightly too fast, so a conservative share of it).
    - ``attention``: scores and values (``2 head_dim`` per head) over the rows each query attends: its window,
      ``min(p + 1, sliding_window)`` keys at position ``p``, plus the compressed entries whose window has closed,
      ``(p + 1) // m``, all of them in a heavily compressed layer, at most ``index_topk`` in a compressed sparse one.
    - ``indexer_scores``: ``index_n_heads x index_head_dim`` per query and visible entry (compressed sparse layers).
    - ``hc``: the hyper-connections' products: ``hc_pre``'s projection of the ``hc_mult`` flattened streams onto
      ``(2 + hc_mult) hc_mult`` mixes and its collapse (``1 x hc_mult`` by ``hc_mult x hidden``), ``hc_post``'s
      ``hc_mult x (hc_mult + 1)`` mix of the block output and the streams, twice a layer; ``hc_head`` (its projection
      onto ``hc_mult`` and the collapse) on the rows that get logits.
    - ``lm_head``: one row per chunk and decode row.

    Norms, rope, routing top-k, Sinkhorn, quantisation and the compressors' pooling (``compress_kv``: a softmax
    weight times one value per slot and channel, no matrix product) count as zero."""
    h, heads, d, q = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    n, sw, topk = cfg.hc_mult, cfg.sliding_window, cfg.index_topk
    ih, idim = cfg.index_n_heads, cfg.index_head_dim
    rows = sum(t for _, t in chunks) + len(decodes)
    positions = [start + i for start, t in chunks for i in range(t)] + [c - 1 for c in decodes]
    parts = dict.fromkeys(
        ("projections", "shared_expert", "experts", "compressor", "indexer", "router", "attention", "indexer_scores",
         "hc"), 0.0
    )  # fmt: skip
    proj = h * q + q * heads * d + h * d + heads * d * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * h
    ffn = 3 * h * cfg.moe_intermediate_size
    hc_site = n * h * (2 + n) * n + n * h + n * (n + 1) * h  # hc_pre (projection, collapse), hc_post
    for layer in range(cfg.num_hidden_layers):
        kind, m = cfg.attention_type(layer), cfg.compress_rate(layer)
        parts["hc"] += 2 * rows * 2 * hc_site
        parts["projections"] += 2 * rows * proj
        parts["shared_expert"] += 2 * rows * ffn
        parts["experts"] += 2 * rows * cfg.num_experts_per_tok * ffn
        parts["router"] += 2 * rows * h * cfg.n_routed_experts
        attended = sum(min(p + 1, sw) for p in positions)
        if kind == config_v4.HCA:
            parts["compressor"] += 2 * rows * 2 * h * d
            attended += sum((p + 1) // m for p in positions)
        elif kind == config_v4.CSA:
            parts["compressor"] += 2 * rows * 2 * h * (2 * d + 2 * idim)
            parts["indexer"] += 2 * rows * q * ih * idim
            parts["router"] += 2 * rows * h * ih
            parts["indexer_scores"] += 2 * sum((p + 1) // m for p in positions) * ih * idim
            attended += sum(min((p + 1) // m, topk) for p in positions)
        parts["attention"] += 2 * attended * heads * 2 * d
    logits = len(chunks) + len(decodes)
    parts["hc"] += 2 * logits * (n * h * n + n * h)
    parts["lm_head"] = 2 * logits * h * cfg.vocab_size
    fp8 = parts["projections"] + parts["shared_expert"] + parts["indexer"] if fp8_linears else 0.0
    total = sum(parts.values())
    return {"fp8": fp8, "bf16": total - fp8, "total": total, "parts": parts}


def holds_fp8_linears(llm: LLM) -> bool:
    """Whether the loaded DeepSeek-V4 model holds its FP8 linears as FP8 (``QTensor``) rather than dequantised."""
    return isinstance(llm.model.layers[0][1].w["wq_a.weight"], QTensor)


def step_flops(llm: LLM, chunks: list[tuple[int, int]], decodes: list[int]) -> dict[str, float]:
    """``prefill_flops`` (or ``prefill_flops_v4``) of a step of ``llm``, in the classes its weights and caches
    run in."""
    if llm.config.model_type == "deepseek_v4":
        return prefill_flops_v4(llm.config, chunks, decodes, holds_fp8_linears(llm))
    index_fp8 = llm.engine.index_cache is not None and llm.engine.index_cache.dtype == torch.uint8
    return prefill_flops(llm.config, chunks, decodes, index_fp8)


def step_bytes(llm: LLM, chunks: list[tuple[int, int]], decodes: list[int]) -> int:
    """Bytes a step must read at least: every weight the step uses once (all routed experts: a chunk of thousands of
    tokens selects them all; DeepSeek-V3's per-head absorbed products only with decode rows, V3.2's ``kv_b_proj``
    never) and, per layer and sequence, the cache records it attends: every context token's latent (V3), or the
    indexer key of every context token and at most ``index_topk`` latents (V3.2)."""
    if llm.config.model_type == "deepseek_v4":
        return step_bytes_v4(llm, chunks, decodes)
    model, cfg = llm.model, llm.config
    unread = {"kv_b_proj.weight"} if cfg.sparse_attention else (set() if decodes else {"w_uk", "w_uv"})
    weights = nbytes(model.lm_head) + nbytes(model.norm)
    for in_norm, attn, post_norm, ffn in model.layers:
        weights += nbytes(in_norm) + nbytes(post_norm)
        weights += sum(nbytes(w) for name, w in attn.w.items() if name not in unread)
        for name in ("gate", "bias", "w13", "w2"):
            weights += nbytes(getattr(ffn, name, None))
        if getattr(ffn, "shared", None) is not None:
            weights += nbytes(ffn.shared.w13) + nbytes(ffn.shared.w2)
    contexts = [start + n for start, n in chunks] + list(decodes)
    cache, index = llm.engine.kv_cache, llm.engine.index_cache
    record = cache.shape[-1] * cache.element_size()
    if cfg.sparse_attention:
        per_layer = sum(min(c, cfg.index_topk) for c in contexts) * record
        per_layer += sum(contexts) * index.shape[-1] * index.element_size()
    else:
        per_layer = sum(contexts) * record
    return weights + per_layer * cfg.num_hidden_layers


def step_bytes_v4(llm: LLM, chunks: list[tuple[int, int]], decodes: list[int]) -> int:
    """DeepSeek-V4's ``step_bytes``, in ``bench_model.decode_bytes_v4``'s terms: every weight once, every routed
    expert among them, and the caches of each sequence as that counts them for one decode at the sequence's context
    (a chunk's: its end), per layer: the window's keys, every entry of a heavily compressed layer, every indexer key
    and at most ``index_topk`` entries of a compressed sparse one, one row of each compressor's ring."""
    every = [moe.w13.shape[0] for moe in llm.model.moe_layers()]
    whole = decode_bytes_v4(llm, 0, 0, every)
    contexts = [start + n for start, n in chunks] + list(decodes)
    cache = sum(decode_bytes_v4(llm, 1, c, [0] * len(every))["kv_cache"] for c in contexts)
    return whole["weights"] + whole["experts"] + cache


def prompt_sequence(llm: LLM, name: str, length: int, cached: int, seed: int) -> Sequence:
    """A running sequence with a ``length``-token random prompt whose first ``cached`` tokens are in the cache:
    random latents (``fill_cache``), or for DeepSeek-V4, whose per-sequence state (window ring, unfinished windows,
    entries, indexer keys) is a function of the whole prefix, those tokens prefilled by engine steps of the
    scheduler's chunk size."""
    cfg, alloc = llm.config, llm.engine.allocator
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, cfg.vocab_size, (length,), generator=g).tolist()
    seq = Sequence(name, seed, tokens, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), seed=seed)
    alloc.grow(seq, length)
    seq.status = Status.RUNNING
    if cached and getattr(cfg, "owns_cache", False):
        step = llm.engine.scheduler.chunk_size
        for start in range(0, cached, step):
            llm.engine.runner.execute(ScheduledBatch(prefills=[PrefillChunk(seq, start, min(start + step, cached))]))
    elif cached:
        fill_cache(llm, torch.tensor([alloc.slot(seq, p) for p in range(cached)], device=llm.device))
    seq.num_computed = cached
    return seq


def step_timeline(llm: LLM, batch: ScheduledBatch) -> dict:
    """One step under the profiler (host and device): the device's busy and idle time, its longest idle gaps with
    the work on either side, and the host's CUDA runtime calls (``bench_model.device_timeline``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.engine.runner.execute(batch)
        torch.cuda.synchronize()
    line = device_timeline(prof, 1)
    log(
        f"  under the profiler: device busy {line['busy_us_per_step'] / 1e3:.2f} ms, idle "
        f"{line['idle_us_per_step'] / 1e3:.2f} ms; longest gaps (us): {[round(g['us']) for g in line['longest_gaps']]}"
    )
    for g in line["longest_gaps"][:4]:
        log(f"    {g['us']:.0f} us after {g['after']} before {g['before']}")
    return line


def time_step(llm: LLM, batch: ScheduledBatch, steps: int) -> tuple[float, list[float]]:
    """Median ms of ``steps`` steps of ``batch`` (after two untimed), and every time."""
    timer = Timer(llm.device)
    for _ in range(2):
        llm.engine.runner.execute(batch)
    times = [timer.time(lambda: llm.engine.runner.execute(batch)) for _ in range(steps)]
    return statistics.median(times), times


def measure(llm: LLM, name: str, batch: ScheduledBatch, chunks, decodes, peaks, bandwidth, steps: int) -> dict:
    """One step's row: its time, tokens per second, FLOPs and roofline."""
    log(f"{name}:")
    ms, times = time_step(llm, batch, steps)
    flops = step_flops(llm, chunks, decodes)
    roof_ms = (flops["fp8"] / peaks["fp8"] + flops["bf16"] / peaks["bf16"]) * 1e3
    need = step_bytes(llm, chunks, decodes)
    tokens = sum(n for _, n in chunks) + len(decodes)
    row = {
        "case": name,
        "chunks": chunks,
        "decodes": len(decodes),
        "decode_context": decodes[0] if decodes else None,
        "step_ms": ms,
        "tokens_per_s": tokens / ms * 1e3,
        "flops": flops,
        "tflop_per_s": flops["total"] / ms / 1e9,
        "roofline_ms": roof_ms,
        "roofline_pct": 100 * roof_ms / ms,
        "bytes": need,
        "bytes_ms": need / bandwidth * 1e3,
        "step_ms_all": times,
    }
    log(
        f"  {ms:.2f} ms, {row['tokens_per_s']:.0f} tokens/s, {row['tflop_per_s']:.0f} TFLOP/s; roofline "
        f"{roof_ms:.2f} ms ({row['roofline_pct']:.0f}%), bytes alone {row['bytes_ms']:.2f} ms"
    )
    return row


def add_profile(row: dict, llm: LLM, batch: ScheduledBatch) -> None:
    """The kernel profile and timeline of one more step of ``row``'s case, and what the issue's table keeps beside
    each step: launches, and time off the device."""
    log(f"{row['case']}, profiled:")
    llm.engine.runner.execute(batch)
    row["kernels"], row["timeline"] = kernel_profile(llm, batch), step_timeline(llm, batch)
    row["launches"] = sum(k["calls"] for k in row["kernels"] if not k["kernel"].startswith(("Memcpy", "Memset")))
    row["kernel_ms"] = sum(k["us"] for k in row["kernels"]) / 1e3
    off = row["step_ms"] - row["kernel_ms"]
    log(f"  {row['launches']} launches, {row['kernel_ms']:.2f} ms of kernels: {off:.2f} ms not")


def time_to_first_token(llm: LLM, prompt_len: int, repeats: int, seed: int) -> dict:
    """Wall-clock seconds of ``generate(max_tokens=1)`` on fresh random ``prompt_len``-token prompts: one untimed,
    then the median of ``repeats``."""
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    sync = torch.cuda.synchronize if llm.device.type == "cuda" else lambda: None
    times = []
    for i in range(repeats + 1):
        prompt = torch.randint(2, llm.config.vocab_size, (prompt_len,), generator=g).tolist()
        sync()
        start = time.perf_counter()
        llm.generate([prompt], params, progress=False)
        sync()
        if i:
            times.append(time.perf_counter() - start)
    s = statistics.median(times)
    log(f"time to first token, {prompt_len}-token prompt: {s * 1e3:.0f} ms ({prompt_len / s:.0f} prompt tokens/s)")
    return {"prompt_tokens": prompt_len, "seconds": s, "seconds_all": times, "prompt_tokens_per_s": prompt_len / s}


def each_case(llm: LLM, args, starts: list[int], run) -> None:
    """``run(llm, name, batch, chunks, decodes)`` for each case (the chunks at ``starts``, then the mixed step), its
    sequences released after."""
    for start in starts:
        seq = prompt_sequence(llm, f"chunk{start}", start + args.chunk, start, seed=start)
        batch = ScheduledBatch(prefills=[PrefillChunk(seq, start, start + args.chunk)])
        run(llm, f"chunk of {args.chunk} at start {start}", batch, [(start, args.chunk)], [])
        llm.engine.allocator.release(seq)
    if args.mixed_chunk and args.mixed_decodes:
        seqs = fake_context(llm, args.mixed_decodes, args.context, seed=args.seed)
        seq = prompt_sequence(llm, "mixed", args.mixed_chunk, 0, seed=7)
        batch = ScheduledBatch(decodes=seqs, prefills=[PrefillChunk(seq, 0, args.mixed_chunk)])
        name = f"chunk of {args.mixed_chunk} + {args.mixed_decodes} decodes at context {args.context}"
        run(llm, name, batch, [(0, args.mixed_chunk)], [args.context] * args.mixed_decodes)
        for s in [*seqs, seq]:
            llm.engine.allocator.release(s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", help="write the results here")
    p.add_argument("--backend", help="backend (default: the selected one)")
    p.add_argument("--model", choices=("v3", "v32", "v4"), default="v3", help="DeepSeek-V3, V3.2 or V4-Flash shapes")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--dense-layers", type=int, default=1, help="of which dense, first (default 1; not v4)")
    p.add_argument("--kv-format", choices=("bf16", "fp8_ds_mla"), default="bf16")
    p.add_argument("--chunk", type=int, default=8192, help="prefill chunk tokens (default 8192)")
    p.add_argument("--starts", default="0,24576", help="chunk starts: tokens already cached (default 0,24576)")
    p.add_argument("--mixed-chunk", type=int, default=4096, help="the mixed step's chunk (default 4096; 0: none)")
    p.add_argument("--mixed-decodes", type=int, default=64, help="the mixed step's decoding sequences (default 64)")
    p.add_argument("--context", type=int, default=4096, help="the decoding sequences' context (default 4096)")
    p.add_argument("--ttft-prompt", type=int, default=32768, help="time to first token of this prompt (0: skip)")
    p.add_argument("--ttft-repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps per case (median)")
    p.add_argument("--checkpoint", help="use (or write, if missing) the checkpoint here instead of a temp dir")
    p.add_argument(
        "--profile",
        action="store_true",
        help="GPU time per kernel, and the device's idle gaps, of one step of each case",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="toy shapes on the CPU: a dry run of the script")
    args = p.parse_args(argv)

    backend = args.backend or deepinfer.current_backend().name
    spec = deepinfer.registry.get().lookup(backend)
    device = torch.device("cpu" if args.tiny else spec.device_type)
    if args.model == "v4":
        config = dict(V4, num_hidden_layers=args.layers) | (TINY_V4 if args.tiny else {})
    else:
        config = dict(V32 if args.model == "v32" else V3, num_hidden_layers=args.layers)
        config["first_k_dense_replace"] = args.dense_layers
        if args.tiny:
            config |= TINY | ({"index_n_heads": 8, "index_topk": 64} if args.model == "v32" else {})
    if args.tiny:
        args.chunk, args.context = min(args.chunk, 256), min(args.context, 128)
        args.mixed_chunk, args.mixed_decodes = min(args.mixed_chunk, 128), min(args.mixed_decodes, 4)
        args.ttft_prompt = min(args.ttft_prompt, 512)
        args.starts = ",".join(str(min(int(s), 256)) for s in args.starts.split(","))
    starts = [int(s) for s in args.starts.split(",")]
    longest = max([s + args.chunk for s in starts] + [args.ttft_prompt, args.mixed_chunk, args.context])
    pages = math.ceil(longest / 64) * 2 + args.mixed_decodes * math.ceil(args.context / 64) + 64
    if args.model == "v4":  # each live sequence's state pages too
        layout = config_v4.V4Config.from_dict(config).cache_layout(64, 2, args.kv_format)
        pages += (args.mixed_decodes + 1) * layout.state_pages

    path, tmp = checkpoint_path(args.checkpoint)
    rows, ttft = [], None
    try:
        if not (path / "config.json").is_file():
            log(f"writing the checkpoint to {path}")
            (write_checkpoint_v4 if args.model == "v4" else write_checkpoint)(path, config, device, args.seed)
        peaks, bandwidth = ceilings(device)
        log(
            f"FP8 peak {peaks['fp8'] / 1e12:.0f} TFLOP/s, bf16 peak {peaks['bf16'] / 1e12:.0f} TFLOP/s, "
            f"copy bandwidth {bandwidth / 1e9:.0f} GB/s"
        )
        llm = LLM(
            path,
            backend,
            device=device,
            kv_format=args.kv_format,
            num_blocks=pages,
            max_num_seqs=max(args.mixed_decodes, 1),
            max_num_batched_tokens=args.chunk + args.mixed_decodes,
            prefill_chunk_size=args.chunk,
            max_model_len=longest + 64,
            enable_prefix_caching=False,
            progress=False,
        )
        with deepinfer.use(backend):
            each_case(llm, args, starts, lambda *case: rows.append(measure(*case, peaks, bandwidth, args.steps)))
            if args.ttft_prompt:
                ttft = time_to_first_token(llm, args.ttft_prompt, args.ttft_repeats, args.seed)
            # profiles after every timing: once the profiler has run, the process's launches stay slower
            if args.profile and llm.device.type == "cuda":
                profiled = iter(rows)
                each_case(llm, args, starts, lambda llm, name, batch, *_: add_profile(next(profiled), llm, batch))
        del llm
        gc.collect()
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    print(
        f"prefill, {args.model}, {args.layers} layers, {args.kv_format} cache, backend {backend}; FP8 peak "
        f"{peaks['fp8'] / 1e12:.0f}, bf16 peak {peaks['bf16'] / 1e12:.0f} TFLOP/s"
    )
    print(f"{'case':52} {'ms':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'roofline ms':>12} {'% roofline':>11}")
    for r in rows:
        print(
            f"{r['case']:52} {r['step_ms']:>8.2f} {r['tokens_per_s']:>10.0f} {r['tflop_per_s']:>8.0f} "
            f"{r['roofline_ms']:>12.2f} {r['roofline_pct']:>10.0f}%"
        )
    if ttft:
        print(f"time to first token, {ttft['prompt_tokens']}-token prompt: {ttft['seconds'] * 1e3:.0f} ms")
    result = {
        "config": config,
        "backend": backend,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "model": args.model,
        "kv_format": args.kv_format,
        "peaks_flop_per_s": peaks,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "steps": rows,
        "time_to_first_token": ttft,
        "tiny_dry_run": args.tiny,
        "targets": {"roofline_pct": 60.0},
    }
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
