"""Structured output under speculative decoding with preemption by recomputation: a sequence preempted after a
verification step resumes as a prefill, which samples one row and verifies no drafts, so its grammar masks one row
too. Each constrained request takes the tokens it takes without speculation or preemption, and still matches its
grammar (checked by llguidance's own matcher). Runs on ``--deepinfer-backend`` / ``--deepinfer-device`` (the
reference backend on the CPU by default)."""

from __future__ import annotations

import json

import llguidance
from model_helpers import one_thread  # noqa: F401 (autouse)

import deepinfer
from deepinfer.model import LLM, SamplingParams
from deepinfer.model.structured_output import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "size": {"type": "integer", "minimum": 0, "maximum": 1000},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "size", "tags"],
    "additionalProperties": False,
}
REGEX = r"(0|[1-9][0-9]{0,3})\.[0-9]{2} (KB|MB)"
PROMPTS = ["def describe(path):\n    return ", "SIZE = '", "if flag is ", "import os\n\nCONFIG = "]


def test_recomputed_sequences_keep_their_constrained_tokens_under_speculation(deepinfer_backend, deepinfer_device):
    """6 constrained requests (greedy and sampled) in a cache of 6 pages of 16 tokens, 3 drafts a step."""
    constraints = [("json_schema", json.dumps(SCHEMA)), ("regex", REGEX)]
    params = [
        SamplingParams(
            max_tokens=64,
            temperature=[0.0, 1.0][i % 2],
            seed=i,
            structured_outputs=StructuredOutputsParams(json=SCHEMA)
            if i % 2 == 0
            else StructuredOutputsParams(regex=REGEX),
        )
        for i in range(6)
    ]
    prompts = [PROMPTS[i % 4] for i in range(6)]
    with deepinfer.batch_invariant():
        plain = LLM(
            None, deepinfer_backend, device=deepinfer_device, progress=False, enable_prefix_caching=False
        ).generate(prompts, params)
        llm = LLM(
            None,
            deepinfer_backend,
            device=deepinfer_device,
            progress=False,
            block_size=16,
            num_blocks=6,
            preemption_mode="recompute",
            speculative_config={"num_speculative_tokens": 3},
        )
        fast = llm.generate(prompts, params)
    assert llm.engine.num_preemptions > 0
    assert llm.last_stats["speculative"]["drafted"] > 0
    tokenizer = llguidance.LLTokenizer(
        (llm.path / "tokenizer.json").read_text(),
        n_vocab=llm.config.vocab_size,
        eos_token=list(llm.config.eos_token_ids),
    )
    for i, (a, b) in enumerate(zip(plain, fast)):
        out = b.outputs[0]
        assert out.token_ids == a.outputs[0].token_ids, i
        assert out.finish_reason == "stop", (i, out.text)
        fmt, text = constraints[i % 2]
        matcher = llguidance.LLMatcher(tokenizer, llguidance.grammar_from(fmt, text))
        assert all(matcher.consume_token(t) for t in out.token_ids), (i, out.text)
        assert matcher.is_accepting(), (i, out.text)
