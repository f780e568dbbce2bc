"""What structured output costs: compiling a constraint, handing a request its matcher, and per step, filling the
bitmasks of a batch of constrained requests on the host and applying them on the device, against the decode step
they ride on.

    python benchmarks/bench_structured_output.py [--backend cuda_sm100] [--batch 64] [--steps 32] [--runs 3]
        [--json OUT]

On the embedded model: (1) each constraint kind compiled once (llguidance against the checkpoint's tokenizer), then
a request's matcher taken from the cache (a copy of the compiled one); the same for a large JSON schema (60
properties, nested objects and arrays), the case where compiling costs most; (2) ``--batch`` requests
mid-generation, their matchers advanced along real constrained outputs: the host time to fill all their masks
(``allowed_tokens``) and the device time of ``ops.apply_token_bitmask`` on ``[batch, vocab]`` fp32 logits (median
of ``--steps``); (3) whole decode steps, the engine's own loop, time divided by the engine's real step count: the
batch unconstrained, all of it constrained (JSON), and mixed (one request under a constraint that lasts the whole
run, the others free), which shows what a constrained request costs its unconstrained neighbours.
"""

from __future__ import annotations

import argparse
import json
import random
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
# a constraint no request completes within the run's 48 tokens: the mixed batch's constrained request lasts throughout
ENDLESS = StructuredOutputsParams(regex="[a-z_ ]{400}")
PROMPT = "def describe(path):\n    return "
MAX_TOKENS = 48


def large_schema(seed: int) -> dict:
    """60 properties of mixed types, nested objects and arrays of objects, names drawn from ``seed``."""
    rng = random.Random(seed)
    leaf = [
        {"type": "integer", "minimum": 0, "maximum": 10**6},
        {"type": "string", "maxLength": 32, "pattern": "^[a-z][a-z0-9_]*$"},
        {"enum": [f"v{i}" for i in range(12)]},
        {"type": "number"},
        {"type": "boolean"},
    ]
    item = {"type": "object", "properties": {f"f{i}": leaf[i % 5] for i in range(6)}, "required": ["f0", "f1"]}
    kinds = [*leaf, {"type": "array", "items": item, "maxItems": 8}, item]
    props = {f"p{rng.randrange(10**6)}_{i}": kinds[i % len(kinds)] for i in range(60)}
    return {"type": "object", "properties": props, "required": list(props)[:30], "additionalProperties": False}


def timed(fn, sync) -> float:
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def step_ms(llm: LLM, prompts: list[str], configs: dict[str, list[SamplingParams]], runs: int, sync) -> dict:
    """Per configuration, the median over ``runs`` of the wall time of a ``generate`` divided by the engine steps it
    took; the configurations take turns, run by run, so a machine's changing load falls on all of them alike."""
    for params in configs.values():
        llm.generate(prompts, params)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in configs}
    steps: dict[str, list[int]] = {name: [] for name in configs}
    for _ in range(runs):
        for name, params in configs.items():
            steps0 = llm.engine.stats["steps"]
            start = time.perf_counter()
            llm.generate(prompts, params)
            sync()
            n = llm.engine.stats["steps"] - steps0
            times[name].append((time.perf_counter() - start) / n)
            steps[name].append(n)
    return {name: {"step_ms": 1e3 * statistics.median(times[name]), "steps": steps[name]} for name in configs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32, help="repeats of the mask fill and apply timings")
    ap.add_argument("--runs", type=int, default=3, help="generate calls timed per whole-step configuration")
    ap.add_argument("--threads", type=int, default=1, help="torch's CPU threads, when the model runs on the CPU")
    ap.add_argument("--json")
    args = ap.parse_args()
    llm = LLM(backend=args.backend, max_num_seqs=args.batch, progress=False)
    device = llm.device
    if device.type == "cpu":  # a small model steps fastest, and steadiest on a shared machine, on few threads
        torch.set_num_threads(args.threads)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    report: dict = {
        "backend": llm.backend,
        "device": str(device),
        "batch": args.batch,
        "threads": torch.get_num_threads(),
    }

    def matcher_ms(so: StructuredOutputsParams) -> float:
        return 1e3 * timed(lambda: llm._matcher(SamplingParams(structured_outputs=so)), lambda: None)

    report["tokenizer_load_ms"] = matcher_ms(StructuredOutputsParams(regex="[0-9]"))  # the grammar engine's setup
    compile_ms = {}
    for kind, so in CONSTRAINTS.items():
        compile_ms[kind] = {"first_ms": matcher_ms(so), "cached_ms": matcher_ms(so)}
    big = [StructuredOutputsParams(json=large_schema(seed)) for seed in range(3)]
    firsts = [matcher_ms(so) for so in big]  # three different schemas of the same size: three compiles
    cached = [matcher_ms(big[0]) for _ in range(args.steps)]
    compile_ms["large_json"] = {"first_ms": statistics.median(firsts), "cached_ms": statistics.median(cached)}
    report["compile"] = compile_ms

    # Matchers mid-generation: each advanced along a real constrained completion (JSON, the heaviest kind).
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i, structured_outputs=CONSTRAINTS["json"])
        for i in range(args.batch)
    ]
    prompts = [PROMPT] * args.batch
    outs = llm.generate(prompts, params)
    matchers = []
    for i, out in enumerate(outs):
        m = llm._matcher(params[i])
        ids = out.outputs[0].token_ids
        m.consume_tokens(ids[: max(1, len(ids) // 2)])
        matchers.append((m, []))
    vocab = llm.config.vocab_size
    pin = device.type != "cpu"
    fill = [timed(lambda: allowed_tokens(matchers, vocab, pin=pin), lambda: None) for _ in range(args.steps)]
    mask = allowed_tokens(matchers, vocab).to(device)
    logits = torch.randn(args.batch, vocab, device=device)
    with deepinfer.value_checks(False):
        ops.apply_token_bitmask(logits, mask)  # warm-up
        apply = [timed(lambda: ops.apply_token_bitmask(logits, mask), sync) for _ in range(args.steps)]
    report["mask_fill_ms"] = 1e3 * statistics.median(fill)
    report["mask_apply_ms"] = 1e3 * statistics.median(apply)

    # Whole steps: the same batch free, all constrained, and one constrained among free neighbours.
    free = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i, ignore_eos=True) for i in range(args.batch)]
    endless = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=0, structured_outputs=ENDLESS)
    configs = {"free": free, "json": params, "mixed": [endless, *free[1:]]}
    report["steps"] = step_ms(llm, prompts, configs, args.runs, sync)
    print(json.dumps(report, indent=1))
    c, s = report["compile"]["large_json"], report["steps"]
    print(
        f"batch {args.batch}: large JSON schema compiled in {c['first_ms']:.1f} ms, {c['cached_ms']:.3f} ms from the "
        f"cache; mask fill {report['mask_fill_ms']:.3f} ms (host), apply {report['mask_apply_ms']:.3f} ms (device); "
        f"a step {s['free']['step_ms']:.3f} ms free, {s['json']['step_ms']:.3f} ms all constrained (JSON), "
        f"{s['mixed']['step_ms']:.3f} ms with 1 constrained + {args.batch - 1} free"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
