"""Same-run A/B of a cuda_sm100 kernel: the backend module as committed at a git revision against the working tree's,
on the same inputs, alternating the two several times, each checked against the reference before it is timed
(worst-row relative error, as ``deepinfer bench`` reports).

    python3 benchmarks/ab_against_git.py mla_decode|grouped_gemm|grouped_gemm_absorbed|gemm_invariant|sparse_mla|
        sparse_mla_gluon [--rev HEAD] [--rounds 2] [--eager]
    python3 benchmarks/ab_against_git.py mla_decode --set attention.MLA_GLUON=False --set mla_gluon.FP8_FILL_REGS=112

``--set MODULE.NAME=VALUE[,...]`` compares the working tree against itself with those module constants of
``backends/cuda_sm100`` changed (one side per ``--set``), instead of against a git revision. A tuple VALUE sets a record
by its fields (``--set "gemm.GROUPED_TILE=(128,128,8,4)"``, quoted for the shell); a VALUE of ``@OTHER`` sets the name
to the backend's module OTHER, e.g. ``--set attention.mla_gluon=@mla_gluon_before`` with a copy of ``mla_gluon.py``
saved beside it (not committed) as the other side of a kernel A/B.

Device time from CUDA graphs (``--eager``: eager medians, host work included). Under the Triton interpreter
(``TRITON_INTERPRET=1``, no GPU) it runs one small shape per case and times eagerly, which checks the script itself.
mla_decode: bf16 and fp8_ds_mla caches at B=64 ctx 4096, B=64 and 256 ctx 4160 (a 4k context and the tokens decoded
since), B=128 ctx 16384, B=32 ctx 1024 (H=128, latent 512 + rope 64, page 64). grouped_gemm: FP8 activations, gate/up
7168 -> 4096 and down 2048 -> 7168, 32 experts at 8, 128, 512 and 1024 rows per expert, and 256 experts at 256 rows each
(an 8k-token prefill chunk's top-8), by the kernel each call selects (``--set gemm.GROUPED_GLUON=True`` times the Gluon
kernel of prefill rows against it), and absorbed MLA's per-head bf16 products over strided views at 64 and 256 rows.
gemm_invariant: the FP8 ``gemm`` kernel in batch-invariant mode (FP8 activations) at the DeepSeek-V3 projections, M =
128 and 4096. sparse_mla: ``deepinfer bench``'s cases, bf16 and fp8_ds_mla, decode at 8k context and an 8k-query
prefill, by the Triton kernel; ``--rev`` swaps ``sparse_attention.py`` and its Triton kernels. sparse_mla_gluon: the
same cases by the Gluon kernel (GPU only), A/B'd by ``--set`` (its constants, or
``sparse_attention.sparse_mla_gluon=@OTHER``). Each line also says whether the two sides gave the same bits.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import itertools
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from tile_variants import make

import deepinfer
from deepinfer import QTensor, bench, dispatch, ops
from deepinfer.conformance.cases import Gen, error
from deepinfer.kv_cache import kv_format_of
from deepinfer.qtensor import quantize_blocks, quantize_rows

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
# op -> (file under backends/cuda_sm100, its function)
MODULES = {"mla_decode": ("attention", "mla_decode"), "grouped_gemm": ("gemm", "grouped_gemm"),
           "grouped_gemm_absorbed": ("gemm", "grouped_gemm"),
           "gemm_invariant": ("gemm", "gemm_fp8"), "sparse_mla": ("sparse_attention", "sparse_mla"),
           "sparse_mla_gluon": ("sparse_attention", "sparse_mla_gluon_kernel")}  # fmt: skip
PROJECTIONS = [(24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048), (2112, 7168)]


def module_at(rev: str, name: str):
    """The backend module ``name`` as committed at ``rev``, with its Triton kernels (``<name>_triton.py``, where the
    revision has that file) as committed there too, importing the working tree's package for the other helpers."""
    kernels = f"{name}_triton"
    rewrite = {"from . import": "from deepinfer_cuda_sm100 import"}
    if _source_at(rev, kernels) is not None:
        sys.modules[f"{kernels}_at_rev"] = _load_at(rev, kernels, {"from .": "from deepinfer_cuda_sm100."})
        rewrite[f"from .{kernels} import"] = f"from {kernels}_at_rev import"
    return _load_at(rev, name, rewrite | {"from .": "from deepinfer_cuda_sm100."})


