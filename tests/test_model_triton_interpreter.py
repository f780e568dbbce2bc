"""The model on the ``cuda_sm100`` Triton kernels through the Triton interpreter (CPU): the tests fast enough there
(a bf16 cross-check against transformers, chunked against unchunked prefill, the embedded trained model's
log-probabilities of held-out text against the reference backend, a short prompt as decode rows in the decode
graphs), in a child process (the interpreter
must be chosen before triton is imported). Every op runs on its Triton kernel, the products the backend leaves to
cuBLAS on the device included (the router's fp32 GEMM among them). The whole model suite runs on the device with
``--deepinfer-backend cuda_sm100``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
# The dense configuration: under the interpreter's truncating bf16 conversions, near-tied MoE routing decisions flip
# often enough to make the MoE statistics noisy; those configurations run on the device.
SELECTION = (
    "test_bf16_logprobs_as_close_as_transformers_bf16 and dense or test_chunked_prefill_equals_unchunked"
    " or test_backend_logprobs_match_the_reference"
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_cross_checks_pass_on_the_triton_kernels():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("DEEPINFER_ACCELERATOR", None)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        str(HERE / "test_model_vs_transformers.py"),
        str(HERE / "test_model_engine.py"),
        str(HERE / "test_embedded_model.py"),
        "-k",
        SELECTION,
        "--deepinfer-backend",
        "cuda_sm100",
        "--deepinfer-device",
        "cpu",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=HERE.parent, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "3 passed" in run.stdout, run.stdout[-2000:]


SHORT_PROMPT = """
import sys
sys.path.insert(0, "tests")
from _pytest.monkeypatch import MonkeyPatch
from model_helpers import random_prompts, replay_graphs_on_cpu
from deepinfer.model import LLM, SamplingParams

first = SamplingParams(max_tokens=24, temperature=0.0)
scored = SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=0)
reference = LLM(backend="reference", progress=False, enforce_eager=True)
(start,) = random_prompts(4096, [12], seed=5)
prompt = start + reference.generate([start], first)[0].outputs[0].token_ids  # mostly the model's own choices
reference.engine.scheduler.decode_row_tokens = 128
want = reference.generate([prompt], scored)[0]
eager = LLM(backend="cuda_sm100", device="cpu", progress=False, enforce_eager=True, max_num_seqs=2)
eager.engine.scheduler.decode_row_tokens = 128
rows = eager.generate([prompt], scored)[0]
replayed = replay_graphs_on_cpu(MonkeyPatch())
graphs = LLM(backend="cuda_sm100", device="cpu", progress=False, max_num_seqs=2)
got = graphs.generate([prompt], scored)[0]
assert replayed[0][0] == 64, replayed[:3]  # the 36 prompt rows in one replay
assert got.prompt_logprobs == rows.prompt_logprobs, "the graph path differs from eager decode rows"
assert got.outputs[0].token_ids == want.outputs[0].token_ids
likely = [(g, w) for g, w in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]) if w > -5]
gap = max(abs(g - w) for g, w in likely)
assert len(likely) >= 20 and gap < 0.15, (len(likely), gap)
print("ok", len(likely), gap)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_a_short_prompt_runs_as_decode_rows_on_the_triton_kernels():
    """A short prompt (``engine.SHORT_PROMPT_TOKENS``) as decode rows inside the decode graphs (each replay run
    eagerly), on the Triton kernels: bitwise eager decode rows, the reference's tokens, and the reference's
    prompt log-probabilities on the tokens the model finds likely (within what the interpreter's truncating bf16
    conversions allow; its random first tokens, at log-probabilities of -8 to -19, are left out)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("DEEPINFER_ACCELERATOR", None)
    env.pop("DEEPINFER_BATCH_INVARIANT", None)
    run = subprocess.run(
        [sys.executable, "-c", SHORT_PROMPT], capture_output=True, text=True, env=env, cwd=HERE.parent, timeout=600
    )
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
