"""Speculative decoding with the MTP layer against plain decoding: generated tokens per second and mean accepted
length at each batch size, greedy, on the embedded model (or ``--model``) with prompts cut from held-out standard
library files.

    python benchmarks/bench_speculative.py [--backend cuda_sm100] [--batches 1,16,64] [--specs 1,1:ahead,3,3@0.5]
        [--max-tokens 128] [--repeats 3] [--alone N] [--step-times] [--profile] [--set MODULE.NAME=VALUE,...]
        [--json OUT.json]

Each spec is ``k[@threshold][/batch][:ahead]`` (``num_speculative_tokens``, ``confidence_threshold``,
``disable_by_batch_size``; ``:ahead``: ``launch_ahead``, each speculative step launched before the host has read the one
before, which otherwise it waits for), or ``sync``: plain decoding without asynchronous scheduling (what the overlap of
host and device is worth). For every batch size, each configuration generates the same prompts ``--repeats`` times after
one warm-up; the table gives the median tokens per second, the speed-up over plain decoding measured in the same run,
the time to the first token (the same requests run to one token, ``--repeats`` times: the prompts' prefill, with
the MTP layer's pass over the prompt under speculation) and the decode rate after it (the other tokens over the rest
of the time) with its speed-up, the mean accepted length, the share of steps launched before the previous one's
results were read (``steps_ahead``; confidence scheduling reads the drafts and runs synchronously) and the share of
requests whose tokens equal plain decoding's (in the default mode the logits' rounding depends on the rows a step
runs, so a near-tie can differ; with ``DEEPINFER_BATCH_INVARIANT=1`` every request is identical). Batch 1 runs the
first prompt, or with ``--alone N`` the first ``N`` prompts, each alone in turn: how many drafts a request accepts
depends on its text, and one prompt is a sample of one.

``--step-times`` runs each configuration's requests once more with every engine step timed (one ``generate`` call
per batch, or per request with ``--alone``): the first step of a call, which prefills its prompts, the median of the
others and how much of it they spend blocked on the device (near 0 where the host sets the pace), steps per call, and
the time a call spends outside any step.

``--set`` changes module constants of the ``cuda_sm100`` backend for the whole run, as ``ab_against_git.py --set``
does (e.g. ``--set gemm.FEW_ROWS_FP32_MAX_M=0``: the router's few-row tile off): an A/B is two runs, one per side,
and the JSON records the setting.

``--profile`` (GPU) loads each configuration once more after every timed run (once the profiler has run, the
process's launches stay slower: the tokens per second, first-token and step times of any configuration measured
after it would be skewed) and runs it under the profiler, adding what the device does: its busy time
(the union of its kernels and copies) and its operations per engine step (and which of them a speculative step runs
more or fewer of than plain decoding's, and spends more or less time in), and the host-hidden bound, plain decoding's
device time per generated token over this configuration's: the speed-up over plain decoding if the host kept the device
busy in both, which no host or scheduling change can pass (against a plain decoding bound by its host, as the embedded
model's is, the measured speed-up can exceed it). The profiled run includes the prompts' prefill, as the timed ones
do.

The embedded model's step is bound by launches, not by its weights. ``--cut LAYERS`` serves instead a
DeepSeek-V3-shaped FP8 cut of that many layers with an MTP layer (``bench_model.py``'s random checkpoint, written to
a temporary directory, on the GPU), whose step is bound by reading its weights, as DeepSeek-V3's is. Its random MTP
layer drafts nothing the model takes, so ``--oracle-drafts P`` replaces every draft with the token plain decoding
took there, spoiled (made wrong) with probability ``P``: a known acceptance, for what verification costs at it.
Oracle drafts are read on the host, so those speculative steps wait for the one before (``:ahead`` is ignored),
and the MTP layer still runs as it would. A random checkpoint's logits are near-ties everywhere, so its greedy tokens
follow the rounding of the rows a step runs; the oracle's run is batch-invariant (``DEEPINFER_BATCH_INVARIANT=1``
semantics), where a row's tokens are the same at every batch size and in verification rows, so a draft is accepted
exactly when it was not spoiled.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import random
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

import deepinfer
from deepinfer.model import LLM, SamplingParams
from deepinfer.model.embedded import default_checkpoint, stdlib_documents


def prompts_from_heldout(tokenizer, n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens: the start of held-out files (cycled when there are fewer)."""
    docs = [d for d in stdlib_documents("heldout") if len(d.text) > 8 * length]
    if not docs:
        raise SystemExit("no held-out standard library files found on this machine")
    return [tokenizer.encode(docs[i % len(docs)].text)[:length] for i in range(n)]