def _source_at(rev: str, name: str) -> str | None:
    done = subprocess.run(["git", "show", f"{rev}:backends/cuda_sm100/{name}.py"], capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


def _load_at(rev: str, name: str, rewrite: dict[str, str]):
    source = _source_at(rev, name)
    if source is None:
        raise SystemExit(f"backends/cuda_sm100/{name}.py does not exist at {rev}")
    for old, new in rewrite.items():  # in order: the specific imports before the general one
        source = source.replace(old, new)
    path = Path(tempfile.mkdtemp()) / f"{name}_at_rev.py"  # Triton reads a kernel's source from its file
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"{name}_at_rev", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # where dataclasses look up the module's names
    spec.loader.exec_module(module)
    return module


def mla_cases() -> Iterator[tuple[str, list[dict], float, Callable]]:
    heads, shapes = (
        (128, [(64, 4096), (64, 4160), (256, 4160), (128, 16384), (32, 1024)]) if ON_GPU else (16, [(2, 192)])
    )
    for fmt in ("bf16", "fp8_ds_mla"):
        for batch, ctx in shapes:
            # lengths short of the table's reach by up to 100 tokens, so spans end inside a page
            sets = [make(batch, ctx, fmt, seed, heads, DEVICE, short=100) for seed in range(3)]
            with deepinfer.use("reference"):
                ref = ops.mla_decode(**sets[0])[0]
            flops = 2 * batch * ctx * heads * (576 + 512)
            yield f"{fmt} B={batch} ctx={ctx} H={heads}", sets, flops, lambda out, ref=ref: error(out[0], ref)


def _grouped_reference(kw: dict, experts: int, m: int, group: int = 32) -> torch.Tensor:
    """The reference ``grouped_gemm`` of a contiguous call with ``m`` rows per expert, ``group`` experts at a time (the
    reference dequantises the weights it is given: 256 experts at once would take about 90 GB)."""
    a, w, outs = kw["a"], kw["w"], []
    with deepinfer.use("reference"):
        for e in range(0, experts, group):
            stop = min(e + group, experts)
            rows = slice(e * m, stop * m)
            outs.append(
                ops.grouped_gemm(
                    QTensor(a.data[rows], a.scale[rows], a.block, a.scale_format),
                    QTensor(w.data[e:stop], w.scale[e:stop], w.block, w.scale_format),
                    expert_offsets=torch.arange(0, stop - e + 1, device=DEVICE, dtype=torch.int32) * m,
                    out_dtype=kw["out_dtype"],
                )
            )
    return torch.cat(outs)


def grouped_cases() -> Iterator[tuple[str, list[dict], float, Callable]]:
    if ON_GPU:  # 32 experts at decode-to-prefill rows, and DeepSeek-V3's 256 at an 8k-token chunk's 256 rows each
        cases = [(32, [8, 128, 512, 1024]), (256, [256])]
        shapes = [(4096, 7168), (7168, 2048)]
    else:
        cases, shapes = [(3, [9])], [(256, 256)]
    for (n, k), (experts, rows) in itertools.product(shapes, cases):
        gen = torch.Generator(device=DEVICE).manual_seed(n)
        parts = [  # 32 experts at a time: 256 experts' fp32 weights at once would take 30 GB
            quantize_blocks(torch.randn(min(32, experts - e), n, k, device=DEVICE, generator=gen) * k**-0.5)
            for e in range(0, experts, 32)
        ]
        w = QTensor(torch.cat([p.data for p in parts]), torch.cat([p.scale for p in parts]), parts[0].block)
        del parts
        for m in rows:
            offsets = torch.arange(0, experts + 1, device=DEVICE, dtype=torch.int32) * m
            sets = [
                {
                    "a": quantize_rows(torch.randn(experts * m, k, device=DEVICE, generator=gen), 128, "fp32"),
                    "w": w,
                    "expert_offsets": offsets,
                    "masked_m": None,
                    "out_dtype": torch.bfloat16,
                }
                for _ in range(3)
            ]
            ref = _grouped_reference(sets[0], experts, m)
            flops = 2 * experts * m * n * k
            yield f"E={experts} N={n} K={k} rows/expert={m}", sets, flops, lambda out, ref=ref: error(out, ref)


def absorbed_cases() -> Iterator[tuple[str, list[dict], float, Callable]]:
    """Absorbed MLA's per-head bf16 products at decode (DeepSeek-V3: 128 heads): ``w_uk`` over the queries' nope
    parts and ``w_uv`` over the latent outputs, each read as a view strided by rows and heads, as the model passes
    them (``model/mla.py``)."""
    heads, batches = (128, [64, 256]) if ON_GPU else (3, [70])
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    for name, n, k, width in (("w_uk", 512, 128, 192), ("w_uv", 128, 512, 512)):
        w = (torch.randn(heads, n, k, device=DEVICE, generator=gen) * k**-0.5).bfloat16()
        for t in batches:
            masked = torch.full((heads,), t, device=DEVICE, dtype=torch.int32)
            views = [torch.randn(t, heads, width, device=DEVICE, generator=gen).bfloat16() for _ in range(3)]
            sets = [{"a": v[..., :k].transpose(0, 1), "w": w, "expert_offsets": None, "masked_m": masked,
                     "out_dtype": torch.bfloat16} for v in views]  # fmt: skip
            with deepinfer.use("reference"):
                ref = ops.grouped_gemm(sets[0]["a"], w, masked_m=masked, out_dtype=torch.bfloat16)
            flops = 2 * heads * t * n * k
            yield f"absorbed {name} H={heads} rows={t} (strided)", sets, flops, lambda out, ref=ref: error(out, ref)


def gemm_cases() -> Iterator[tuple[str, list[dict], float, Callable]]:
    shapes, rows = (PROJECTIONS, [128, 4096]) if ON_GPU else ([(256, 4096)], [70])
    for n, k in shapes:
        gen = torch.Generator(device=DEVICE).manual_seed(n + k)
        w = quantize_blocks(torch.randn(n, k, device=DEVICE, generator=gen) * k**-0.5)
        for m in rows:
            sets = [
                {
                    "a": quantize_rows(torch.randn(m, k, device=DEVICE, generator=gen), 128, "fp32"),
                    "w": w,
                    "out_dtype": torch.bfloat16,
                    "bias": None,
                    "invariant": True,
                }
                for _ in range(3)
            ]
            with deepinfer.use("reference"):
                ref = ops.gemm(sets[0]["a"], w, out_dtype=torch.bfloat16)
            yield f"M={m} N={n} K={k}", sets, 2 * m * n * k, lambda out, ref=ref: error(out, ref)


def sparse_cases() -> Iterator[tuple[str, list[dict], float, Callable]]:
    """``deepinfer bench``'s sparse_mla cases but the 128k-context one (each set of that one is a 10 GB cache)."""
    for index, case in enumerate(bench._dsa_cases(quick=not ON_GPU)):
        if case.op != "sparse_mla" or case.fn is not None or "ctx=131072" in case.name:
            continue
        sets = [case.make(Gen(1000 * index + s, DEVICE)) for s in range(3)]
        for kw in sets:  # the backend's function takes the format the op infers from the cache
            kw["kv_format"] = kv_format_of(kw["kv_cache"])
        with deepinfer.use("reference"):
            ref = ops.sparse_mla(**sets[0])[0]
        yield case.name, sets, case.flops, lambda out, ref=ref: error(out[0], ref)


CASES = {"mla_decode": mla_cases, "grouped_gemm": grouped_cases, "grouped_gemm_absorbed": absorbed_cases,
         "gemm_invariant": gemm_cases, "sparse_mla": sparse_cases, "sparse_mla_gluon": sparse_cases}  # fmt: skip


@contextlib.contextmanager
def settings(spec: str):
    """Module constants of the backend changed for the duration: ``"attention.MLA_GLUON=False,..."``; ``@OTHER``
    stands for the backend's module OTHER. On entry and exit, implementation choices an enclosing
    ``dispatch.cached_choices()`` block remembered are forgotten."""
    old = []
    for item in filter(None, re.split(r",(?![^()]*\))", spec)):  # (commas inside a tuple value stay)
        name, value = item.split("=", 1)
        module_name, attr = name.rsplit(".", 1)
        module = importlib.import_module(f"deepinfer_cuda_sm100.{module_name}")
        old.append((module, attr, getattr(module, attr)))  # a misspelt name fails here
        if value.startswith("@"):
            setattr(module, attr, importlib.import_module(f"deepinfer_cuda_sm100.{value[1:]}"))
        else:
            new = ast.literal_eval(value)
            if hasattr(old[-1][2], "_fields") and isinstance(new, tuple):  # a record such as a Tile, by its fields
                new = type(old[-1][2])(*new)
            setattr(module, attr, new)
    dispatch.clear_choice_cache()
    try:
        yield
    finally:
        for module, attr, value in reversed(old):
            setattr(module, attr, value)
        dispatch.clear_choice_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("op", choices=sorted(MODULES))
    parser.add_argument("--rev", default="HEAD", help="git revision of the 'before' side (default HEAD)")
    parser.add_argument("--rounds", type=int, default=2, help="times each side is timed, alternating (default 2)")
    parser.add_argument("--eager", action="store_true", help="eager medians instead of CUDA-graph replays")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="MODULE.NAME=VALUE[,...]",
        help="a side with these backend constants changed, in place of --rev (repeatable)",
    )
    args = parser.parse_args()
    if args.op == "sparse_mla_gluon" and not args.set:
        parser.error("sparse_mla_gluon: --rev swaps sparse_attention.py only, not the Gluon kernel's module; use --set")
    deepinfer.use("cuda_sm100")
    name, function = MODULES[args.op]
    tree = importlib.import_module(f"deepinfer_cuda_sm100.{name}")
    if args.set:  # (module, settings) per side
        sides = {spec: (tree, spec) for spec in args.set} | {"tree": (tree, "")}
    else:
        sides = {args.rev: (module_at(args.rev, name), ""), "tree": (tree, "")}
    graphs = ON_GPU and not args.eager
    for label, sets, flops, check in CASES[args.op]():
        best, outs = {}, {}
        for _ in range(args.rounds):
            for side, (module, spec) in sides.items():
                fn = getattr(module, function)
                run = lambda i, fn=fn, sets=sets: fn(**sets[i])
                with settings(spec):
                    outs[side] = fn(**sets[0])
                    err = check(outs[side])
                    if graphs:
                        ms = bench.time_graph_ms(run, sets=len(sets))
                    else:  # the interpreter takes seconds per call: one timed call there
                        ms = bench.time_ms(run, DEVICE, sets=len(sets), warmup=1 if ON_GPU else 0,
                                           reps=30 if ON_GPU else 1)  # fmt: skip
                best[side] = min(best.get(side, ms), ms)
                rate = f"{flops / ms / 1e9:.0f} TFLOP/s"
                print(f"{label} | {side} | {ms:.3f} ms | {rate} | worst-row rel. error {err:.1e}", flush=True)
        tree_out = torch.utils._pytree.tree_leaves(outs["tree"])
        for side in sides:
            if side != "tree":
                same = all(torch.equal(x, y) for x, y in zip(tree_out, torch.utils._pytree.tree_leaves(outs[side])))
                print(
                    f"{label} | tree against {side}: {best[side] / best['tree']:.3f}x (best of each), "
                    f"{'same' if same else 'different'} bits",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
