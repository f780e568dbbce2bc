"""A JSON schema constrains an object's properties to the order the schema declares them, as the schema's own
grammar (llguidance's, compiled from the schema as given) does and OpenAI's structured outputs promise: a schema
whose properties are not in alphabetical order gets them in its order, not sorted. Runs on ``--deepinfer-backend``
/ ``--deepinfer-device`` (the reference backend on the CPU by default)."""

from __future__ import annotations

import json

import llguidance
import pytest
from model_helpers import one_thread  # noqa: F401 (autouse)

from deepinfer.model import LLM, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "zeta": {"type": "integer", "minimum": 0, "maximum": 999},
        "alpha": {"type": "string", "maxLength": 6},
        "mid": {"type": "boolean"},
    },
    "required": ["zeta", "alpha", "mid"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(deepinfer_backend, deepinfer_device):
    return LLM(None, deepinfer_backend, device=deepinfer_device, progress=False)


@pytest.mark.parametrize("as_text", [False, True], ids=["dict", "text"])
def test_properties_come_in_the_schema_s_order(llm, as_text):
    tokenizer = llguidance.LLTokenizer(
        (llm.path / "tokenizer.json").read_text(),
        n_vocab=llm.config.vocab_size,
        eos_token=list(llm.config.eos_token_ids),
    )
    schema = json.dumps(SCHEMA) if as_text else SCHEMA
    prompts = ["x = ", "import os\n\nCONFIG = ", "def f():\n    return "]
    params = [
        SamplingParams(max_tokens=48, temperature=t, seed=s, structured_outputs={"json": schema})
        for t, s in [(0.0, 0), (1.0, 1), (1.0, 2)]
    ]
    for out in llm.generate(prompts, params):
        out = out.outputs[0]
        assert out.finish_reason == "stop", out.text
        assert list(json.loads(out.text)) == ["zeta", "alpha", "mid"], out.text
        matcher = llguidance.LLMatcher(tokenizer, llguidance.grammar_from("json_schema", json.dumps(SCHEMA)))
        assert all(matcher.consume_token(t) for t in out.token_ids) and matcher.is_accepting(), out.text
