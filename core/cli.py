"""The ``deepinfer`` command line: ``info``, ``conformance``, ``bench``, ``generate`` and ``serve``
(``build_parser``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from . import registry, selection
from .errors import DeepInferError, InputError
from .ops import OP_NAMES

console = Console(width=None if sys.stdout.isatty() else 200)


def _backends_table() -> Table:
    reg = registry.get()
    table = Table(title="Backends", title_justify="left")
    for col in ("name", "aliases", "plugin", "installed", "available", "device", "capabilities", "reason"):
        table.add_column(col)
    for name, spec in reg.backends.items():
        ok, reason = reg.probe(name)
        table.add_row(
            name,
            ", ".join(spec.aliases),
            reg.plugin_of[name],
            "yes",
            "[green]yes" if ok else "[red]no",
            spec.device_type,
            ", ".join(sorted(spec.capabilities)),
            escape(reason),
        )
    for name, err in reg.failures.items():
        table.add_row(name, "", name, "yes", "[red]no", "", "", escape(f"plugin failed to load: {err}"))
    for name in reg.skipped:
        table.add_row(name, "", name, "yes", "[yellow]not loaded", "", "", "not in DEEPINFER_PLUGINS")
    return table


def _ops_table(backend: str) -> Table:
    reg = registry.get()
    spec = reg.lookup(backend)
    backend = spec.name if spec else backend  # an alias shows its backend's implementations
    table = Table(title=f"Ops on {backend}", title_justify="left")
    for col in ("op", "implementations, in the order tried (the first that accepts runs)", "batch-invariant", "else"):
        table.add_column(col)
    for op in OP_NAMES:
        impls = reg.impls_for(backend, op)
        names = ", ".join(f"{i.provider}" for i in impls) or "-"
        invariant = ", ".join(i.provider for i in impls if i.batch_invariant) or "-"
        fallback = "" if backend == "reference" else "reference (fallback)"
        table.add_row(op, names, invariant, fallback)
    return table


def _choices_table(backend: str, shapes: str, device: str | None, only: list[str] | None) -> Table:
    from .conformance.choices import case_choices

    spec = selection.require(backend, f"--backend {backend}")
    table = Table(title=f"Implementation taken per conformance case on {spec.name} ({shapes} shapes)")
    for col in ("op", "case", "mode", "taken", "declined before it (why)"):
        table.add_column(col, overflow="fold")
    with console.status("asking each implementation"):
        choices = case_choices(spec.name, shapes, device, only)
    for c in choices:
        why = "; ".join(f"{p}: {r}" for p, r in c.declined)
        taken = f"[red]{escape(c.error)}" if c.error else ("[yellow]" if "fallback" in c.taken else "") + c.taken
        table.add_row(c.op, escape(c.case), c.mode, taken, escape(why))
    return table


def cmd_info(args: argparse.Namespace) -> int:
    for flag, needs in (("--shapes", "--ops"), ("--only", "--shapes"), ("--device", "--shapes")):
        if getattr(args, flag[2:]) and not getattr(args, needs[2:]):  # it would be ignored
            return _bad_flag(flag, f"it together with {needs} (alone it changes nothing)", getattr(args, flag[2:]))
    if args.backend and registry.get().lookup(args.backend) is None:
        reg = registry.get()
        return _bad_flag(
            "--backend", f"an installed backend or alias ({', '.join([*reg.backends, *reg.aliases])})", args.backend
        )
    if args.only is not None and set(args.only.split(",")) - set(OP_NAMES):  # "" names no op: not all
        return _bad_flag("--only", f"ops among {', '.join(OP_NAMES)}", args.only)
    if args.device:
        for name in registry.get().backends:  # as the table below: a backend's device type (npu) is registered
            registry.get().probe(name)
        if (bad := _bad_device(args.device)) is not None:
            return bad
    console.print(_backends_table())
    try:
        spec, how = selection.resolve()
        console.print(f"Selected backend: [bold]{spec.name}[/bold] ({how})")
        shown = spec.name
    except DeepInferError as e:
        console.print(f"[red]No backend can be selected:[/red] {escape(str(e))}")
        shown = "reference"
    if args.ops:
        console.print(_ops_table(args.backend or shown))
        if args.shapes:
            only = args.only.split(",") if args.only is not None else None
            console.print(_choices_table(args.backend or shown, args.shapes, args.device, only))
    return 0


STATUS_STYLE = {"pass": "green", "fail": "red", "error": "red", "fallback": "yellow"}


def _cases_table(report, results) -> Table:
    table = Table(title=f"Checks of {report.backend}", title_justify="left")
    for col in ("op", "case", "check", "status", "impl", "error", "tolerance", "detail"):
        table.add_column(col, overflow="fold")
    for r in results:
        err = "" if r.error is None else f"{r.error:.2e}"
        tol = "" if r.tolerance is None else f"{r.tolerance:.0e}"
        table.add_row(
            r.op,
            escape(r.case),
            r.check,
            f"[{STATUS_STYLE[r.status]}]{r.status}",
            r.impl,
            err,
            tol,
            escape(r.detail[:160]),
        )
    return table


def _ops_summary(report) -> Table:
    table = Table(
        title=f"Conformance of {report.backend} ({report.shapes} shapes, seed {report.seed})", title_justify="left"
    )
    for col in ("op", "served by", "pass", "fail", "fallback", "worst error / tolerance"):
        table.add_column(col)
    for op in OP_NAMES:
        rs = [r for r in report.results if r.op == op]
        if not rs:
            continue
        count = {s: sum(r.status == s for r in rs) for s in STATUS_STYLE}
        served = sorted({r.impl for r in rs if r.check == "accuracy"})
        ratios = [
            r.error / r.tolerance if r.tolerance else (0.0 if r.error == 0 else float("inf"))
            for r in rs
            if r.error is not None and r.status != "fallback"
        ]
        worst = max(ratios, default=None)
        table.add_row(
            op,
            ", ".join(served),
            str(count["pass"]),
            f"[red]{count['fail'] + count['error']}",
            f"[yellow]{count['fallback']}",
            "" if worst is None else f"{worst:.2f}",
        )
    return table


def cmd_conformance(args: argparse.Namespace) -> int:
    from .conformance.runner import all_bad_inputs, all_cases, run_conformance

    selection.require(args.backend, f"--backend {args.backend}")
    if (bad := _bad_device(args.device)) is not None:
        return bad
    only = args.ops.split(",") if args.ops is not None else None  # "" names no op: an error below, not all
    if only is not None:
        unknown = sorted(set(only) - set(OP_NAMES))
        if unknown:
            return _bad_flag("--ops", f"ops among {', '.join(OP_NAMES)}", args.ops)
    total = sum(1 for c in all_cases(args.shapes) if only is None or c.op in only)
    total += sum(1 for b in all_bad_inputs() if only is None or b.op in only)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task(f"conformance of {args.backend}", total=total)

        def tick(result) -> None:
            if result.check in ("accuracy", "bad_input"):
                progress.update(task, advance=1, description=f"{result.op}: {result.case[:50]}")

        report = run_conformance(
            args.backend, shapes=args.shapes, device=args.device, only_ops=only, seed=args.seed, on_result=tick
        )
    if args.note:
        report.note = args.note
    console.print(_ops_summary(report))
    shown = report.results if args.verbose else report.failed
    if shown:
        console.print(_cases_table(report, shown))
    counts = report.counts()
    line = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    verdict = "[red]FAILED" if report.failed else "[green]PASSED"
    console.print(f"{verdict}[/] {report.backend} on {report.device}: {line} (seed {report.seed})")
    if args.report:
        with open(args.report, "w") as f:
            f.write(report.to_json())
        console.print(f"report written to {args.report}")
    return 1 if report.failed else 0


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench
    from .selection import use

    only = args.ops.split(",") if args.ops is not None else None  # "" names no op: an error, not all
    known = sorted({c.op for c in bench.cases(args.quick)})
    if only is not None and set(only) - set(known):
        return _bad_flag("--ops", f"ops among {', '.join(known)}", args.ops)
    chosen = use(args.backend, source=f"--backend {args.backend}") if args.backend else contextlib.nullcontext()
    with chosen:
        if (bad := _bad_device(args.device)) is not None:  # once the backend, and so its device type, is loaded
            return bad
        with console.status("benchmarking") as status:
            result = bench.run_bench(
                quick=args.quick,
                only_ops=only,
                progress=lambda msg: status.update(escape(msg)),
                on_case=lambda partial: bench.save(partial, args.json, None, ""),  # kept if the run is stopped early
                device=args.device,
            )
    where = result["environment"].get("gpu", result["device"])
    table = Table(title=f"deepinfer bench on {where} ({result['backend']})", title_justify="left")
    header = ("op", "case", "implementation", "ms eager", "ms graph", "TFLOP/s", "GB/s", "% roofline", "rel. error")
    for col in (*header, "note"):
        table.add_column(col, overflow="fold")
    fmt = lambda v, spec: "" if v is None else format(v, spec)
    for r in result["rows"]:
        table.add_row(
            r["op"],
            r["case"],
            escape(r["impl"]),
            fmt(r["ms"], ".4f"),
            fmt(r["graph_ms"], ".4f"),
            fmt(r["tflops"], ".1f"),
            fmt(r["gbps"], ".0f"),
            bench.roofline_text(r),
            fmt(r["rel_err"], ".1e"),
            escape(r["note"]),
        )
    console.print(table)
    not_measured = " (not measured with --quick: its tiny sizes time launches, not ceilings)" if args.quick else ""
    console.print(f"ceilings: {bench.ceilings_text(result['ceilings'])}{not_measured}", soft_wrap=True)
    bench.save(result, args.json, args.results, "deepinfer " + " ".join(args.argv))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from .model.cli import generate  # imported here: `import deepinfer` and `deepinfer info` never load the model

    return generate(args, console)


def cmd_serve(args: argparse.Namespace) -> int:
    from .model.server import serve  # imported here: the server's dependencies load only for `serve`

    return serve(args, console)


DESCRIPTION = (
    "deepinfer: DeepSeek-V3-family inference on pluggable backends. Subcommands: info (installed backends and the "
    "selected one), conformance (check a backend against the reference), bench (time each op against measured "
    "ceilings and peers), generate (run a checkpoint), serve (an OpenAI-compatible server)."
)


class _Parser(argparse.ArgumentParser):
    """Reports a bad command line as one line, like every other error of the CLI: ``error: argument --flag:
    expected ..., got ...`` and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _checked(kind: type, expected: str, ok: Callable[[Any], bool]) -> Callable[[str], Any]:
    """An argparse ``type`` that parses ``kind`` and accepts what ``ok`` accepts; argparse names the flag."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


def _int_at_least(minimum: int) -> Callable[[str], int]:
    return _checked(int, f"an int >= {minimum}", lambda v: v >= minimum)


def _finite(expected: str, ok: Callable[[float], bool]) -> Callable[[str], float]:
    return _checked(float, expected, lambda v: math.isfinite(v) and ok(v))


def _output_file(text: str) -> str:
    """An argparse ``type`` for a file a command writes when it is done: its directory must exist and be writable
    (and the path must not be a directory), checked before any work, so that a long run never ends in a traceback
    from ``open``. Nothing is created here."""
    path = Path(text)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        why = "it is a directory"
    elif not parent.is_dir():
        why = f"no directory {str(parent)!r}"
    elif not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        why = "not writable"
    else:
        return text
    raise argparse.ArgumentTypeError(f"expected a file path that can be written, got {text!r} ({why})")


def _device_problem(device: str) -> str | None:
    """Why the inputs cannot be put on torch device ``device`` here (torch cannot parse it, or cannot allocate on
    it), or None. Called once the backend is resolved, so that a backend's device type (``npu``) is registered."""
    import torch

    try:
        torch.empty(0, device=torch.device(device))
    except Exception as e:  # RuntimeError (bad string, bad index), AssertionError (torch built without it), ...
        return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return None