def spec_config(text: str) -> dict | None:
    """``0`` or ``sync`` (no speculation), else ``k[@threshold][/disable_by_batch_size][:ahead]``."""
    if text in ("0", "sync"):
        return None
    text, ahead = text.removesuffix(":ahead"), text.endswith(":ahead")
    text, _, cap = text.partition("/")
    k, _, threshold = text.partition("@")
    config = {"method": "mtp", "num_speculative_tokens": int(k), "confidence_threshold": float(threshold or 0)}
    return config | {"launch_ahead": ahead} | ({"disable_by_batch_size": int(cap)} if cap else {})


EMBEDDED = "model/checkpoints/tiny-py/bf16"  # recorded for the default, the embedded model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: the embedded model)")
    ap.add_argument("--backend")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--specs", default="sync,1,1:ahead,3,3:ahead,3@0.5,3/32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--alone", type=int, default=1, help="batch 1 runs this many prompts, each alone in turn (default: the first)"
    )
    ap.add_argument("--cut", type=int, help="serve a DeepSeek-V3-shaped FP8 cut of this many layers (see above)")
    ap.add_argument(
        "--oracle-drafts", type=float, help="drafts from plain decoding, each spoiled with this probability"
    )
    ap.add_argument("--profile", action="store_true", help="device busy time per step and the host-hidden bound (GPU)")
    ap.add_argument("--step-times", action="store_true", help="where a request's time goes, step by step")
    ap.add_argument("--set", help="cuda_sm100 module constants for the run: MODULE.NAME=VALUE[,...]")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.alone < 1:
        ap.error(f"--alone {args.alone}: at least 1")
    if args.profile and not torch.cuda.is_available():
        ap.error("--profile times the device: it needs a GPU")
    batches = [int(b) for b in args.batches.split(",")]
    configs = ["0", *args.specs.split(",")]
    invariant = deepinfer.batch_invariant(True) if args.oracle_drafts is not None else contextlib.nullcontext()
    settings = contextlib.nullcontext()
    if args.set:
        from ab_against_git import settings as backend_settings

        settings = backend_settings(args.set)
    with tempfile.TemporaryDirectory(prefix="deepinfer-spec-") as tmp, invariant, settings:
        model = write_cut(Path(tmp), args.cut, args.backend) if args.cut else args.model or default_checkpoint()
        rows = measure(args, model, batches, configs)
    head = ["tokens/s", "vs plain", "first token", "decode tokens/s", "vs plain", "mean accepted length"]
    table(rows, configs, [*head, "drafts / verification", "steps ahead", "same"], lambda row: [
        f"{row['tokens_per_s']:.0f}", f"{row['speedup']:.2f}x", f"{row['first_token_ms']:.1f} ms",
        f"{row['decode_tokens_per_s']:.0f}", f"{row['decode_speedup']:.2f}x", f"{row['mean_accepted_length']:.2f}",
        f"{row['drafts_per_verification']:.2f}", f"{100 * row['steps_ahead']:.0f}%", f"{100 * row['same_tokens']:.0f}%",
    ])  # fmt: skip
    if any("step_times" in row for row in rows):
        head = ["first step", "other steps (median)", "of it waiting for the device", "steps per call"]
        table(rows, configs, [*head, "outside the steps, per call"], lambda row: [
            f"{row['step_times']['first_step_ms']:.2f} ms", f"{row['step_times']['step_ms']:.3f} ms",
            f"{row['step_times']['wait_ms']:.3f} ms", f"{row['step_times']['steps_per_call']:.1f}",
            f"{row['step_times']['outside_ms']:.2f} ms",
        ])  # fmt: skip
    if any("device" in row for row in rows):
        head = ["device busy per step", "device operations per step", "host-hidden bound"]
        table(rows, configs, head, lambda row: [
            f"{row['device']['busy_us_per_step'] / 1e3:.3f} ms", f"{row['device']['operations_per_step']:.0f}",
            f"{row['host_hidden_bound']:.2f}x",
        ])  # fmt: skip
        plain = {r["batch"]: r["device"] for r in rows if r["spec"] == "0" and "device" in r}
        compared = [r for r in rows if r["spec"] != "0" and "device" in r and r["batch"] in plain]
        for what, key, unit in (("operations", "operations_by_name", ""), ("time", "us_by_name", " us")):
            if compared:
                print(f"\nDevice {what} per step beyond plain decoding's, by kernel or copy (the largest differences):")
            for row in sorted(compared, key=lambda r: (r["batch"], configs.index(r["spec"]))):
                extra = extra_operations(row["device"][key], plain[row["batch"]][key], unit)
                print(f"  batch {row['batch']}, {row['spec']}: {extra}")


