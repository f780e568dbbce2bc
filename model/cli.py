"""``deepinfer generate``: generation from the command line (the parser lives in ``deepinfer.cli``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape

from .errors import RequestError
from .llm import LLM
from .sampling_params import SamplingParams

DEFAULT_PROMPT = "The capital of France is"
SMALL_HIDDEN = 1024


def read_prompts(args: argparse.Namespace) -> list[str | list[int]]:
    """``--prompt`` values, then the lines of ``--batch`` (a JSON list of ints is a token-id prompt)."""
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
    return prompts or [DEFAULT_PROMPT]


def generate(args: argparse.Namespace, console: Console) -> int:
    """Runs the prompts, prints each completion and a tokens/s summary."""
    prompts = read_prompts(args)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    llm = LLM(args.model, args.backend, dtype=args.dtype, kv_format=args.kv_format, max_num_seqs=args.max_num_seqs)
    if llm.device.type == "cpu" and llm.config.hidden_size <= SMALL_HIDDEN:
        torch.set_num_threads(1)  # small matrices gain nothing from more threads and lose much when cores are busy
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        shown = prompt if isinstance(prompt, str) else f"{prompt}"
        console.print(f"[bold]{escape(shown)}[/bold]", end="")
        if llm.tokenizer is not None:
            console.print(escape(completion.text), highlight=False)
        else:
            console.print(f" -> {completion.token_ids}", highlight=False)
    s = llm.last_stats
    secs = max(s["seconds"], 1e-9)
    console.print(
        f"[dim]{s['requests']} request(s), {s['prompt_tokens']} prompt + {s['generated_tokens']} generated tokens in "
        f"{secs:.2f} s: {s['generated_tokens'] / secs:.1f} generated tokens/s, "
        f"{(s['prompt_tokens'] + s['generated_tokens']) / secs:.1f} tokens/s in all "
        f"(backend {llm.backend}, {llm.path})"
    )
    return 0
