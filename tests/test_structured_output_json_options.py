"""A JSON schema's own llguidance options (``x-guidance``) are kept beside the engine's default of no free
whitespace: a schema that sets another option (``coerce_one_of``, which llguidance's error for a ``oneOf`` asks for)
still gets the separators alone between tokens, and only one that turns ``whitespace_flexible`` on gets free
whitespace. Runs on ``--deepinfer-backend`` / ``--deepinfer-device`` (the reference backend on the CPU by default)."""

from __future__ import annotations

import json

import pytest
from model_helpers import one_thread  # noqa: F401 (autouse)

from deepinfer.model import LLM, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"oneOf": [{"enum": ["file", "dir"]}, {"enum": ["link"]}]},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["kind", "size"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(deepinfer_backend, deepinfer_device):
    return LLM(None, deepinfer_backend, device=deepinfer_device, progress=False)


@pytest.mark.parametrize(
    "options, free",
    [(None, False), ({"coerce_one_of": True}, False), ({"coerce_one_of": True, "whitespace_flexible": True}, True)],
)
def test_whitespace_after_a_brace_follows_the_schema_s_options(llm, options, free):
    # (without coerce_one_of llguidance refuses the oneOf: the schema here holds the integer alone)
    schema = {**SCHEMA, "properties": {"size": SCHEMA["properties"]["size"]}, "required": ["size"]}
    if options is not None:
        schema["x-guidance"] = options
    matcher = llm._matcher(SamplingParams(structured_outputs={"json": schema}))
    brace = next(t for t in range(llm.config.vocab_size) if llm.tokenizer.decode([t]) == "{")
    assert matcher.consume_token(brace)
    spaces = [t for t in range(llm.config.vocab_size) if llm.tokenizer.decode([t]) in (" ", "\n", "  ")]
    assert spaces
    for t in spaces:
        taken = matcher.try_consume_tokens([t]) == 1
        if taken:
            matcher.rollback(1)
        assert taken == free, (t, options)


def test_a_schema_with_options_of_its_own_is_generated_compact(llm):
    schema = {**SCHEMA, "x-guidance": {"coerce_one_of": True}}
    params = [
        SamplingParams(max_tokens=48, temperature=1.0, seed=s, structured_outputs={"json": schema}) for s in range(6)
    ]
    for out in llm.generate(["x = ", "import os\n\nCONFIG = ", "def f():\n    return "] * 2, params):
        out = out.outputs[0]
        assert out.finish_reason == "stop", out.text
        value = json.loads(out.text)
        assert value["kind"] in ("file", "dir", "link") and 0 <= value["size"] <= 999
        assert out.text == json.dumps(value, separators=(",", ":")), out.text