def table(rows: list[dict], configs: list[str], head: list[str], cells) -> None:
    """A markdown table of ``rows`` by batch size, then configuration: columns ``head`` after those two, ``cells(row)``
    their values; blank line before it."""
    print("\n| batch | spec | " + " | ".join(head) + " |")
    print("|---" * (len(head) + 2) + "|")
    for row in sorted(rows, key=lambda r: (r["batch"], configs.index(r["spec"]))):
        print(f"| {row['batch']} | {row['spec']} | " + " | ".join(cells(row)) + " |")


def extra_operations(device: dict, plain: dict, unit: str = "", top: int = 12) -> str:
    """The ``top`` largest differences per step between ``device`` and plain decoding's ``plain`` (operations or
    time by name), as ``name +n`` (or ``-n``)."""
    diff = {name: device.get(name, 0.0) - plain.get(name, 0.0) for name in device.keys() | plain.keys()}
    largest = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top]
    return ", ".join(f"{name[:48]} {n:+.1f}{unit}" for name, n in largest if abs(n) >= 0.5)


def write_cut(path: Path, layers: int, backend: str | None) -> Path:
    """``bench_model.py``'s DeepSeek-V3-shaped FP8 checkpoint of ``layers`` layers plus an MTP layer, in ``path``."""
    from bench_model import V3, write_checkpoint

    spec = deepinfer.registry.get().lookup(backend or deepinfer.current_backend().name)
    config = dict(V3, num_hidden_layers=layers, first_k_dense_replace=1, num_nextn_predict_layers=1)
    write_checkpoint(path, config, torch.device(spec.device_type), seed=0)
    return path


def oracle_drafts(llm: LLM, plain: dict[tuple, list[int]], spoil: float, seed: int) -> None:
    """Replaces ``llm``'s drafts with the tokens plain decoding took (``plain``: prompt -> prompt and completion),
    each made wrong with probability ``spoil``. The MTP layer still runs; its chained drafts are dropped."""
    drafter = llm.engine.runner.drafter
    propose, rng = drafter.propose, random.Random(seed)
    vocab = llm.config.vocab_size

    def from_plain(seqs, *a, **k):
        propose(seqs, *a, **k)
        for seq in seqs:
            full = plain[tuple(seq.token_ids[: seq.num_prompt_tokens])]
            true = full[seq.num_tokens : seq.num_tokens + len(seq.drafts)]
            seq.drafts = [t if rng.random() >= spoil else (t + 1) % vocab for t in true]
        return []  # every draft is on the host

    drafter.propose = from_plain


