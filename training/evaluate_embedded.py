"""Measures the embedded model through deepinfer: held-out bits per byte beside a unigram baseline, and, with
``--compare``, each token's log-probability on one backend against another.

    python training/evaluate_embedded.py [--variant bf16|fp8] [--backend NAME] [--max-files N]
                                         [--compare NAME] [--json FILE]

The held-out split of the running interpreter's standard library (``deepinfer.model.embedded``) is cut as the
training script cuts it (documents as begin-of-sentence, tokens, end-of-sentence, one after the other; windows of
1024 predicted tokens); every window is one prompt whose prompt log-probabilities deepinfer computes. Bits per
byte: the summed negative log-probability of every predicted token but begin-of-sentence, in bits, over the UTF-8
bytes of the held-out files. The unigram baseline: the same tokens under the training split's token frequencies
(add-one smoothed), so it needs the training split tokenized too.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time

import torch

from deepinfer.model import LLM, SamplingParams
from deepinfer.model.embedded import checkpoint_dir, stdlib_documents, token_stream, unigram_bits, windows

SEQ_LEN = 1024


def prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> list[list[float]]:
    """Per prompt, the log-probability of each token after the first."""
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    return [o.prompt_logprobs[1:] for o in outs]


def nll_bits(prompts: list[list[int]], logprobs: list[list[float]], bos: int) -> float:
    return -sum(lp for p, lps in zip(prompts, logprobs) for t, lp in zip(p[1:], lps) if t != bos) / math.log(2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", default="bf16", choices=("bf16", "fp8"))
    ap.add_argument("--backend", default=None, help="deepinfer backend (default: the selected one)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--max-files", type=int, help="the first N held-out files only")
    ap.add_argument("--compare", metavar="BACKEND", help="also run BACKEND and compare per-token log-probabilities")
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args(argv)

    path = checkpoint_dir(args.variant)
    llm = LLM(path, backend=args.backend, dtype=args.dtype, progress=False)
    encode, bos, eos = llm.tokenizer.encode, llm.config.bos_token_id, llm.config.eos_token_ids[0]
    held = stdlib_documents("heldout")[: args.max_files]
    held_bytes = sum(len(d.text.encode()) for d in held)
    prompts = windows(token_stream(encode, eos, held), SEQ_LEN)
    t0 = time.perf_counter()
    lps = prompt_logprobs(llm, prompts)
    seconds = time.perf_counter() - t0
    bits = nll_bits(prompts, lps, bos)

    train = torch.tensor(token_stream(encode, eos, stdlib_documents("train")))
    targets = [t for p in prompts for t in p[1:] if t != bos]
    unigram = unigram_bits(train, torch.tensor(targets), llm.config.vocab_size)

    figures = {
        "model": f"{path.parent.name}/{args.variant}",
        "backend": llm.backend,
        "dtype": args.dtype,
        "python": platform.python_version(),
        "heldout_files": len(held),
        "heldout_bytes": held_bytes,
        "predicted_tokens": len(targets),
        "bits_per_byte": bits / held_bytes,
        "unigram_bits_per_byte": unigram / held_bytes,
        "tokens_per_second": len(targets) / seconds,
    }
    if args.compare:
        other = LLM(path, backend=args.compare, dtype=args.dtype, progress=False)
        theirs = prompt_logprobs(other, prompts)
        diff = [abs(a - b) for mine, ref in zip(lps, theirs) for a, b in zip(mine, ref)]
        figures["compare"] = {
            "backend": other.backend,
            "bits_per_byte": nll_bits(prompts, theirs, bos) / held_bytes,
            "median_abs_logprob_diff": statistics.median(diff),
            "p99_abs_logprob_diff": sorted(diff)[int(0.99 * (len(diff) - 1))],
            "max_abs_logprob_diff": max(diff),
        }
    print(json.dumps(figures, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
