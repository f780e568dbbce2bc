"""Prefix caching on a DeepSeek-V3-shaped FP8 checkpoint cut to a few layers (GPU; ``--tiny`` on the CPU): time to
first token with a cache hit against a miss, and a shared prefix across many requests prefilled once.

    python benchmarks/prefix_cache.py results.json [--backend cuda_sm100] [--layers 3] [--prefix 4096] [--requests 64]

1. Writes the checkpoint as ``bench_model.py`` does (DeepSeek-V3's full shapes, ``--layers`` layers, random FP8
   weights).
2. Time to first token, one request alone (wall clock of ``LLM.generate`` with ``max_tokens=1``, median of
   ``--repeats``): a miss is a prompt of ``--prefix`` random tokens plus ``--suffix`` more that the engine has never
   seen; a hit is the same prompt again (every whole prefill chunk before its last token is found). The hit's first
   tokens and log-probabilities are checked against the miss's, bit for bit.
3. The same from the host tier (``host_cache_gb``): a prompt whose pages were pushed out of a small device cache
   into host memory comes again; checked bit for bit against its miss.
4. ``--requests`` prompts sharing the ``--prefix`` tokens (each with its own ``--suffix``), submitted together with
   caching on and then off (a second engine): prompt tokens prefilled (``last_stats``), wall time, and whether the
   outputs are the same.

Prints the figures and writes them to the JSON path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model

import deepinfer
from deepinfer.model import LLM, SamplingParams


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def random_tokens(n: int, vocab: int, gen: torch.Generator) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=gen).tolist()


def timed(llm: LLM, prompts, params: SamplingParams):
    if llm.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = llm.generate(prompts, params, progress=False)
    return time.perf_counter() - start, out


def same(a, b) -> bool:
    return all(
        x.outputs[0].token_ids == y.outputs[0].token_ids and x.outputs[0].logprobs == y.outputs[0].logprobs
        for x, y in zip(a, b, strict=True)
    )


def host_tier_hits(path, backend, common, args, vocab, gen, one) -> dict:
    """Time to first token when the prefix comes back from the host tier: a device cache of room for two prompts and
    a host tier of ``--host-cache-gb``; each prompt (a miss) is followed by two others that push its pages out
    to host memory, then comes again (a hit on the host tier, checked bit for bit against its miss)."""
    context = args.prefix + args.suffix + 16
    pages = context // 64 + 1
    kw = dict(common, num_blocks=2 * pages + 2)
    llm = LLM(path, backend, enable_prefix_caching=True, host_cache_gb=args.host_cache_gb, **kw)
    host = llm.engine.allocator.host
    page_bytes = host.page_bytes(host.caches)
    assert host.capacity >= (args.repeats + 2) * pages, "--host-cache-gb holds too few pages for the run"
    fill = lambda: timed(llm, random_tokens(args.prefix + args.suffix, vocab, gen), one)
    fill(), fill()
    misses, hits, bitwise, loaded = [], [], True, 0
    for _ in range(args.repeats):
        prompt = random_tokens(args.prefix + args.suffix, vocab, gen)
        t_miss, miss = timed(llm, prompt, one)
        fill(), fill()
        before = llm.last_stats["host_cache"]["loaded_pages"]
        t_hit, hit = timed(llm, prompt, one)
        loaded = llm.last_stats["host_cache"]["loaded_pages"] - before
        assert miss[0].num_cached_tokens == 0 and hit[0].num_cached_tokens > 0 and loaded > 0
        misses.append(t_miss)
        hits.append(t_hit)
        bitwise &= same(miss, hit)
    return {
        "ttft_miss_ms": 1e3 * statistics.median(misses),
        "ttft_host_hit_ms": 1e3 * statistics.median(hits),
        "pages_loaded_per_hit": loaded,
        "bytes_loaded_per_hit": loaded * page_bytes,
        "hit_cached_tokens": hit[0].num_cached_tokens,
        "host_hit_equals_miss_bitwise": bitwise,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", help="write the results here")
    p.add_argument("--backend", help="backend (default: the selected one)")
    p.add_argument("--layers", type=int, default=3, help="decoder layers (default 3, the first dense)")
    p.add_argument("--prefix", type=int, default=4096, help="shared prefix tokens (default 4096)")
    p.add_argument("--suffix", type=int, default=64, help="tokens after it, per request (default 64)")
    p.add_argument("--requests", type=int, default=64, help="requests sharing the prefix (default 64)")
    p.add_argument("--chunk", type=int, default=1024, help="prefill chunk size (default 1024)")
    p.add_argument("--repeats", type=int, default=5, help="timed hits and misses (median; default 5)")
    p.add_argument("--checkpoint", help="use (or write, if missing) the checkpoint here instead of a temp dir")
    p.add_argument("--host-cache-gb", type=float, default=1.0, help="the host tier's size (default 1)")
    p.add_argument("--no-host-tier", action="store_true", help="skip the host tier's time to first token")
    p.add_argument("--tiny", action="store_true", help="toy shapes on the CPU: a dry run of the script")
    args = p.parse_args(argv)

    backend = args.backend or deepinfer.current_backend().name
    spec = deepinfer.registry.get().lookup(backend)
    device = torch.device("cpu" if args.tiny else spec.device_type)
    config = dict(bench_model.V3, num_hidden_layers=args.layers, first_k_dense_replace=1)
    if args.tiny:
        config |= bench_model.TINY
        args.prefix, args.suffix, args.requests, args.chunk = 256, 16, 8, 64
    path = Path(args.checkpoint) if args.checkpoint else Path(tempfile.mkdtemp(prefix="deepinfer-pc-")) / "ckpt"
    if not (path / "config.json").is_file():
        log(f"writing the checkpoint to {path}")
        bench_model.write_checkpoint(path, config, device, seed=0)
    context = args.prefix + args.suffix + 16
    common = dict(
        device=device,
        prefill_chunk_size=args.chunk,
        max_num_batched_tokens=max(4096, args.chunk),
        max_model_len=context,
        max_num_seqs=args.requests,
        num_blocks=(args.requests + 2 * args.repeats + 4) * (context // 64 + 1),
        progress=False,
    )
    vocab = config["vocab_size"]
    gen = torch.Generator().manual_seed(1)
    one = SamplingParams(max_tokens=1, temperature=0, logprobs=0)
    result: dict = {
        "backend": backend,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "layers": args.layers,
        "prefix": args.prefix,
        "suffix": args.suffix,
        "chunk": args.chunk,
    }

    log("loading (caching on)")
    on = LLM(path, backend, enable_prefix_caching=True, **common)
    timed(on, random_tokens(args.prefix + args.suffix, vocab, gen), one)  # warm-up: first launches, compilation
    timed(on, random_tokens(args.prefix + args.suffix, vocab, gen), one)
    misses, hits, bitwise = [], [], True
    for _ in range(args.repeats):
        prompt = random_tokens(args.prefix + args.suffix, vocab, gen)
        t_miss, miss = timed(on, prompt, one)
        t_hit, hit = timed(on, prompt, one)
        assert miss[0].num_cached_tokens == 0 and hit[0].num_cached_tokens > 0
        misses.append(t_miss)
        hits.append(t_hit)
        bitwise &= same(miss, hit)
    result["ttft_miss_ms"] = 1e3 * statistics.median(misses)
    result["ttft_hit_ms"] = 1e3 * statistics.median(hits)
    result["hit_cached_tokens"] = hit[0].num_cached_tokens
    result["hit_equals_miss_bitwise"] = bitwise
    log(
        f"TTFT, {args.prefix}+{args.suffix} tokens alone: miss {result['ttft_miss_ms']:.1f} ms, hit "
        f"{result['ttft_hit_ms']:.1f} ms ({result['hit_cached_tokens']} tokens found), same bits: {bitwise}"
    )

    shared = random_tokens(args.prefix, vocab, gen)
    prompts = [shared + random_tokens(args.suffix, vocab, gen) for _ in range(args.requests)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    t_on, out_on = timed(on, prompts, params)
    stats_on = dict(on.last_stats)
    del on
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.no_host_tier:  # between the two engines of the shared-prefix run: one model in memory at a time
        result["host_tier"] = host_tier_hits(path, backend, common, args, vocab, gen, one)
        log(json.dumps(result["host_tier"]))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    log("loading (caching off)")
    off = LLM(path, backend, enable_prefix_caching=False, **common)
    timed(off, random_tokens(args.prefix + args.suffix, vocab, gen), one)
    t_off, out_off = timed(off, prompts, params)
    result["shared"] = {
        "requests": args.requests,
        "prefilled_tokens_on": stats_on["prefilled_tokens"],
        "prefilled_tokens_off": off.last_stats["prefilled_tokens"],
        "cached_prompt_tokens_on": stats_on["cached_prompt_tokens"],
        "seconds_on": t_on,
        "seconds_off": t_off,
        "tokens_equal": all(x.outputs[0].token_ids == y.outputs[0].token_ids for x, y in zip(out_on, out_off)),
        "bitwise_equal": same(out_on, out_off),
    }
    log(json.dumps(result["shared"]))
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