def measure(args, model: str | Path, batches: list[int], configs: list[str]) -> list[dict]:
    """Every configuration at every batch size, one configuration loaded at a time (plain decoding first); with
    ``--profile``, each loaded once more for its profiles after every timed run: once the profiler has run, the
    process's launches stay slower, which would skew the timings that came after it."""
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    first_only = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rows: list[dict] = []
    plain: dict[int, tuple] = {}  # batch -> (tokens, tokens per second, decode rate) of plain decoding
    prompts, continuations = None, None

    def load(c: str) -> LLM:
        spec = spec_config(c)
        if spec is not None and args.oracle_drafts is not None:
            spec["launch_ahead"] = False  # (the oracle's drafts are set on the host)
        llm = LLM(
            model,
            args.backend,
            max_num_seqs=max(batches),
            max_model_len=args.prompt_len + args.max_tokens + 64,
            progress=False,
            speculative_config=spec,
            async_scheduling=c != "sync",
        )
        if continuations is not None and spec is not None:
            oracle_drafts(llm, continuations, args.oracle_drafts, seed=len(c))
        return llm

    def unload() -> None:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    for c in configs:
        spec = spec_config(c)
        llm = load(c)
        if prompts is None:
            prompts = make_prompts(llm, max(*batches, args.alone), args.prompt_len)
            print(f"{llm.backend} on {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}")
            if args.oracle_drafts is not None:
                outs = llm.generate(prompts, sp)
                continuations = {tuple(p): p + o.outputs[0].token_ids for p, o in zip(prompts, outs)}
        for b in batches:
            group = prompts[: args.alone if b == 1 else b]
            generate_in_turn(llm, group, b, sp)  # warm-up over the timed requests: compilation, caches, allocations
            rates, stats, ahead = [], {}, 0.0
            for _ in range(args.repeats):
                steps0, ahead0 = llm.engine.stats["steps"], llm.engine.stats["steps_ahead"]
                spec0 = dataclasses.replace(llm.engine.spec_stats) if spec is not None else None
                outs, seconds = generate_in_turn(llm, group, b, sp)
                rates.append(len(group) * args.max_tokens / seconds)
                if spec0 is not None:
                    stats = llm.engine.spec_stats.since(spec0).as_dict()
                ahead = (llm.engine.stats["steps_ahead"] - ahead0) / (llm.engine.stats["steps"] - steps0)
            tokens = [o.outputs[0].token_ids for o in outs]
            rate = statistics.median(rates)
            # the same requests to their first token only: the prompts' prefill (and the MTP layer's pass over them)
            first = statistics.median(generate_in_turn(llm, group, b, first_only)[1] for _ in range(args.repeats))
            rest = len(group) * args.max_tokens / rate - first  # (not positive: too short a run to tell)
            decode = len(group) * (args.max_tokens - 1) / rest if rest > 0 else float("nan")
            if c == "0":
                plain[b] = (tokens, rate, decode)
            per_step = stats["drafted"] / stats["verifications"] if stats.get("verifications") else 0.0
            rows.append(
                {
                    "batch": b,
                    "spec": c,
                    "tokens_per_s": rate,
                    "speedup": rate / plain[b][1],
                    "first_token_ms": 1e3 * first / (len(group) // b),
                    "decode_tokens_per_s": decode,
                    "decode_speedup": decode / plain[b][2],
                    "mean_accepted_length": stats.get("mean_accepted_length", 1.0),
                    "drafts_per_verification": per_step,
                    "steps_ahead": ahead,
                    "same_tokens": sum(t == p for t, p in zip(tokens, plain[b][0])) / len(group),
                    "runs": rates,
                }
            )
            if args.step_times:
                rows[-1]["step_times"] = step_times(llm, group, b, sp)
            print(f"  {c} at batch {b}: {rate:.0f} tokens/s", flush=True)
            write_json(args, llm, rows)
        del llm
        unload()
    if args.profile:
        by_key = {(r["spec"], r["batch"]): r for r in rows}
        for c in configs:
            llm = load(c)
            for b in batches:
                llm.generate(prompts[:b], sp)  # warm-up
                by_key[c, b]["device"] = profiled = device_profile(llm, prompts[:b], sp)
                plain_busy = by_key["0", b]["device"]["busy_us_per_token"]  # (plain decoding is profiled first)
                by_key[c, b]["host_hidden_bound"] = plain_busy / profiled["busy_us_per_token"]
            write_json(args, llm, rows)
            del llm
            unload()
    return rows


def write_json(args, llm: LLM, rows: list[dict]) -> None:
    """The rows so far into ``--json`` (if given), with the model's name and shape (not where it lies)."""
    if not args.json:
        return
    name = f"DeepSeek-V3-shaped cut of {args.cut} layers" if args.cut else EMBEDDED
    if args.model:
        cfg = llm.config
        name = f"{Path(args.model).name}: {cfg.model_type}, {cfg.num_hidden_layers} layers"
    with open(args.json, "w") as f:
        json.dump(
            {
                "model": name,
                "max_tokens": args.max_tokens,
                "alone": args.alone,
                "oracle_drafts": args.oracle_drafts,
                "batch_invariant": deepinfer.batch_invariant_enabled(),
                "settings": args.set,
                "rows": rows,
            },
            f,
            indent=1,
        )


def generate_in_turn(llm: LLM, group: list[list[int]], b: int, sp: SamplingParams) -> tuple[list, float]:
    """``group``'s requests, ``b`` to a ``generate`` call, one call after another: their outputs and the seconds
    all the calls took (the device's work included)."""
    start = time.perf_counter()
    outs = [o for i in range(0, len(group), b) for o in llm.generate(group[i : i + b], sp)]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return outs, time.perf_counter() - start


def step_times(llm: LLM, group: list[list[int]], b: int, sp: SamplingParams) -> dict:
    """One more run of ``group`` (``b`` requests a call) with every engine step timed: the first step of each call
    (it prefills the prompts), the median of the others and the median time they block on the device (reading a
    step's results, ``LaunchedStep.result``: near 0 where the host sets the pace), steps per call, and the time a
    call spends outside any step."""
    from deepinfer.model.model_runner import LaunchedStep

    engine, result = llm.engine, LaunchedStep.result
    walls, waits, blocked = [], [], [0.0]

    def timed_result(self):
        start = time.perf_counter()
        try:
            return result(self)
        finally:
            blocked[0] += time.perf_counter() - start

    def timed_step():
        blocked[0], start = 0.0, time.perf_counter()
        out = engine_step(engine)
        walls.append(time.perf_counter() - start)
        waits.append(blocked[0])
        return out

    firsts: set[int] = set()  # the index of each call's first step
    engine_step = type(engine).step
    engine.step, LaunchedStep.result = timed_step, timed_result
    start = time.perf_counter()
    try:
        for i in range(0, len(group), b):
            firsts.add(len(walls))
            llm.generate(group[i : i + b], sp)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    finally:
        del engine.step
        LaunchedStep.result = result
    total = time.perf_counter() - start
    calls = len(firsts)
    others = [i for i in range(len(walls)) if i not in firsts]
    return {
        "first_step_ms": 1e3 * statistics.median(walls[i] for i in firsts),
        "step_ms": 1e3 * statistics.median(walls[i] for i in others) if others else 0.0,
        "wait_ms": 1e3 * statistics.median(waits[i] for i in others) if others else 0.0,
        "steps_per_call": len(walls) / calls,
        "outside_ms": 1e3 * (total - sum(walls)) / calls,
        "walls_ms": [1e3 * w for w in walls],
    }


def device_profile(llm: LLM, prompts: list[list[int]], sp: SamplingParams) -> dict:
    """One more ``generate`` under the profiler: the device's busy time (``bench_model.device_timeline``) and its
    operations (kernels and copies) and their time, per engine step and per generated token, in all and by name."""
    from bench_model import device_timeline
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    steps0 = llm.engine.stats["steps"]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, sp)
        torch.cuda.synchronize()
    steps = llm.engine.stats["steps"] - steps0
    line = device_timeline(prof, steps)
    events = [e for e in prof.profiler.kineto_results.events() if e.device_type() == DeviceType.CUDA]
    names = Counter(e.name() for e in events)
    time_ns: Counter = Counter()
    for e in events:
        time_ns[e.name()] += e.duration_ns()
    tokens = len(prompts) * sp.max_tokens
    return {
        "steps": steps,
        "busy_us_per_step": line["busy_us_per_step"],
        "operations_per_step": names.total() / steps,
        "busy_us_per_token": line["busy_us_per_step"] * steps / tokens,
        "operations_by_name": {name: n / steps for name, n in names.most_common()},
        "us_by_name": {name: t / 1e3 / steps for name, t in time_ns.most_common()},
    }


def make_prompts(llm: LLM, n: int, length: int) -> list[list[int]]:
    """Held-out text through the checkpoint's tokenizer, or random tokens where it has none."""
    if llm.tokenizer is not None:
        return prompts_from_heldout(llm.tokenizer, n, length)
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, llm.config.vocab_size, (length,), generator=g).tolist() for _ in range(n)]


if __name__ == "__main__":
    main()
