"""What structured output costs: compiling a constraint, and per step, filling the bitmasks of a batch of
constrained requests on the host and applying them on the device, against the decode step they ride on.

    python benchmarks/bench_structured_output.py [--backend cuda_sm100] [--batch 64] [--steps 32] [--json OUT]

On the embedded model: (1) each constraint kind compiled once (llguidance against the checkpoint's tokenizer; a
second compile of the same constraint hits the cache); (2) ``--batch`` requests mid-generation, their matchers
advanced along real constrained outputs: the host time to fill all their masks (``allowed_tokens``) and the device
time of ``ops.apply_token_bitmask`` on ``[batch, vocab]`` fp32 logits (median of ``--steps``); (3) a whole decode
step of ``--batch`` constrained requests against the same batch unconstrained (generated tokens per second, the
engine's own loop), so the mask's share of a step is measured, not estimated.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import deepinfer
from deepinfer import ops
from deepinfer.model import LLM, SamplingParams
from deepinfer.model.structured_output import StructuredOutputsParams, allowed_tokens

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "size": {"type": "integer", "minimum": 0},
        "kind": {"enum": ["file", "dir", "link"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["name", "size", "kind", "tags"],
}
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "regex": StructuredOutputsParams(regex=r"(0|[1-9][0-9]{0,5})\.[0-9]{2} (KB|MB|GB)"),
    "grammar": StructuredOutputsParams(grammar='start: call\ncall: NAME "(" (NAME ("," NAME)*)? ")"\nNAME: /[a-z_]+/'),
    "choice": StructuredOutputsParams(choice=["True", "False", "None"]),
}


def timed(fn, sync) -> float:
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--json")
    args = ap.parse_args()
    llm = LLM(backend=args.backend, max_num_seqs=args.batch, progress=False)
    device = llm.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    report: dict = {"backend": llm.backend, "batch": args.batch}

    compile_ms = {}
    for kind, so in CONSTRAINTS.items():
        first = timed(lambda so=so: llm._matcher(SamplingParams(structured_outputs=so)), lambda: None)
        again = timed(lambda so=so: llm._matcher(SamplingParams(structured_outputs=so)), lambda: None)
        compile_ms[kind] = {"first_ms": 1e3 * first, "cached_ms": 1e3 * again}
    report["compile"] = compile_ms

    # Matchers mid-generation: each advanced along a real constrained completion (JSON, the heaviest kind).
    params = [
        SamplingParams(max_tokens=48, temperature=1.0, seed=i, structured_outputs=CONSTRAINTS["json"])
        for i in range(args.batch)
    ]
    outs = llm.generate(["def describe(path):\n    return "] * args.batch, params)
    matchers = []
    for i, out in enumerate(outs):
        m = llm._matcher(params[i])
        ids = out.outputs[0].token_ids
        m.consume_tokens(ids[: max(1, len(ids) // 2)])
        matchers.append((m, []))
    vocab = llm.config.vocab_size
    fill = [timed(lambda: allowed_tokens(matchers, vocab), lambda: None) for _ in range(args.steps)]
    mask = allowed_tokens(matchers, vocab).to(device)
    logits = torch.randn(args.batch, vocab, device=device)
    with deepinfer.value_checks(False):
        ops.apply_token_bitmask(logits, mask)  # warm-up
        apply = [timed(lambda: ops.apply_token_bitmask(logits, mask), sync) for _ in range(args.steps)]
    report["mask_fill_ms"] = 1e3 * statistics.median(fill)
    report["mask_apply_ms"] = 1e3 * statistics.median(apply)

    # Whole steps: the same batch constrained and free, generated tokens per second.
    free = [SamplingParams(max_tokens=48, temperature=1.0, seed=i, ignore_eos=True) for i in range(args.batch)]
    prompts = ["def describe(path):\n    return "] * args.batch
    rates = {}
    for name, ps in (("free", free), ("json", params)):
        llm.generate(prompts, ps)
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            o = llm.generate(prompts, ps)
            sync()
            steps = llm.last_stats["generated_tokens"] / args.batch
            runs.append((time.perf_counter() - start) / steps)
            del o
        rates[name] = 1e3 * statistics.median(runs)
    report["step_ms"] = rates
    print(json.dumps(report, indent=1))
    print(
        f"batch {args.batch}: mask fill {report['mask_fill_ms']:.3f} ms (host), apply {report['mask_apply_ms']:.3f} ms "
        f"(device); a step {rates['free']:.3f} ms free, {rates['json']:.3f} ms constrained (JSON)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