def _bad_device(device: str | None) -> int | None:
    """``_bad_flag``'s status for a ``--device`` that cannot hold the inputs, or None when it can (or is unset)."""
    why = _device_problem(device) if device else None
    if why is None:
        return None
    short = why if len(why) <= 80 else why[:77] + "..."
    return _bad_flag("--device", f"a torch device this process can allocate on, e.g. cpu or cuda:0 ({short})", device)


def _bad_flag(flag: str, expected: str, got: str) -> int:
    console.print(
        f"[red]error:[/red] argument {flag}: expected {escape(expected)}, got {escape(repr(got))}", soft_wrap=True
    )
    return 2


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``deepinfer`` and its five subcommands."""
    parser = _Parser(prog="deepinfer", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{info,conformance,bench,generate,serve}")

    about = "installed backends, whether each is available here and why, and which one is selected"
    info = sub.add_parser("info", help=about, description=f"List the {about}.")
    info.add_argument("--ops", action="store_true", help="list each op's implementations in the order they are tried")
    info.add_argument("--backend", help="show --ops for this backend instead of the selected one")
    info.add_argument(
        "--shapes",
        choices=("small", "full"),
        help="with --ops: for each conformance case of this grid, the implementation taken (default mode and "
        "batch-invariant mode) and why the ones tried before it declined; no kernel runs",
    )
    info.add_argument("--only", help="with --shapes: comma-separated ops (default: all)")
    info.add_argument("--device", help="with --shapes: torch device of the inputs (default: the backend's)")
    info.set_defaults(fn=cmd_info)

    about = "check a backend against the reference"
    conf = sub.add_parser(
        "conformance",
        help=about,
        description="Check every op of a backend against the reference on fresh random inputs: accuracy, "
        "determinism and batch invariance where declared, and the documented error for bad inputs. Exit status 1 "
        "on any failure.",
    )
    conf.add_argument("--backend", required=True, help="backend name or alias")
    conf.add_argument("--report", type=_output_file, help="write the JSON report to this file")
    conf.add_argument(
        "--shapes",
        choices=("small", "full"),
        default="small",
        help="small: quick grid (CI, CPU); full: DeepSeek-V3 shapes (needs the device)",
    )
    conf.add_argument("--ops", help="comma-separated ops to check (default: all)")
    conf.add_argument(
        "--device",
        help="torch device for the inputs (default: the backend's; e.g. cpu for the "
        "Triton interpreter or a test double)",
    )
    conf.add_argument(
        "--seed",
        type=_checked(int, "an int in [-2**63, 2**63)", lambda v: -(2**63) <= v < 2**63),  # torch's seeds, less offsets
        help="random seed (default: fresh each run; printed)",
    )
    conf.add_argument("--note", help="free text stored in the report (e.g. 'emulated')")
    conf.add_argument("-v", "--verbose", action="store_true", help="list every check, not only the failing ones")
    conf.set_defaults(fn=cmd_conformance)

    about = "time each op on DeepSeek-V3 shapes against measured ceilings and peers"
    bench = sub.add_parser(
        "bench",
        help=about,
        description="Time each op on DeepSeek-V3 shapes on a backend, beside the torch-native peer a user would "
        "pick, against ceilings (copy bandwidth, matmul peaks) measured in the same run.",
    )
    bench.add_argument("--backend", help="backend name or alias (default: the selected one)")
    bench.add_argument("--ops", help="comma-separated ops to time (default: all)")
    bench.add_argument(
        "--quick", action="store_true", help="tiny shapes: a smoke run, not a measurement (no ceilings, no roofline)"
    )
    bench.add_argument(
        "--json", type=_output_file, help="write all numbers to this JSON file (rewritten after every case)"
    )
    bench.add_argument("--device", help="torch device of the inputs (default: the backend's; cpu: Triton interpreter)")
    bench.add_argument(
        "--results", type=_output_file, help="append a dated section to this markdown file (e.g. benchmarks/RESULTS.md)"
    )
    bench.set_defaults(fn=cmd_bench)

    gen = sub.add_parser(
        "generate",
        help="generate with a DeepSeek-V3-family checkpoint (default: the embedded one)",
        description="Generate completions with a DeepSeek-V3-family checkpoint (a Hugging Face layout directory; "
        "default: the small model the package ships, trained on Python source; no download). Prints each "
        "completion with its finish reason, then a tokens/s summary.",
    )
    gen.add_argument("--model", help="checkpoint directory (default: the small embedded model the package ships)")
    gen.add_argument(
        "--prompt",
        action="append",
        help="a prompt (repeatable; default, without --prompt or --batch: 'The capital of France is')",
    )
    gen.add_argument("--batch", help="a file of prompts, one per line (a line holding a JSON list of ints: token ids)")
    gen.add_argument(
        "--max-tokens",
        type=_int_at_least(1),
        default=32,
        help="tokens to generate per prompt at most (default 32); a sequence also stops at the context length",
    )
    gen.add_argument(
        "--temperature",
        type=_finite("a finite number >= 0", lambda v: v >= 0),
        default=0.0,
        help="sampling temperature; 0 (default): greedy",
    )
    gen.add_argument(
        "--top-p",
        type=_finite("a number in (0, 1]", lambda v: 0 < v <= 1),
        default=1.0,
        help="nucleus sampling: keep the most likely tokens whose probabilities sum to this, in (0, 1] (default 1: "
        "off)",
    )
    gen.add_argument(
        "--top-k",
        type=_checked(int, "an int >= 0 (0 or -1: off)", lambda v: v >= -1),
        default=0,
        help="keep only the k most likely tokens (default 0: off)",
    )
    gen.add_argument("--seed", type=int, help="sampling seed (default: fresh each run)")
    constraint = gen.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="SCHEMA", help="structured output: a JSON schema (its text)")
    constraint.add_argument("--regex", help="structured output: the generated text fully matches this regex")
    constraint.add_argument("--grammar", help="structured output: a Lark or GBNF grammar (its text)")
    constraint.add_argument("--choice", nargs="+", metavar="TEXT", help="structured output: one of these strings")
    gen.add_argument(
        "--speculative-config",
        type=_checked(json.loads, "a JSON object", lambda v: isinstance(v, dict)),
        metavar="JSON",
        help='speculative decoding with the checkpoint\'s MTP layer, e.g. \'{"method": "mtp", '
        '"num_speculative_tokens": 2, "confidence_threshold": 0.3}\' (default: off)',
    )
    gen.add_argument("--backend", help="backend name or alias (default: the selected one)")
    gen.add_argument(
        "--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="activations and float weights"
    )
    gen.add_argument(
        "--kv-format",
        choices=("bf16", "fp8_ds_mla"),
        default="bf16",
        help="the paged latent cache: bf16, or FlashMLA's FP8 record (needs kv_lora_rank %% 128 == 0)",
    )
    gen.add_argument(
        "--max-num-seqs", type=_int_at_least(1), default=64, help="sequences decoded together at most (default 64)"
    )
    gen.add_argument(
        "--max-model-len",
        type=_int_at_least(2),
        help="context length: prompt plus generated tokens (default: the model's max_position_embeddings)",
    )
    gen.add_argument(
        "--ep",
        type=_int_at_least(1),
        help="split the routed experts over N processes: run under torchrun --nproc-per-node N "
        "(default: torchrun's WORLD_SIZE, else 1); output is printed by rank 0",
    )
    gen.add_argument(
        "--dist-timeout",
        type=_finite("a finite number > 0", lambda v: v > 0),
        default=600.0,
        help="seconds a rank waits for the others in a collective before failing (with --ep; default 600)",
    )
    gen.add_argument(
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="compute every prompt in full (default: reuse the cache pages of the longest prefix computed before)",
    )
    gen.add_argument(
        "--host-cache-gb",
        type=_finite("a finite number >= 0", lambda v: v >= 0),
        default=0.0,
        help="host memory for cache pages evicted from the device, copied back on a prefix hit (default 0: none)",
    )
    gen.add_argument(
        "--num-redundant-experts",
        type=_int_at_least(0),
        default=0,
        help="extra expert copies placed by EPLB over the --ep ranks (needs --enable-eplb; experts + copies a "
        "multiple of --ep; default 0)",
    )
    gen.add_argument(
        "--enable-eplb",
        action="store_true",
        help="measure the load of every expert and re-place the experts every --eplb-step-interval steps",
    )
    gen.add_argument(
        "--eplb-step-interval", type=_int_at_least(1), default=3000, help="steps between rebalances (default 3000)"
    )
    gen.add_argument(
        "--eplb-window-size",
        type=_int_at_least(1),
        default=1000,
        help="steps whose expert load a rebalance uses (default 1000)",
    )
    gen.add_argument(
        "--eplb-rebalance-layers-per-chunk",
        type=_int_at_least(1),
        default=1,
        help="MoE layers whose experts move per step while a rebalance is applied (default 1)",
    )
    gen.set_defaults(fn=cmd_generate)

    srv = sub.add_parser(
        "serve",
        help="serve a checkpoint over an OpenAI-compatible HTTP API (default: the embedded one)",
        description="Serve a DeepSeek-V3-family checkpoint over HTTP: /v1/completions, /v1/chat/completions "
        "(streaming by server-sent events), /v1/models, /health and Prometheus /metrics. Needs the server "
        "dependencies (pip install 'deepinfer[serve]').",
    )
    srv.add_argument("--model", help="checkpoint directory (default: the embedded one)")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: all)")
    srv.add_argument(
        "--port", type=_checked(int, "a port in [0, 65535]", lambda v: 0 <= v <= 65535), default=8000, help="port"
    )
    srv.add_argument("--served-model-name", help="the model's name in the API (default: --model as given, or tiny-py)")
    srv.add_argument(
        "--chat-template",
        help="a Jinja2 chat template (a file, or the template text) for checkpoints without one; without any, chat "
        "requests are refused",
    )
    srv.add_argument("--api-key", help="require this key (Authorization: Bearer KEY) on /v1 endpoints")
    srv.add_argument("--backend", help="backend name or alias (default: the selected one)")
    srv.add_argument(
        "--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="activations and float weights"
    )
    srv.add_argument("--kv-format", choices=("bf16", "fp8_ds_mla"), default="bf16", help="the paged latent cache")
    srv.add_argument(
        "--max-num-seqs", type=_int_at_least(1), default=64, help="sequences decoded together at most (default 64)"
    )
    srv.add_argument(
        "--max-model-len",
        type=_int_at_least(2),
        help="context length: prompt plus generated tokens (default: the model's max_position_embeddings)",
    )
    srv.add_argument(
        "--prefill-chunk-size",
        type=_int_at_least(1),
        default=1024,
        help="prefill chunk length (default 1024); prefix-cache hits come in whole chunks",
    )
    srv.add_argument(
        "--max-num-batched-tokens", type=_int_at_least(1), default=4096, help="tokens per step at most (default 4096)"
    )
    srv.add_argument(
        "--kv-cache-gb",
        type=_finite("a finite number > 0", lambda v: v > 0),
        help="cache size in GiB (default: 90%% of the device's free memory less a reserve; 1 GiB on the CPU)",
    )
    srv.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    srv.add_argument(
        "--speculative-config",
        type=_checked(json.loads, "a JSON object", lambda v: isinstance(v, dict)),
        metavar="JSON",
        help="speculative decoding with the checkpoint's MTP layer, as for generate (default: off)",
    )
    srv.add_argument(
        "--log-level", choices=("critical", "error", "warning", "info", "debug"), default="info", help="uvicorn's"
    )
    srv.add_argument(
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="compute every prompt in full (default: reuse the cache pages of the longest prefix computed before)",
    )
    srv.add_argument(
        "--host-cache-gb",
        type=_finite("a finite number >= 0", lambda v: v >= 0),
        default=0.0,
        help="host memory for cache pages evicted from the device, copied back on a prefix hit (default 0: none)",
    )
    srv.set_defaults(fn=cmd_serve)
    return parser


def _names_a_flag(e: DeepInferError, args: argparse.Namespace) -> bool:
    """Whether ``e`` reports a bad value of one argument (``arg``, ``expected``, ``actual``), not of an op, that this
    command line gave by a flag of the same name."""
    arg = getattr(e, "arg", None)
    return not hasattr(e, "op") and hasattr(e, "expected") and isinstance(arg, str) and arg in vars(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.fn(args)
    except InputError as e:
        if e.op == "LLM" and e.arg in vars(args):  # an LLM argument given by a flag: name the flag
            return _bad_flag("--" + e.arg.replace("_", "-"), e.expected, e.actual)
        console.print(f"[red]error:[/red] {escape(str(e))}", soft_wrap=True)
        return 2
    except DeepInferError as e:
        if _names_a_flag(e, args):  # expert parallelism's ParallelError (argument, expected, actual; no op)
            return _bad_flag("--" + e.arg.replace("_", "-"), e.expected, e.actual)
        console.print(f"[red]error:[/red] {escape(str(e))}", soft_wrap=True)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the shell's status for SIGINT (128 + 2), one line instead of a traceback
        Console(stderr=True).print("interrupted", highlight=False)
        return 130


if __name__ == "__main__":
    sys.exit(main())
