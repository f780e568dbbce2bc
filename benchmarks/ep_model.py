"""The model with its routed experts sharded over the ranks of a torchrun launch, against one process holding all.

    torchrun --nproc-per-node 2 benchmarks/ep_model.py ep_model.json --backend cuda_sm100   # NCCL, a GPU per rank
    torchrun --nproc-per-node 2 benchmarks/ep_model.py ep_model.json --tiny                # Gloo on the CPU, toy shapes

1. Rank 0 writes a DeepSeek-V3-shaped FP8 checkpoint cut to ``--layers`` layers (``bench_model.py``'s writer:
   full widths, 256 routed experts, random weights; ``--tiny``: toy widths, 16 experts).
2. Every rank loads it with ``LLM(path, backend, ep=world)`` on its own device and generates greedily from
   ``--prompts`` random token-id prompts of 16 to 128 tokens, ``--max-tokens`` each, with log-probabilities, in two
   settings:
   - ``invariant_eager``: batch-invariant mode, no CUDA graphs, so every step dispatches in normal mode, whose
     combine adds each token's products in the one-process order: tokens and log-probabilities must be bitwise
     those of one process;
   - ``default``: the engine as it ships (CUDA graphs on CUDA, decode steps in low-latency mode; the combines of
     both modes add per-rank fp32 partial sums): reports how many sequences match one process token for token, the
     first step where each one that does not diverges, and the largest log-probability difference before it.
   Each setting generates twice; the second, timed by the host clock, gives generated tokens per second.
3. The group's LLMs are dropped; rank 0 then does the same with ``LLM(path, backend)`` holding every expert.

Rank 0 prints a summary and writes every number to the JSON path; the exit status is 1 when the
``invariant_eager`` setting is not bitwise equal.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from bench_model import TINY, V3, log, write_checkpoint

import deepinfer
from deepinfer.model import LLM, SamplingParams
from deepinfer.model.parallel import init_from_torchrun

SETTINGS = {"invariant_eager": dict(invariant=True, eager=True), "default": dict(invariant=False, eager=False)}


def prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 129, (count,), generator=g).tolist()
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def run(path: Path, backend: str, device, ep: int | None, args, vocab: int) -> dict:
    """Both settings with one ``LLM`` each: per setting, the tokens, log-probabilities and generated tokens/s."""
    ps = prompts(vocab, args.prompts, args.seed)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    out = {}
    for name, s in SETTINGS.items():
        llm = LLM(path, backend, device=device, ep=ep, progress=False, enforce_eager=s["eager"],
                  max_num_seqs=args.prompts, max_model_len=256)  # fmt: skip
        with deepinfer.batch_invariant(s["invariant"]):
            llm.generate(ps, params)  # warm-up: compilation, graph capture
            t = time.perf_counter()
            outs = llm.generate(ps, params)
            seconds = time.perf_counter() - t
        out[name] = {
            "tokens": [o.outputs[0].token_ids for o in outs],
            "logprobs": [o.outputs[0].logprobs for o in outs],
            "generated_tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / seconds,
            "cuda_graphs": llm.engine.runner.graphs is not None,
        }
        llm.engine.drop_cuda_graphs()  # they hold captured collectives, which destroying the group would wait for
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def compare(sharded: dict, single: dict) -> dict:
    """Token-for-token agreement of each sequence; where it breaks, the step, and the largest log-probability
    difference over the steps before."""
    seqs = []
    for ta, tb, la, lb in zip(sharded["tokens"], single["tokens"], sharded["logprobs"], single["logprobs"]):
        first = next((i for i, (a, b) in enumerate(zip(ta, tb)) if a != b), None)
        upto = len(ta) if first is None else first
        diff = max((abs(a - b) for a, b in zip(la[:upto], lb[:upto])), default=0.0)
        seqs.append({"first_divergent_step": first, "max_logprob_diff_before": diff})
    return {
        "sequences_equal": sum(s["first_divergent_step"] is None for s in seqs),
        "sequences": len(seqs),
        "bitwise_equal": sharded["tokens"] == single["tokens"] and sharded["logprobs"] == single["logprobs"],
        "max_logprob_diff": max(s["max_logprob_diff_before"] for s in seqs),
        "divergent_steps": [s["first_divergent_step"] for s in seqs if s["first_divergent_step"] is not None],
        "speedup_tokens_per_s": sharded["generated_tokens_per_s"] / single["generated_tokens_per_s"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", help="rank 0 writes the results here")
    p.add_argument("--backend", help="backend (default: the selected one; --tiny: reference)")
    p.add_argument("--layers", type=int, default=3, help="decoder layers (default 3)")
    p.add_argument("--dense-layers", type=int, default=1, help="of which dense, first (default 1)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="process-group timeout, seconds")
    p.add_argument("--tiny", action="store_true", help="toy shapes on the CPU (Gloo)")
    args = p.parse_args(argv)

    backend = args.backend or ("reference" if args.tiny else deepinfer.current_backend().name)
    spec = deepinfer.registry.get().lookup(backend)
    device_type = "cpu" if args.tiny else spec.device_type
    dist_backend = None if args.tiny else spec.dist_backend
    launch = init_from_torchrun(None, device_type=device_type, dist_backend=dist_backend, timeout_s=args.timeout)
    if launch is None:
        raise SystemExit("run under torchrun with at least 2 processes")
    rank, world = launch.rank, launch.world_size
    config = dict(V3, num_hidden_layers=args.layers, first_k_dense_replace=args.dense_layers)
    if args.tiny:
        config |= TINY

    tmp = [tempfile.mkdtemp(prefix="deepinfer-ep-") if rank == 0 else None]
    dist.broadcast_object_list(tmp, 0)  # one host: every rank reads rank 0's files
    path = Path(tmp[0]) / "ckpt"
    try:
        if rank == 0:
            log(f"writing the checkpoint to {path}")
            write_checkpoint(path, config, launch.device, args.seed)
        dist.barrier()
        log(f"rank {rank}: experts over {world} ranks on {launch.device}")
        sharded = run(path, backend, launch.device, world, args, config["vocab_size"])
        if rank == 0:
            log("rank 0: one process holding every expert")
            single = run(path, backend, launch.device, None, args, config["vocab_size"])
        dist.barrier()
    finally:
        if rank == 0:
            shutil.rmtree(tmp[0], ignore_errors=True)
        launch.close()
    if rank != 0:
        return 0

    result = {
        "backend": backend,
        "device": torch.cuda.get_device_name(launch.device) if launch.device.type == "cuda" else "cpu",
        "world_size": world,
        "layers": args.layers,
        "dense_layers": args.dense_layers,
        "tiny_dry_run": args.tiny,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "settings": {},
    }
    for name in SETTINGS:
        c = compare(sharded[name], single[name])
        result["settings"][name] = {"ep": sharded[name], "single": single[name], "comparison": c}
        print(
            f"{name}: {c['sequences_equal']}/{c['sequences']} sequences equal token for token, bitwise "
            f"{c['bitwise_equal']}, max |logprob diff| {c['max_logprob_diff']:.3g}, divergent at steps "
            f"{c['divergent_steps']}; generated tokens/s EP={world} {sharded[name]['generated_tokens_per_s']:.1f} "
            f"vs one process {single[name]['generated_tokens_per_s']:.1f} (graphs {sharded[name]['cuda_graphs']})"
        )
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"written to {args.json}")
    return 0 if result["settings"]["invariant_eager"]["comparison"]["bitwise_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
