"""Finds which op makes the model disagree with transformers on a backend: runs the cross-check configurations of
``tests/test_model_vs_transformers.py`` with chosen ops forced to the reference, and prints the worst prompt and
generated log-probability errors against transformers (fp32, CPU) and the greedy mismatches of each variant.

Usage: python3 benchmarks/bisect_model.py BACKEND DEVICE [quick|fp8] (needs transformers 5.24; quick: no forced
ops; fp8: the FP8 checkpoint only, on the reference, on BACKEND, and with each GEMM op forced to the reference)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from model_helpers import fp8_activations, fp8_copy, hf_checkpoint, load_oracle, random_prompts
from test_model_vs_transformers import CONFIGS, FP8_SEED, FP8_SHAPES, LENGTHS, compare, make_llm, run

from deepinfer import dispatch

OPS = ("gemm", "grouped_gemm", "quantize_fp8", "mla_decode", "attention_varlen", "write_kv_cache", "moe_route",
       "ep_dispatch", "ep_combine", "rms_norm", "rope", "silu_and_mul", "sample")  # fmt: skip
_resolve = dispatch.resolve


def forcing(ops: set[str]):
    def resolve(op, kwargs, backend=None):
        return (dispatch.reference_impl(op), True) if op in ops else _resolve(op, kwargs, backend)

    return resolve


def errors(llm, oracle, prompts, **kw) -> str:
    outs = run(llm, prompts)
    p, g, mism = compare(oracle, prompts, outs, **kw)
    median = torch.tensor(p).median()
    return f"prompt max {max(p):.2e} median {median:.1e}  gen max {max(g):.2e}  mismatches {len(mism)}"


def main() -> int:
    backend, device = sys.argv[1:3]
    root = Path(tempfile.mkdtemp())
    v3 = hf_checkpoint(root / "v3", 11, **CONFIGS["v3"])
    fp8, fp8_oracle = fp8_copy(hf_checkpoint(root / "bf16", FP8_SEED, **FP8_SHAPES), root / "fp8", root / "oracle")
    cases = {
        "fp32": (v3, load_oracle(v3), dict(kv_format="bf16")),
        "fp8": (
            fp8,
            (o := load_oracle(fp8_oracle)),
            dict(
                kv_format="bf16",
                prefill=lambda: fp8_activations(o, False, kv_b=True),
                decode=lambda: fp8_activations(o, False, kv_b=False),
            ),
        ),
    }
    mode = sys.argv[3] if len(sys.argv) > 3 else "all"
    but = lambda ops: [(f"{backend} but {op} ref", backend, device, {op}) for op in ops]
    variants = [("reference", "reference", device, set()), (f"{backend}", backend, device, set())]
    if mode == "fp8":
        cases.pop("fp32")
        variants += but(("gemm", "grouped_gemm"))
    elif mode != "quick":
        variants.insert(0, ("reference on cpu", "reference", "cpu", set()))
        variants += but(OPS) + [(f"{backend} only {op}", backend, device, set(OPS) - {op}) for op in OPS]
    for case, (path, oracle, kw) in cases.items():
        prompts = random_prompts(oracle.config.vocab_size, LENGTHS, seed=5)
        for label, name, dev, forced in variants:
            dispatch.resolve = forcing(forced)
            try:
                llm = make_llm(path, name, dev, dtype="float32", enforce_eager=True)
                print(f"{case:5s} {label:36s} {errors(llm, oracle, prompts, **kw)}", flush=True)
            except Exception as e:  # a diagnostic: report and go on
                print(f"{case:5s} {label:36s} failed: {type(e).__name__}: {e}", flush=True)
            finally:
                dispatch.resolve = _resolve
    return 0


if __name__ == "__main__":
    sys.exit(main())
