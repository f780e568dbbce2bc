"""``deepinfer generate``: generation from the command line (the parser lives in ``deepinfer.cli``).

``--ep N`` shards the routed experts over the N processes of a torchrun launch
(``torchrun --nproc-per-node N -m deepinfer generate ... --ep N``): each process joins the default process group
(Gloo on the CPU, NCCL on CUDA, one device per local rank), loads its experts, and runs the same prompts; rank 0
prints the completions.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape

import deepinfer
from deepinfer.selection import require

from .errors import RequestError
from .llm import LLM
from .parallel import init_from_torchrun
from .sampling_params import SamplingParams
from .structured_output import StructuredOutputsParams

DEFAULT_PROMPT = "The capital of France is"
SMALL_HIDDEN = 1024


def read_prompts(args: argparse.Namespace) -> list[str | list[int]]:
    """``--prompt`` values, then the non-blank lines of ``--batch`` (a JSON list of ints is a token-id prompt);
    ``DEFAULT_PROMPT`` when neither flag is given. A ``--batch`` file with no prompt, and no ``--prompt`` beside
    it, is a ``RequestError`` (not the default prompt in its place)."""
    prompts: list[str | list[int]] = list(args.prompt or [])
    if args.batch:
        try:
            lines = Path(args.batch).read_text().splitlines()
        except OSError as e:
            raise RequestError(f"--batch {args.batch}: {e}") from e
        for line in lines:
            if not line.strip():
                continue
            if line.lstrip().startswith("["):
                try:
                    ids = json.loads(line)
                except ValueError:
                    ids = None
                if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
                    prompts.append(ids)
                    continue
            prompts.append(line)
        if not prompts:
            raise RequestError(f"--batch {args.batch}: expected a file of prompts, one per line, got no prompt in it")
    return prompts or [DEFAULT_PROMPT]


def _backend_spec(backend: str | None):
    if backend is None:
        return deepinfer.current_backend()
    return require(backend, f"--backend {backend}")


def generate(args: argparse.Namespace, console: Console) -> int:
    """Runs the prompts, prints each completion and a tokens/s summary (on rank 0 under ``--ep``)."""
    prompts = read_prompts(args)
    constraint = {
        name: value
        for name, value in (
            ("json", getattr(args, "json_schema", None)),
            ("regex", getattr(args, "regex", None)),
            ("grammar", getattr(args, "grammar", None)),
            ("choice", getattr(args, "choice", None)),
        )
        if value is not None
    }
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        structured_outputs=StructuredOutputsParams(**constraint) if constraint else None,
    )
    ep = getattr(args, "ep", None)
    spec = _backend_spec(args.backend)
    launch = init_from_torchrun(
        ep,
        device_type=spec.device_type,
        dist_backend=spec.dist_backend,
        timeout_s=getattr(args, "dist_timeout", 600.0),
    )
    try:
        code = _generate(args, console, prompts, params, launch)
    except BaseException:
        if launch is not None:
            launch.close()
        raise
    if launch is not None:
        launch.close(barrier=True)
        _leave(code)
    return code


def _leave(code: int) -> None:
    """Ends a torchrun rank whose run is done and whose process group is destroyed, without the interpreter's
    finalisation: Gloo's worker threads can still hold tensors then, and releasing them while the interpreter is torn
    down aborts the process ("terminate called without an active exception") after a run that ended well."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _generate(args, console: Console, prompts: list, params: SamplingParams, launch) -> int:
    llm = LLM(
        args.model,
        args.backend,
        dtype=args.dtype,
        kv_format=args.kv_format,
        max_num_seqs=args.max_num_seqs,
        max_model_len=getattr(args, "max_model_len", None),
        enable_prefix_caching=getattr(args, "enable_prefix_caching", True),
        host_cache_gb=getattr(args, "host_cache_gb", 0.0),
        device=None if launch is None else launch.device,
        progress=launch is None or launch.rank == 0,
        ep=None if launch is None else launch.world_size,
        speculative_config=getattr(args, "speculative_config", None),
        num_redundant_experts=getattr(args, "num_redundant_experts", 0),
        enable_eplb=getattr(args, "enable_eplb", False),
        eplb_step_interval=getattr(args, "eplb_step_interval", 3000),
        eplb_window_size=getattr(args, "eplb_window_size", 1000),
        eplb_rebalance_layers_per_chunk=getattr(args, "eplb_rebalance_layers_per_chunk", 1),
    )
    if llm.tokenizer is None and any(isinstance(p, str) for p in prompts):  # the LLM's error names no flag
        raise RequestError(
            f"text prompts need a tokenizer.json in {llm.path}; give token ids as lines of a --batch file, each a "
            "JSON list of ints (--prompt is always text)"
        )
    if llm.device.type == "cpu" and llm.config.hidden_size <= SMALL_HIDDEN:
        torch.set_num_threads(1)  # small matrices gain nothing from more threads and lose much when cores are busy
    try:
        outputs = llm.generate(prompts, params)
    finally:
        if launch is not None:  # the process group is destroyed next; it would wait for graphs holding collectives
            llm.engine.drop_cuda_graphs()
    if llm.ep.rank != 0:
        return 0
    stopped = {"the context length": 0, "the cache's capacity": 0}  # before --max-tokens
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        shown = prompt if isinstance(prompt, str) else f"{prompt}"
        console.print(f"[bold]{escape(shown)}[/bold]", end="")
        if llm.tokenizer is not None:
            console.print(escape(completion.text), highlight=False)
        else:
            console.print(f" -> {completion.token_ids}", highlight=False)
        n, why = len(completion.token_ids), ""
        if completion.finish_reason == "length" and n < params.max_tokens:
            full = len(out.prompt_token_ids) + n >= llm.max_model_len
            limit = "the context length" if full else "the cache's capacity"
            stopped[limit] += 1
            why = f" at {limit}"
        console.print(f"[dim]\\[finish reason: {completion.finish_reason}{why}, {n} tokens][/dim]", highlight=False)
    for limit, count in stopped.items():
        if count:
            size = f" ({llm.max_model_len} tokens, prompt included)" if limit == "the context length" else ""
            console.print(
                f"note: {count} request(s) stopped at {limit}{size} before --max-tokens {params.max_tokens}",
                highlight=False,
                soft_wrap=True,
            )
    s = llm.last_stats
    secs = max(s["seconds"], 1e-9)
    console.print(
        f"[dim]{s['requests']} request(s), {s['prompt_tokens']} prompt + {s['generated_tokens']} generated tokens in "
        f"{secs:.2f} s: {s['generated_tokens'] / secs:.1f} generated tokens/s, "
        f"{(s['prompt_tokens'] + s['generated_tokens']) / secs:.1f} tokens/s in all "
        f"(backend {llm.backend}{_ep_note(llm)}, {llm.path})"
    )
    if s["cached_prompt_tokens"]:
        console.print(
            f"[dim]prefix cache: {s['cached_prompt_tokens']} of {s['prompt_tokens']} prompt tokens found "
            f"({s['cached_prompt_tokens'] / max(s['prompt_tokens'], 1):.0%}), {s['prefilled_tokens']} prefilled"
        )
    if "host_cache" in s:
        h = s["host_cache"]
        console.print(
            f"[dim]host cache: {h['held_pages']} of {h['capacity_pages']} pages held; {h['saved_pages']} copied out, "
            f"{h['loaded_pages']} copied back (totals of this process)"
        )
    if "speculative" in s:
        d = s["speculative"]
        console.print(
            f"[dim]speculative decoding: {d['drafted']} drafts verified, {d['accepted']} accepted "
            f"({100 * d['acceptance_rate']:.1f}%), mean accepted length {d['mean_accepted_length']:.2f}[/dim]",
            highlight=False,
        )
    return 0


def _ep_note(llm: LLM) -> str:
    n = llm.ep.world_size
    return f", experts over {n} ranks" if n > 1 else ""
