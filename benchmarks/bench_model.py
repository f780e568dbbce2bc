"""Decode speed of the model on a DeepSeek-V3-shaped (or V3.2-shaped) FP8 checkpoint cut to fit one GPU.

    python benchmarks/bench_model.py results.json [--backend cuda_sm100] [--layers 4] [--context 4096] [--model v32]

1. Writes a checkpoint with DeepSeek-V3's full shapes (hidden 7168, 128 heads, MLA ranks 1536 / 512, 256 routed
   experts of 2048 + 1 shared, group-limited top-8 routing, vocabulary 129280) but only ``--layers`` layers (the
   first ``--dense-layers`` dense), random weights drawn on the GPU and block-quantised to FP8 (128x128
   ``weight_scale_inv``), in the Hugging Face layout, one shard per layer.
2. Loads it with ``deepinfer.model.LLM`` and times the decode step (CUDA graphs where the backend has them) at each
   batch size with every sequence holding ``--context`` tokens in the paged cache (random latents: decode speed does
   not depend on their values): CUDA events around whole engine steps (inputs, forward, sampling), median of
   ``--steps``.
3. Roofline per step: the bytes a decode step must read (every weight used in decode, the routed experts the step
   actually selects, ``lm_head``, and ``batch x context`` cache records per layer) over the bandwidth of a large
   device-to-device copy measured here; reported as a percentage of that bound.
4. transformers' ``DeepseekV3ForCausalLM`` (eager attention and experts, bf16) on the same checkpoint, its FP8
   weights dequantised, over a cache holding the same context length: median of ``--hf-steps``; out-of-memory is
   recorded as such.

``--model v32`` writes DeepSeek-V3.2's shapes (the same plus a lightning indexer per layer: 64 heads of 128, top-k
2048) and fills the indexer-key cache too; its roofline counts the indexer keys of the whole context and the latents
of at most ``index_topk`` tokens per sequence and layer; with ``--profile`` it reports the indexer's share of the
step's kernel time. transformers is not run for it.

``--model v4`` writes DeepSeek-V4-Flash's shapes (hidden 4096, 64 heads of 512 with one shared key=value head,
q rank 1024, 8 output groups of rank 1024, ``hc_mult`` 4, 256 routed experts of 2048 as FP4 with ue8m0 scales, top-6,
the first layer hash-routed, the other linears FP8, a window of 128, compressed sparse layers of rate 4 with a
64 x 128 indexer keeping 512 entries, heavily compressed layers of rate 128, alternating), fills each sequence's
pages with small random values, and counts in its roofline the window's keys, every compressed entry of a heavily
compressed layer, every indexer key and at most ``index_topk`` entries of a compressed sparse one, and one row of
each compressor's projections. transformers is not run for it.

Prints a table and writes every number to the JSON path. Targets: >= 10x transformers at batch 64, >= 50% of the
roofline at batch 1. ``--tiny`` runs the whole script at toy sizes on the CPU (a dry run of the logic, no numbers
worth reading).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import math
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

import deepinfer
from deepinfer import QTensor, ops
from deepinfer.model import LLM, Checkpoint, ModelConfig, SamplingParams, config_v4, expected_layout
from deepinfer.model.scheduler import ScheduledBatch
from deepinfer.model.sequence import Sequence, Status
from deepinfer.qtensor import FP4_GROUP, FP4Tensor, quantize_blocks

V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "rope_interleave": True,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
}
V32 = dict(
    V3,
    architectures=["DeepseekV32ForCausalLM"],
    model_type="deepseek_v32",
    index_n_heads=64,
    index_head_dim=128,
    index_topk=2048,
)
V4 = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "moe_intermediate_size": 2048,
    "num_attention_heads": 64,
    "head_dim": 512,
    "q_lora_rank": 1024,
    "qk_rope_head_dim": 64,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "n_routed_experts": 256,
    "num_experts_per_tok": 6,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "num_hash_layers": 1,
    "hc_mult": 4,
    "sliding_window": 128,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "max_position_embeddings": 1048576,
    "num_nextn_predict_layers": 0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "quantization_config": V3["quantization_config"] | {"scale_fmt": "ue8m0", "expert_dtype": "fp4"},
}
INDEXER_KERNELS = ("index", "topk", "sort", "radix")  # kernel names of the indexer's work (scores, selection)
# Toy shapes for --tiny (every K a multiple of 128, as FP8 GEMMs need).
TINY = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=16,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=4,
    kv_lora_rank=128,
    q_lora_rank=128,
    qk_rope_head_dim=32,
    qk_nope_head_dim=32,
    v_head_dim=32,
    max_position_embeddings=4096,
)


TINY_V4 = dict(
    vocab_size=512,
    hidden_size=256,
    moe_intermediate_size=128,
    num_attention_heads=4,
    head_dim=128,
    q_lora_rank=128,
    qk_rope_head_dim=32,
    o_groups=2,
    o_lora_rank=128,
    n_routed_experts=16,
    num_experts_per_tok=4,
    sliding_window=16,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    index_n_heads=4,
    index_head_dim=128,
    index_topk=8,
    max_position_embeddings=4096,
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------------
# Checkpoint


def write_shards(path: Path, config: dict, names: dict[str, str], tensors: Callable[[str], dict]) -> None:
    """``config.json`` and one safetensors shard per group of ``names`` (name -> its group, a layer or ``top``), each
    name's tensors ``tensors(name)`` (the weight, with its scale where quantised), plus the index."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    groups: dict[str, list[str]] = {}
    for name, group in names.items():
        groups.setdefault(group, []).append(name)
    weight_map = {}
    for i, group in enumerate(groups.values()):
        shard, file = {}, f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        for name in group:
            shard.update(tensors(name))
        save_file(shard, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        log(f"  wrote {file} ({sum(t.numel() * t.element_size() for t in shard.values()) / 1e9:.2f} GB)")
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def checkpoint_path(given: str | None) -> tuple[Path, str | None]:
    """Where the checkpoint goes: ``given``, or a new temporary directory (returned second, to remove after)."""
    if given:
        return Path(given), None
    tmp = tempfile.mkdtemp(prefix="deepinfer-bench-")
    return Path(tmp) / "ckpt", tmp


def write_checkpoint(path: Path, config: dict, device: torch.device, seed: int) -> None:
    """Random weights for every tensor of ``config``'s layout, drawn on ``device``; linears block-quantised to FP8.
    One safetensors shard per layer, plus the index."""
    layout = expected_layout(ModelConfig.from_dict(config))
    gen = torch.Generator(device=device).manual_seed(seed)

    def tensors(name: str) -> dict:
        want = layout[name]
        shape = want.shape
        if name.endswith("norm.weight"):
            return {name: torch.ones(shape, dtype=torch.bfloat16)}
        if name.endswith("e_score_correction_bias"):
            return {name: (0.01 * torch.randn(shape, generator=gen, device=device)).cpu()}
        if name == "model.embed_tokens.weight":
            return {name: torch.randn(shape, generator=gen, device=device).to(torch.bfloat16).cpu()}
        w = torch.randn(shape, generator=gen, device=device) / math.sqrt(shape[-1])
        if want.kind == "linear" and name != "lm_head.weight":
            q = quantize_blocks(w)
            return {name: q.data.cpu(), name + "_scale_inv": q.scale.cpu()}
        router = name.endswith("mlp.gate.weight")  # bf16 in DeepSeek-V3's checkpoints, read as fp32
        return {name: w.cpu() if want.kind == "fp32" and not router else w.to(torch.bfloat16).cpu()}

    names = {
        n: n.split(".")[2] if n.startswith("model.layers.") else "top"
        for n, e in layout.items()
        if not e.optional  # (an MTP layer's copies of the embedding and head: never read)
    }
    write_shards(path, config, names, tensors)


def write_checkpoint_v4(path: Path, config: dict, device: torch.device, seed: int) -> None:
    """DeepSeek-V4's tensors for ``config`` (``config_v4.expected_layout``), random, drawn on ``device``: routed
    experts FP4 (random e2m1 pairs, one ue8m0 scale per 32 values around 2^-4), the other linears FP8 with ue8m0
    block scales, except those DeepSeek keeps in high precision. One safetensors shard per layer, plus the index."""
    cfg = config_v4.V4Config.from_dict(config)
    layout = config_v4.expected_layout(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)

    def tensors(name: str) -> dict:
        shape, kind = layout[name]
        if kind == config_v4.INDEX:
            return {name: torch.randint(0, cfg.n_routed_experts, shape, generator=gen, device=device).cpu()}
        if kind == config_v4.EXPERT:
            n, k = shape
            data = torch.randint(-128, 128, (n, k // 2), generator=gen, device=device, dtype=torch.int8)
            scale = torch.randint(120, 124, (n, k // FP4_GROUP), generator=gen, device=device, dtype=torch.uint8)
            return {name: data.cpu(), name + "_scale_inv": scale.view(torch.float8_e8m0fnu).cpu()}
        if name.endswith("norm.weight"):
            return {name: torch.ones(shape, dtype=torch.bfloat16)}
        w = torch.randn(shape, generator=gen, device=device) / math.sqrt(shape[-1])
        if kind == config_v4.LINEAR and not any(h in name for h in config_v4.HIGH_PRECISION):
            q = quantize_blocks(w, scale_format="ue8m0")
            return {name: q.data.cpu(), name + "_scale_inv": q.scale.to(torch.float8_e8m0fnu).cpu()}
        return {name: w.to(torch.float32 if ".hc_" in name or "hc_head" in name else torch.bfloat16).cpu()}

    names = {n: n.split(".")[1] if n.startswith("layers.") else "top" for n in layout}
    write_shards(path, config, names, tensors)


# ---------------------------------------------------------------------------------------------------------------
# Timing


class Timer:
    """Device events on CUDA, wall clock elsewhere; milliseconds."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def time(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy (read + write), the best of 10."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    timer = Timer(device)
    dst.copy_(src)
    best = min(timer.time(lambda: dst.copy_(src)) for _ in range(10))
    return 2 * nbytes / (best / 1e3)


def nbytes(w) -> int:
    if isinstance(w, (QTensor, FP4Tensor)):
        return w.data.numel() * w.data.element_size() + w.scale.numel() * w.scale.element_size()
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else 0


def decode_bytes(llm: LLM, batch: int, context: int, experts_used: list[int]) -> dict[str, int]:
    """Bytes one decode step of ``batch`` sequences must read: weights used by absorbed decode (not
    ``kv_b_proj``), each MoE layer's selected experts, ``lm_head`` and the embedding rows, the cache records."""
    model, cfg = llm.model, llm.config
    weights = nbytes(model.lm_head) + nbytes(model.norm) + batch * cfg.hidden_size * model.embed.element_size()
    experts = 0
    moe_layer = 0
    for in_norm, attn, post_norm, ffn in model.layers:
        weights += nbytes(in_norm) + nbytes(post_norm)
        weights += sum(nbytes(w) for name, w in attn.w.items() if name != "kv_b_proj.weight")
        if hasattr(ffn, "gate"):  # MoE
            weights += nbytes(ffn.gate) + nbytes(ffn.bias)
            if ffn.shared is not None:
                weights += nbytes(ffn.shared.w13) + nbytes(ffn.shared.w2)
            per_expert = (nbytes(ffn.w13) + nbytes(ffn.w2)) // ffn.w13.shape[0]
            experts += experts_used[moe_layer] * per_expert
            moe_layer += 1
        else:
            weights += nbytes(ffn.w13) + nbytes(ffn.w2)
    cache = llm.engine.kv_cache
    record = cache.shape[-1] * cache.element_size()
    attended = min(context, cfg.index_topk) if cfg.sparse_attention else context
    kv = batch * attended * record * cfg.num_hidden_layers
    if llm.engine.index_cache is not None:  # every cached indexer key is scored
        index = llm.engine.index_cache
        kv += batch * context * index.shape[-1] * index.element_size() * cfg.num_hidden_layers
    return {"weights": weights, "experts": experts, "kv_cache": kv, "total": weights + experts + kv}


def decode_bytes_v4(llm: LLM, batch: int, context: int, experts_used: list[int]) -> dict[str, int]:
    """DeepSeek-V4: bytes one decode step of ``batch`` sequences must read. Weights: every layer's attention
    (compressors and indexer included: they project the new token), mHC and norms, router, shared expert; each MoE
    layer's selected experts; the head and mHC head. Caches per sequence and layer, in the layout's records: the
    window's ``sliding_window - 1`` keys; a heavily compressed layer's every entry; a compressed sparse layer's every
    indexer key and at most ``index_topk`` entries; one row of each compressor's projections (a window's rows are
    each read once when it closes)."""
    model, cfg = llm.model, llm.config
    lay = model.cache_layout()
    weights = nbytes(model.lm_head) + nbytes(model.norm) + sum(nbytes(w) for w in model.hc_head)
    weights += batch * cfg.hidden_size * model.embed.element_size()
    experts = cache = 0
    for i, (attn_norm, attn, ffn_norm, moe, hc) in enumerate(model.layers):
        weights += nbytes(attn_norm) + nbytes(ffn_norm) + sum(nbytes(w) for site in hc.values() for w in site)
        weights += sum(nbytes(w) for w in attn.w.values())
        weights += (
            nbytes(moe.gate) + nbytes(moe.s13) + nbytes(moe.s2) + (nbytes(moe.bias) if moe.bias is not None else 0)
        )
        experts += experts_used[i] * (nbytes(moe.w13) + nbytes(moe.w2)) // moe.w13.shape[0]
        per_seq = min(context, cfg.sliding_window - 1) * cfg.head_dim * lay.elem_bytes
        if attn.m:
            count = context // attn.m
            if attn.indexer is not None:
                per_seq += count * lay.index_bytes + min(count, cfg.index_topk) * lay.entry_bytes
                per_seq += 2 * 2 * cfg.index_head_dim * lay.elem_bytes
            else:
                per_seq += count * lay.entry_bytes
            per_seq += 2 * (2 if attn.indexer is not None else 1) * cfg.head_dim * lay.elem_bytes
        cache += batch * per_seq
    return {"weights": weights, "experts": experts, "kv_cache": cache, "total": weights + experts + cache}


def fake_context(llm: LLM, batch: int, context: int, seed: int) -> list[Sequence]:
    """``batch`` running sequences with ``context - 1`` tokens already in the cache (random latents) and one to
    decode."""
    engine, cfg = llm.engine, llm.config
    alloc = engine.allocator
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(batch):
        tokens = torch.randint(2, cfg.vocab_size, (context,), generator=g).tolist()
        params = SamplingParams(max_tokens=1 << 30, temperature=0, ignore_eos=True)
        seq = Sequence(f"bench{i}", i, tokens[:-1], params, seed=i)
        seq.token_ids.append(tokens[-1])
        alloc.grow(seq, context)
        seq.num_computed, seq.status = context - 1, Status.RUNNING
        seqs.append(seq)
    if getattr(cfg, "owns_cache", False):  # DeepSeek-V4: pages of bytes the model lays out; small finite values
        pages = torch.tensor(sorted({b for s in seqs for b in s.block_table}), device=llm.device)
        cache = engine.kv_cache[0]
        gen = torch.Generator(device=llm.device).manual_seed(seed)
        for start in range(0, pages.numel(), 256):
            part = pages[start : start + 256]
            shape = (part.numel(), cache.shape[1])
            # bytes below 0x3c: bf16 and fp32 values below 2^-6, e4m3 values below 1, ue8m0 scales below 2^-67
            cache[part] = torch.randint(0, 0x3C, shape, generator=gen, device=llm.device, dtype=torch.uint8)
        return seqs
    fill_cache(llm, torch.tensor([alloc.slot(s, p) for s in seqs for p in range(context - 1)], device=llm.device))
    return seqs


def fill_cache(llm: LLM, slots: torch.Tensor) -> None:
    """Random latents (and indexer keys) in cache ``slots`` of every layer (DeepSeek-V3 and V3.2 layouts)."""
    engine, cfg = llm.engine, llm.config
    chunk = 1 << 16
    for layer, layer_cache in enumerate(engine.runner.kv_caches):
        for start in range(0, slots.numel(), chunk):
            part = slots[start : start + chunk]
            latent = torch.randn(part.numel(), cfg.kv_width, device=llm.device).to(torch.bfloat16)
            ops.write_kv_cache(latent, layer_cache, part, kv_lora_rank=cfg.kv_lora_rank)
            if engine.runner.index_caches is not None:
                keys = torch.randn(part.numel(), cfg.index_head_dim, device=llm.device).to(torch.bfloat16)
                ops.write_index_cache(keys, engine.runner.index_caches[layer], part)


def experts_selected(llm: LLM, batch: ScheduledBatch) -> list[int]:
    """Distinct routed experts each MoE layer selects in one eager decode step of ``batch`` (routed by score or,
    DeepSeek-V4's first layers, by the token's hash)."""
    used: list[int] = []
    routes = {name: getattr(ops, name) for name in ("moe_route", "moe_route_hash")}

    def spy(route):
        def counted(*a, **k):
            weights, ids = route(*a, **k)
            used.append(int(torch.unique(ids).numel()))
            return weights, ids

        return counted

    for name, route in routes.items():
        setattr(ops, name, spy(route))
    try:
        input_ids, fb, _ = llm.engine.runner.prepare(batch)
        llm.model.forward(input_ids, fb, llm.engine.runner.kv_caches, llm.engine.runner.index_caches)
    finally:
        for name, route in routes.items():
            setattr(ops, name, route)
    return used


def launches_dependent(backend: str) -> bool:
    """Whether ``backend``'s kernels start before the kernel ahead of them ends (cuda_sm100's programmatic dependent
    launch, on unless ``DEEPINFER_CUDA_PDL=0``): a profile's time for such a kernel includes its wait for that one."""
    if backend != "cuda_sm100":
        return False
    from deepinfer_cuda_sm100._triton import PDL

    return PDL


def kernel_profile(llm: LLM, batch: ScheduledBatch, top: int = 15) -> list[dict]:
    """GPU time per kernel name over one decode step as the engine runs it (graph replay included), largest first
    (on a CPU, the dry run's, host time per op of its own)."""
    from torch.profiler import ProfilerActivity, profile

    gpu = llm.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
        llm.engine.runner.execute(batch)
        if gpu:
            torch.cuda.synchronize()
    kernels = [
        {"kernel": e.key[:90], "us": e.device_time_total if gpu else e.self_cpu_time_total, "calls": e.count}
        for e in prof.key_averages()
        if (e.device_time_total if gpu else e.self_cpu_time_total) > 0
    ]
    kernels.sort(key=lambda k: -k["us"])
    for k in kernels[:top]:
        log(f"    {k['us']:9.1f} us {k['calls']:5d} x  {k['kernel']}")
    return kernels


def host_profile(llm: LLM, batch: ScheduledBatch, steps: int = 10, top: int = 30) -> dict[str, list[dict]]:
    """cProfile of ``steps`` steps: the functions with the most host time of their own (``own``) and in all
    (``cumulative``), in ms per step (cProfile's own cost included)."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        llm.engine.runner.execute(batch)
    if llm.device.type == "cuda":
        torch.cuda.synchronize()
    profile.disable()
    stats = pstats.Stats(profile).stats
    rows = [
        {"function": f"{Path(file).name}:{line}({name})", "calls": calls / steps, "own_ms": own / steps * 1e3,
         "cumulative_ms": cum / steps * 1e3}
        for (file, line, name), (calls, _, own, cum, _) in stats.items()
    ]  # fmt: skip
    by = lambda key: sorted(rows, key=lambda r: r[key], reverse=True)[:top]
    return {"own": by("own_ms"), "cumulative": by("cumulative_ms")}


def engine_steps(
    llm: LLM, seqs: list[Sequence], steps: int, async_scheduling: bool, timeline: bool = False
) -> float | dict:
    """Wall-clock ms per ``LLMEngine.step`` over ``steps`` steps in which ``seqs`` decode (after 3 untimed ones),
    with or without asynchronous scheduling; the context grows by one token per step. ``seqs`` are left
    running. ``timeline``: those steps under the profiler instead, and ``device_timeline`` of them."""
    engine = llm.engine
    engine.async_scheduling = async_scheduling
    engine.scheduler.running = sorted(seqs, key=lambda s: s.arrival)
    sync = torch.cuda.synchronize if llm.device.type == "cuda" else lambda: None
    for _ in range(3):
        engine.step()
    sync()
    prof = None
    with contextlib.ExitStack() as stack:
        if timeline:
            from torch.profiler import ProfilerActivity, profile

            prof = stack.enter_context(profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]))
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        ms = (time.perf_counter() - start) * 1e3 / steps
    engine.async_scheduling = False
    engine.step()  # reads back the step still running
    engine.scheduler.running = []
    return device_timeline(prof, steps) if timeline else ms


def device_timeline(prof, steps: int, top: int = 8) -> dict:
    """From a profile of ``steps`` engine steps: the device's busy time (the union of its kernels and copies) and
    idle time per step, the longest idle gaps with the device work on either side, and the host's CUDA runtime
    calls by total time per step."""
    from torch.autograd import DeviceType

    events = [(e.device_type(), e.start_ns() / 1e3, e.duration_ns() / 1e3, e.name()) for e in
              prof.profiler.kineto_results.events()]  # fmt: skip
    work = sorted((t0, t0 + us, name) for kind, t0, us, name in events if kind == DeviceType.CUDA)
    busy, gaps, end = 0.0, [], None
    for i, (t0, t1, _) in enumerate(work):
        if end is not None and t0 > end:
            gaps.append((t0 - end, work[i - 1][2], work[i][2]))
        busy += max(0.0, t1 - max(t0, end if end is not None else t0))
        end = t1 if end is None else max(end, t1)
    span = work[-1][1] - work[0][0] if work else 0.0
    runtime: dict[str, float] = {}
    for kind, _, us, name in events:
        if kind == DeviceType.CPU and name.startswith("cu"):
            runtime[name] = runtime.get(name, 0.0) + us
    gaps.sort(reverse=True)
    return {
        "span_us_per_step": span / steps,
        "busy_us_per_step": busy / steps,
        "idle_us_per_step": (span - busy) / steps,
        "longest_gaps": [{"us": g, "after": a[:80], "before": b[:80]} for g, a, b in gaps[:top]],
        "runtime_us_per_step": dict(sorted(((k, v / steps) for k, v in runtime.items()), key=lambda kv: -kv[1])[:top]),
    }


def replay_only(llm: LLM, batch: int):
    """The captured decode graph the last step, of ``batch`` rows, replayed (its inputs as that step left them), or
    None."""
    graphs = llm.engine.runner.graphs
    if graphs is None or not graphs.fits(batch) or graphs.last[0] != next(b for b in graphs.sizes if b >= batch):
        return None
    return graphs.graphs[graphs.last]


def bench_ours(
    llm: LLM,
    batches: list[int],
    context: int,
    steps: int,
    warmup: int,
    bandwidth: float,
    profile: bool = False,
    host: bool = False,
    loop_steps: int = 0,
    timeline: bool = False,
) -> list[dict]:
    """Each batch's decode step timed, then (after every timing: once the profiler has run, the process's launches
    stay slower) its kernel profile, host profile and engine-step timeline where asked."""
    timer = Timer(llm.device)
    rows = []
    for b in batches:
        seqs = fake_context(llm, b, context, seed=b)
        batch = ScheduledBatch(decodes=seqs)
        used = experts_selected(llm, batch)
        for _ in range(warmup):  # same position every step: the context stays `context` tokens
            llm.engine.runner.execute(batch)
        times = [timer.time(lambda batch=batch: llm.engine.runner.execute(batch)) for _ in range(steps)]
        graph = replay_only(llm, b)
        replay = statistics.median(timer.time(graph.replay) for _ in range(steps)) if graph else None
        loop = {"sync": [], "async": []}
        for _ in range(2 if loop_steps else 0):  # alternated: sync, async, sync, async
            for mode in loop:
                loop[mode].append(engine_steps(llm, seqs, loop_steps, async_scheduling=mode == "async"))
        for s in seqs:
            llm.engine.allocator.release(s)
        ms = statistics.median(times)
        need = (decode_bytes_v4 if llm.config.model_type == "deepseek_v4" else decode_bytes)(llm, b, context, used)
        roof_ms = need["total"] / bandwidth * 1e3
        rows.append(
            {
                "batch": b,
                "step_ms": ms,
                "graph_replay_ms": replay,
                "tokens_per_s": b / ms * 1e3,
                "roofline_ms": roof_ms,
                "roofline_tokens_per_s": b / roof_ms * 1e3,
                "roofline_pct": 100 * roof_ms / ms,
                "bytes_per_step": need,
                "experts_selected_per_moe_layer": used,
                "step_ms_all": times,
                **({"engine_step_ms": loop} if loop_steps else {}),
            }
        )
        log(f"  ours batch {b}: {ms:.2f} ms/step, {b / ms * 1e3:.0f} tok/s, {100 * roof_ms / ms:.0f}% of roofline")
        if replay is not None:
            log(f"    of which the graph's replay alone: {replay:.2f} ms (the rest: host inputs, sampling, read-back)")
        if loop_steps:
            log(f"    engine steps, ms each: sync {loop['sync']}, async {loop['async']}")
    for b, row in zip(batches, rows) if profile or host or timeline else ():
        seqs = fake_context(llm, b, context, seed=b)
        batch = ScheduledBatch(decodes=seqs)
        llm.engine.runner.execute(batch)
        waits = " (kernel times include waits for the kernel ahead: DEEPINFER_CUDA_PDL=0 for their own)"
        log(f"  batch {b}, profiled{waits if profile and launches_dependent(llm.backend) else ''}:")
        kernels = kernel_profile(llm, batch) if profile else None
        hosts = host_profile(llm, batch) if host else None
        lines = None
        if timeline:
            lines = {mode: engine_steps(llm, seqs, 20, mode == "async", timeline=True) for mode in ("sync", "async")}
        for s in seqs:
            llm.engine.allocator.release(s)
        row.update({"kernels": kernels} if kernels else {})
        row.update({"host_profile": hosts} if hosts else {})
        row.update({"engine_timeline": lines} if lines else {})
        if kernels and getattr(llm.config, "sparse_attention", False):
            total = sum(k["us"] for k in kernels)
            share = sum(k["us"] for k in kernels if any(w in k["kernel"].lower() for w in INDEXER_KERNELS))
            row["indexer_kernel_share"] = share / total if total else None
            log(f"    indexer kernels: {share:.0f} of {total:.0f} us of kernel time ({100 * share / total:.0f}%)")
        for mode, t in (lines or {}).items():
            log(
                f"    {mode} engine steps under the profiler, per step: device busy {t['busy_us_per_step']:.0f} us, "
                f"idle {t['idle_us_per_step']:.0f} us; longest gaps {[round(g['us']) for g in t['longest_gaps']]}"
            )
            for g in t["longest_gaps"][:4]:
                log(f"      {g['us']:.0f} us after {g['after']} before {g['before']}")
            log(f"      runtime calls (us per step): {t['runtime_us_per_step']}")
        for kind, top in (hosts or {}).items():
            log(f"  host time per step, by {kind} time (ms; calls per step):")
            for r in top[:20]:
                log(f"    {r['own_ms']:8.3f} own {r['cumulative_ms']:8.3f} all {r['calls']:7.1f}  {r['function']}")
    return rows


# ---------------------------------------------------------------------------------------------------------------
# transformers


def hf_model(path: Path, device: torch.device, implementation: str):
    """transformers' DeepseekV3ForCausalLM in bf16 on ``device`` holding the checkpoint's weights (FP8 ones
    dequantised by deepinfer's checkpoint reader; routed experts fused as transformers keeps them)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    raw = json.loads((path / "config.json").read_text())
    raw.pop("quantization_config", None)
    hf_cfg = DeepseekV3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    hf_cfg._attn_implementation = implementation
    hf_cfg._experts_implementation = implementation
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = DeepseekV3ForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(before)
    ckpt = Checkpoint.open(path)
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    with torch.no_grad():
        for name in ckpt.layout:
            w = ckpt.read(name, torch.bfloat16, device)
            w = w.dequantize(torch.bfloat16) if isinstance(w, QTensor) else w
            if ".mlp.experts." in name:
                prefix, e, proj = name.rsplit(".", 3)[0], int(name.split(".")[-3]), name.split(".")[-2]
                if proj == "down_proj":
                    params[f"{prefix}.down_proj"][e].copy_(w)
                else:
                    inter = w.shape[0]
                    rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                    params[f"{prefix}.gate_up_proj"][e, rows].copy_(w)
            else:
                params[name].copy_(w.to(params[name].dtype))
    return model


def bench_hf(path: Path, device: torch.device, batches: list[int], context: int, steps: int, impl: str) -> list[dict]:
    from transformers.cache_utils import DynamicCache

    model = hf_model(path, device, impl)
    cfg = model.config
    timer = Timer(device)
    rows = []
    for b in batches:
        try:
            cache = DynamicCache(config=cfg)
            for layer in range(cfg.num_hidden_layers):
                latent = torch.randn(b, 1, context - 1, cfg.kv_lora_rank, device=device, dtype=torch.bfloat16)
                rot = torch.randn(b, 1, context - 1, cfg.qk_rope_head_dim, device=device, dtype=torch.bfloat16)
                cache.update(latent, rot, layer)
            ids = torch.randint(2, cfg.vocab_size, (b, 1), device=device)
            pos = torch.full((b, 1), context - 1, device=device)

            def step(cache=cache, ids=ids, pos=pos):
                with torch.no_grad():
                    logits = model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True).logits
                    logits[:, -1].argmax(-1).tolist()
                cache.crop(-1)  # drop the token just added: the context stays the same

            step()
            times = [timer.time(step) for _ in range(steps)]
            ms = statistics.median(times)
            rows.append({"batch": b, "step_ms": ms, "tokens_per_s": b / ms * 1e3, "step_ms_all": times})
            log(f"  transformers batch {b}: {ms:.1f} ms/step, {b / ms * 1e3:.1f} tok/s")
        except torch.OutOfMemoryError:
            rows.append({"batch": b, "error": "out of memory"})
            log(f"  transformers batch {b}: out of memory")
        finally:
            cache = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", help="write the results here")
    p.add_argument("--backend", help="backend (default: the selected one)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--dense-layers", type=int, default=1, help="of which dense, first (default 1)")
    p.add_argument("--context", type=int, default=4096, help="tokens in the cache per sequence (default 4096)")
    p.add_argument("--batches", default="1,2,4,8,16,32,64,128,256", help="batch sizes")
    p.add_argument("--steps", type=int, default=50, help="timed decode steps per batch (median)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--kv-format", choices=("bf16", "fp8_ds_mla"), default="bf16")
    p.add_argument("--model", choices=("v3", "v32", "v4"), default="v3", help="DeepSeek-V3, V3.2 or V4-Flash shapes")
    p.add_argument(
        "--max-model-len", type=int, help="the engine's longest context (default: what the decode steps need)"
    )
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--batch-invariant", action="store_true", help="load and decode in batch-invariant mode")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--hf-steps", type=int, default=5)
    p.add_argument("--hf-batches", help="batch sizes for transformers (default: the same)")
    p.add_argument("--hf-impl", default="eager", help="transformers attention and experts implementation")
    p.add_argument("--checkpoint", help="use (or write, if missing) the checkpoint here instead of a temp dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="toy shapes on the CPU: a dry run of the script")
    p.add_argument("--profile", action="store_true", help="GPU time per kernel of one step at each batch size")
    p.add_argument("--host-profile", action="store_true", help="cProfile of 10 steps at each batch size")
    p.add_argument(
        "--engine-steps",
        type=int,
        default=0,
        help="also time this many whole engine steps (wall clock) with and without asynchronous scheduling",
    )
    p.add_argument(
        "--engine-timeline",
        action="store_true",
        help="profile 20 engine steps with and without asynchronous scheduling: device busy and idle time per step",
    )
    args = p.parse_args(argv)

    backend = args.backend or deepinfer.current_backend().name
    spec = deepinfer.registry.get().lookup(backend)
    device = torch.device("cpu" if args.tiny else spec.device_type)
    if args.model == "v4":
        config = dict(V4, num_hidden_layers=args.layers) | (TINY_V4 if args.tiny else {})
    else:
        config = dict(
            V32 if args.model == "v32" else V3, num_hidden_layers=args.layers, first_k_dense_replace=args.dense_layers
        )
        if args.tiny:
            config |= TINY | ({"index_n_heads": 8, "index_topk": 64} if args.model == "v32" else {})
    if args.model != "v3" and not args.no_hf:
        log(f"transformers is not timed for --model {args.model}")
        args.no_hf = True
    if args.tiny:
        args.context = min(args.context, 256)
    batches = [int(b) for b in args.batches.split(",")]
    hf_batches = [int(b) for b in args.hf_batches.split(",")] if args.hf_batches else batches

    path, tmp = checkpoint_path(args.checkpoint)
    try:
        if not (path / "config.json").is_file():
            log(f"writing the checkpoint to {path}")
            (write_checkpoint_v4 if args.model == "v4" else write_checkpoint)(path, config, device, args.seed)
        log(f"loading with deepinfer on {backend} ({device})")
        bandwidth = copy_bandwidth(device, (1 << 32) if device.type == "cuda" else (1 << 26))
        log(f"  copy bandwidth {bandwidth / 1e9:.0f} GB/s")
        max_batch = max(batches)
        grow = 4 * (args.engine_steps + 4) + 2 * 24 * args.engine_timeline  # tokens the engine loops add to each
        blocks = max_batch * math.ceil((args.context + grow) / 64) + 64
        if args.model == "v4":  # each sequence's state pages too
            layout = config_v4.V4Config.from_dict(config).cache_layout(64, 2, args.kv_format)
            blocks += max_batch * layout.state_pages
        # transformers first: once our profiles have run, the process's launches stay slower
        hf = [] if args.no_hf else bench_hf(path, device, hf_batches, args.context, args.hf_steps, args.hf_impl)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        with deepinfer.batch_invariant(args.batch_invariant):
            llm = LLM(
                path,
                backend,
                device=device,
                kv_format=args.kv_format,
                num_blocks=blocks,
                max_num_seqs=max_batch,
                max_model_len=args.max_model_len or args.context + grow + 64,
                enforce_eager=args.enforce_eager,
            )
            graphs = llm.engine.runner.graphs is not None
            with deepinfer.use(backend):
                ours = bench_ours(
                    llm,
                    batches,
                    args.context,
                    args.steps,
                    args.warmup,
                    bandwidth,
                    args.profile,
                    args.host_profile,
                    args.engine_steps,
                    args.engine_timeline,
                )
        del llm
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    by_batch = {r["batch"]: r for r in hf if "tokens_per_s" in r}
    print(
        f"decode at context {args.context}, {args.layers} layers, {args.kv_format} cache, backend {backend}, "
        f"CUDA graphs {'on' if graphs else 'off'}, batch-invariant {'on' if args.batch_invariant else 'off'}, "
        f"copy bandwidth {bandwidth / 1e9:.0f} GB/s"
    )
    print(
        f"{'batch':>6} {'ms/step':>9} {'tok/s':>10} {'roofline tok/s':>15} {'% roofline':>11} "
        f"{'transformers tok/s':>19} {'speed-up':>9}"
    )
    for r in ours:
        h = by_batch.get(r["batch"])
        r["transformers_tokens_per_s"] = h["tokens_per_s"] if h else None
        r["speedup_vs_transformers"] = r["tokens_per_s"] / h["tokens_per_s"] if h else None
        hf_txt = f"{h['tokens_per_s']:.1f}" if h else "-"
        up = f"{r['speedup_vs_transformers']:.1f}x" if h else "-"
        print(
            f"{r['batch']:>6} {r['step_ms']:>9.2f} {r['tokens_per_s']:>10.0f} {r['roofline_tokens_per_s']:>15.0f} "
            f"{r['roofline_pct']:>10.0f}% {hf_txt:>19} {up:>9}"
        )
    result = {
        "config": config,
        "backend": backend,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "context": args.context,
        "model": args.model,
        "kv_format": args.kv_format,
        "cuda_graphs": graphs,
        "batch_invariant": args.batch_invariant,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "ours": ours,
        "transformers": hf,
        "transformers_impl": args.hf_impl,
        "tiny_dry_run": args.tiny,
        "targets": {"speedup_at_batch_64": 10.0, "roofline_pct_at_batch_1": 50.0},
    }
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"written to {args.json}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
