"""Structured output on the embedded trained model: every constrained completion parses and validates against its
JSON schema, fully matches its regex or is one of its choices; an unconstrained request batched with constrained
ones gets the tokens it gets alone; bad constraints are refused at submission; preemption and both scheduling modes
keep the constraint."""

from __future__ import annotations

import json
import re

import pytest
from model_helpers import one_thread  # noqa: F401 (autouse fixture)

import deepinfer
from deepinfer.model import LLM, RequestError, SamplingParams
from deepinfer.model.structured_output import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "size": {"type": "integer", "minimum": 0, "maximum": 1000},
        "kind": {"enum": ["file", "dir", "link"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "size", "kind", "tags"],
    "additionalProperties": False,
}
REGEX = r"(0|[1-9][0-9]{0,3})\.[0-9]{2} (KB|MB)"
CHOICES = ["True", "False", "None", "NotImplemented"]


def validate(value: dict) -> None:
    """The schema above, checked by hand (no schema library is a dependency)."""
    assert set(value) == {"name", "size", "kind", "tags"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert isinstance(value["size"], int) and 0 <= value["size"] <= 1000
    assert value["kind"] in ("file", "dir", "link")
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3
    assert all(isinstance(t, str) and len(t) <= 8 for t in value["tags"])


def constrained(kind: str, seed: int, temperature: float = 1.0) -> SamplingParams:
    so = {"json": StructuredOutputsParams(json=SCHEMA), "regex": StructuredOutputsParams(regex=REGEX)}
    so["choice"] = StructuredOutputsParams(choice=CHOICES)
    return SamplingParams(max_tokens=96, temperature=temperature, seed=seed, structured_outputs=so[kind])


def check(kind: str, text: str) -> None:
    if kind == "json":
        validate(json.loads(text))
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


@pytest.fixture(scope="module")
def llm():
    return LLM(progress=False)


PROMPTS = ["def describe(path):\n    return ", "SIZE = '", "if flag is ", "import os\n\nCONFIG = "]


def test_every_constrained_output_is_valid(llm):
    """Sampled at temperature 1 with 8 seeds per kind (and greedy), on different prompts, all in one batch."""
    kinds = ["json", "regex", "choice"]
    requests = [
        (k, p, constrained(k, seed)) for k in kinds for seed in range(8) for p in PROMPTS[seed % 4 : seed % 4 + 1]
    ]
    requests += [(k, PROMPTS[0], constrained(k, 0, temperature=0.0)) for k in kinds]
    outs = llm.generate([p for _, p, _ in requests], [sp for _, _, sp in requests])
    for (kind, _, _), out in zip(requests, outs):
        assert out.outputs[0].finish_reason == "stop", (kind, out.outputs[0].text)
        check(kind, out.outputs[0].text)


def test_unconstrained_neighbours_are_unchanged(llm):
    with deepinfer.batch_invariant():
        free = [SamplingParams(max_tokens=24, temperature=0.8, seed=s) for s in (3, 4)]
        alone = llm.generate(PROMPTS[:2], free)
        mixed = llm.generate(
            [PROMPTS[2], PROMPTS[0], PROMPTS[3], PROMPTS[1]],
            [constrained("json", 1), free[0], constrained("regex", 2), free[1]],
        )
    assert mixed[1].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert mixed[3].outputs[0].token_ids == alone[1].outputs[0].token_ids
    check("json", mixed[0].outputs[0].text)
    check("regex", mixed[2].outputs[0].text)


@pytest.mark.parametrize(
    "so, message",
    [
        (dict(regex="(unclosed"), "invalid regex"),
        (dict(json='{"type": "object", "properties": '), "invalid json_schema"),
        (dict(grammar="start: undefined_rule"), "invalid grammar"),
    ],
)
def test_a_bad_constraint_is_refused_at_submission_and_nothing_is_queued(llm, so, message):
    params = [SamplingParams(max_tokens=4, temperature=0), SamplingParams(max_tokens=4, structured_outputs=so)]
    with pytest.raises(RequestError, match=message):
        llm.generate(["x = 1", "y = 2"], params)
    assert not llm.engine.has_unfinished()
    assert llm.generate("x = 1", params[0])[0].outputs[0].token_ids  # still usable


@pytest.mark.parametrize("given", [{}, {"regex": "a", "choice": ["a"]}, {"choice": []}, {"choice": "ab"}, {"json": 3}])
def test_structured_outputs_params_need_exactly_one_valid_constraint(given):
    with pytest.raises(RequestError, match="StructuredOutputsParams"):
        StructuredOutputsParams(**given)


def test_a_dict_is_taken_as_structured_outputs_params():
    params = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert params.structured_outputs == StructuredOutputsParams(regex="[0-9]+")


def test_speculative_decoding_keeps_every_constrained_token(llm):
    """With MTP drafts verified under the grammar (each verification row masked by what the grammar allows after
    the drafts before it, the matcher rolled back), constrained requests take the tokens they take without
    speculation, and still validate."""
    spec = LLM(progress=False, speculative_config={"num_speculative_tokens": 3})
    cases = [("json", 0.0), ("regex", 1.0), ("choice", 0.0), ("json", 1.0), ("regex", 0.0), ("choice", 1.0)]
    requests = [(k, PROMPTS[i % 4], constrained(k, i, temperature=t)) for i, (k, t) in enumerate(cases)]
    prompts, params = [p for _, p, _ in requests], [sp for _, _, sp in requests]
    with deepinfer.batch_invariant():
        plain = llm.generate(prompts, params)
        fast = spec.generate(prompts, params)
    for (kind, _, _), a, b in zip(requests, plain, fast):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, kind
        check(kind, b.outputs[0].text)
    stats = spec.last_stats["speculative"]
    assert stats["accepted"] > 0 and stats["drafted"] > stats["accepted"], stats


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_constraints_hold_under_preemption_in_both_scheduling_modes(async_scheduling):
    """A cache of 6 pages of 16 tokens for 6 requests: sequences are preempted (recomputed) and resumed."""
    llm = LLM(progress=False, block_size=16, num_blocks=6, async_scheduling=async_scheduling)
    kinds = ["json", "regex", "choice"] * 2
    outs = llm.generate([PROMPTS[i % 4] for i in range(6)], [constrained(k, i) for i, k in enumerate(kinds)])
    assert llm.engine.num_preemptions > 0
    for kind, out in zip(kinds, outs):
        assert out.outputs[0].finish_reason == "stop", (kind, out.outputs[0].text)
        check(kind, out.outputs[0].text)


def test_generate_takes_a_constraint_and_reports_a_bad_one_in_one_line(capsys):
    from deepinfer import cli

    assert cli.main(["generate", "--prompt", "x = ", "--choice", "yes", "no", "--temperature", "1", "--seed", "2"]) == 0
    out = capsys.readouterr().out
    assert "x = yes" in out or "x = no" in out, out
    assert cli.main(["generate", "--prompt", "x = ", "--regex", "("]) == 2
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: structured output: invalid regex"), lines
