"""Speculative decoding with the MTP layer against plain decoding: generated tokens per second and mean accepted
length at each batch size, greedy, on the embedded model (or ``--model``) with prompts cut from held-out standard
library files.

    python benchmarks/bench_speculative.py [--backend cuda_sm100] [--batches 1,16,64] [--specs 1,1:sync,3,3@0.5]
        [--max-tokens 128] [--repeats 3] [--json OUT.json]

Each spec is ``k[@threshold][/batch][:sync]`` (``num_speculative_tokens``, ``confidence_threshold``,
``disable_by_batch_size``; ``:sync`` without asynchronous scheduling, so each speculative step waits for the one
before), or ``sync``: plain decoding without asynchronous scheduling (what the overlap of host and device is
worth). For every batch size, each configuration generates the same prompts ``--repeats`` times after
one warm-up; the table gives the median tokens per second, the speed-up over plain decoding measured in the same
run, the mean accepted length, the share of steps launched before the previous one's results were read
(``steps_ahead``; confidence scheduling reads the drafts and runs synchronously) and the share of requests whose
tokens equal plain decoding's (in the default mode the logits' rounding depends on the
rows a step runs, so a near-tie can differ; with ``DEEPINFER_BATCH_INVARIANT=1`` every request is identical).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from deepinfer.model import LLM, SamplingParams
from deepinfer.model.embedded import default_checkpoint, stdlib_documents


def prompts_from_heldout(tokenizer, n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens: the start of held-out files (cycled when there are fewer)."""
    docs = [d for d in stdlib_documents("heldout") if len(d.text) > 8 * length]
    if not docs:
        raise SystemExit("no held-out standard library files found on this machine")
    return [tokenizer.encode(docs[i % len(docs)].text)[:length] for i in range(n)]


def spec_config(text: str) -> dict | None:
    """``0`` or ``sync`` (no speculation), else ``k[@threshold][/disable_by_batch_size][:sync]``."""
    if text in ("0", "sync"):
        return None
    text = text.removesuffix(":sync")
    text, _, cap = text.partition("/")
    k, _, threshold = text.partition("@")
    config = {"method": "mtp", "num_speculative_tokens": int(k), "confidence_threshold": float(threshold or 0)}
    return config | ({"disable_by_batch_size": int(cap)} if cap else {})


EMBEDDED = "model/checkpoints/tiny-py/bf16"  # recorded for the default, the embedded model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: the embedded model)")
    ap.add_argument("--backend")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--specs", default="sync,1,1:sync,3,3:sync,3@0.5,3/32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    configs = ["0", *args.specs.split(",")]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    llms = {
        c: LLM(
            args.model or default_checkpoint(),
            args.backend,
            max_num_seqs=max(batches),
            progress=False,
            speculative_config=spec_config(c),
            async_scheduling=c != "sync" and not c.endswith(":sync"),
        )
        for c in configs
    }
    prompts = prompts_from_heldout(llms["0"].tokenizer, max(batches), args.prompt_len)
    print(f"{llms['0'].backend} on {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}")
    print("| batch | spec | tokens/s | vs plain | mean accepted length | drafts / verification | steps ahead | same |")
    print("|---|---|---|---|---|---|---|---|")
    for b in batches:
        plain_tokens, plain_rate = None, None
        for c in configs:
            llm = llms[c]
            llm.generate(prompts[:b], sp)  # warm-up: compilation, graphs, caches
            rates, stats = [], {}
            for _ in range(args.repeats):
                steps0, ahead0 = llm.engine.stats["steps"], llm.engine.stats["steps_ahead"]
                start = time.perf_counter()
                outs = llm.generate(prompts[:b], sp)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                rates.append(b * args.max_tokens / (time.perf_counter() - start))
                stats = llm.last_stats.get("speculative", {})
                ahead = (llm.engine.stats["steps_ahead"] - ahead0) / (llm.engine.stats["steps"] - steps0)
            tokens = [o.outputs[0].token_ids for o in outs]
            rate = statistics.median(rates)
            if c == "0":
                plain_tokens, plain_rate = tokens, rate
            same = sum(t == p for t, p in zip(tokens, plain_tokens)) / b
            per_step = stats["drafted"] / stats["verifications"] if stats.get("verifications") else 0.0
            row = {
                "batch": b,
                "spec": c,
                "tokens_per_s": rate,
                "speedup": rate / plain_rate,
                "mean_accepted_length": stats.get("mean_accepted_length", 1.0),
                "drafts_per_verification": per_step,
                "steps_ahead": ahead,
                "same_tokens": same,
                "runs": rates,
            }
            rows.append(row)
            print(
                f"| {b} | {c} | {rate:.0f} | {rate / plain_rate:.2f}x | {row['mean_accepted_length']:.2f} | "
                f"{per_step:.2f} | {100 * ahead:.0f}% | {100 * same:.0f}% |",
                flush=True,
            )
            if args.json:
                with open(args.json, "w") as f:
                    model = args.model or EMBEDDED
                    json.dump({"model": model, "max_tokens": args.max_tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
