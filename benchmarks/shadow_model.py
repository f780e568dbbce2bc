"""Runs a tiny FP8 DeepSeek-V3 checkpoint on a backend while shadowing every op call with the reference on the same
inputs, and prints each op whose result differs by more than a threshold (worst-row relative error).

Usage: python3 benchmarks/shadow_model.py BACKEND DEVICE DTYPE KV_FORMAT (needs transformers to write the checkpoint)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from model_helpers import fp8_copy, hf_checkpoint
from test_model_vs_transformers import FP8_SHAPES

import deepinfer.ops  # noqa: F401  (loads every op module)
from deepinfer import dispatch
from deepinfer.conformance.cases import error
from deepinfer.kv_cache import read_tokens
from deepinfer.model import LLM, SamplingParams


def main() -> int:
    backend, device, dtype, kv_format = sys.argv[1:5]
    root = Path(tempfile.mkdtemp())
    path, _ = fp8_copy(hf_checkpoint(root / "bf16", 3, **FP8_SHAPES), root / "fp8", root / "oracle")
    counts: dict = {}

    def shadow(op, **kw):
        impl, fallback = dispatch.resolve(op, kw)
        if op == "write_kv_cache":
            before = kw["kv_cache"].clone()
            dispatch.reference_impl(op).fn(**{**kw, "kv_cache": before})
            impl.fn(**kw)
            slots = kw["slot_mapping"][kw["slot_mapping"] >= 0]
            out = read_tokens(kw["kv_cache"], slots, kw["kv_lora_rank"])
            ref = read_tokens(before, slots, kw["kv_lora_rank"])
            result = None
        else:
            result = out = impl.fn(**kw)
            ref = dispatch.reference_impl(op).fn(**kw)
            if op == "moe_route":
                out, ref = [(w.gather(1, i.argsort(-1)), i.sort(-1).values) for w, i in (out, ref)]
        if op not in ("ep_dispatch",):
            err = error(out, ref)
            key = (op, impl.provider, fallback)
            counts.setdefault(key, [0, 0.0])
            counts[key][0] += 1
            counts[key][1] = max(counts[key][1], err)
        return result

    for name, module in list(sys.modules.items()):
        if name.startswith("deepinfer.ops.") and getattr(module, "call", None) is dispatch.call:
            module.call = shadow
    llm = LLM(
        path,
        backend,
        device=device,
        block_size=8,
        prefill_chunk_size=16,
        max_num_batched_tokens=64,
        progress=False,
        dtype=dtype,
        kv_format=kv_format,
    )
    prompts = [
        [int(t) for t in torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n))] for n in (13, 1, 29)
    ]
    out = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for (op, provider, fallback), (n, worst) in sorted(counts.items()):
        print(f"{op:18s} {provider:24s} fallback={fallback!s:5s} calls={n:4d} worst rel err={worst:.2e}")
    print("tokens", [o.outputs[0].token_ids for o in out])
    return 0


if __name__ == "__main__":
    sys.exit(main())
