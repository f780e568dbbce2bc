"""Structured output on the embedded trained model: every constrained completion parses and validates against its
JSON schema, fully matches its regex or is one of its choices; an unconstrained request batched with constrained
ones gets the tokens it gets alone; bad constraints are refused at submission; preemption and both scheduling modes
keep the constraint. Also: the masks against llguidance's own ``compute_bitmask``, the compiled-matcher cache, the
``error`` finish reason of a matcher that refuses a token, a random small checkpoint, and the server's engine loop
(``AsyncEngine``) never compiling a constraint on its own thread. Runs on ``--deepinfer-backend`` /
``--deepinfer-device`` (the reference backend on the CPU by default)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import sys
import threading

import pytest
import torch
from model_helpers import one_thread, replay_graphs_on_cpu, small_checkpoint  # noqa: F401 (one_thread: autouse)

import deepinfer
from deepinfer.model import LLM, RequestError, SamplingParams
from deepinfer.model import model_runner as model_runner_module
from deepinfer.model.async_engine import AsyncEngine
from deepinfer.model.structured_output import Grammars, StructuredOutputsParams, allowed_tokens

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
def llm(deepinfer_backend, deepinfer_device):
    return LLM(None, deepinfer_backend, device=deepinfer_device, progress=False)


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


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_speculative_decoding_keeps_every_constrained_token(
    llm, deepinfer_backend, deepinfer_device, graphs, monkeypatch
):
    """With MTP drafts verified under the grammar (each verification row masked by what the grammar allows after
    the drafts before it, the matcher rolled back), constrained requests take the tokens they take without
    speculation, and still validate; also through the CUDA-graph decode path (each replay run eagerly), whose MTP
    graphs compute no draft probabilities without a confidence threshold while the drafts are read on the host."""
    replayed = replay_graphs_on_cpu(monkeypatch) if graphs else []
    cases = [("json", 0.0), ("regex", 1.0), ("choice", 0.0), ("json", 1.0), ("regex", 0.0), ("choice", 1.0)]
    requests = [(k, PROMPTS[i % 4], constrained(k, i, temperature=t)) for i, (k, t) in enumerate(cases)]
    prompts, params = [p for _, p, _ in requests], [sp for _, _, sp in requests]
    with deepinfer.batch_invariant():  # (graphs replay in the mode they were captured in)
        spec = LLM(
            None,
            deepinfer_backend,
            device=deepinfer_device,
            progress=False,
            speculative_config={"num_speculative_tokens": 3},
        )
        plain = llm.generate(prompts, params)
        fast = spec.generate(prompts, params)
    for (kind, _, _), a, b in zip(requests, plain, fast):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, kind
        check(kind, b.outputs[0].text)
    stats = spec.last_stats["speculative"]
    assert stats["accepted"] > 0 and stats["drafted"] > stats["accepted"], stats
    assert bool(replayed) == graphs


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_constraints_hold_under_preemption_in_both_scheduling_modes(
    async_scheduling, deepinfer_backend, deepinfer_device
):
    """A cache of 6 pages of 16 tokens for 6 requests: sequences are preempted (recomputed) and resumed."""
    llm = LLM(
        None,
        deepinfer_backend,
        device=deepinfer_device,
        progress=False,
        block_size=16,
        num_blocks=6,
        async_scheduling=async_scheduling,
    )
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


# --- masks, the compiled-matcher cache, the error finish reason ---


def grammars_of(llm: LLM) -> Grammars:
    llm._matcher(SamplingParams(structured_outputs={"regex": "a"}))
    return llm._grammars


def llguidance_mask(m, words: int) -> torch.Tensor:
    """The oracle: llguidance's own bitmask of a matcher (its bytes, one bit per token)."""
    return torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.int32)[:words]


def test_masks_are_llguidance_s_own_after_random_valid_tokens_and_drafts(llm):
    """Each matcher advanced by a random number of tokens its grammar allows (drawn from llguidance's own mask), with
    up to 3 drafts (some the grammar refuses): every row of ``allowed_tokens`` is ``compute_bitmask`` after the
    drafts before it, rows past a refused draft repeat the last, and every matcher is left where it was."""
    vocab = llm.config.vocab_size
    words = (vocab + 31) // 32
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))

    def allowed(m) -> list[int]:
        bits = llguidance_mask(m, words)
        return [t for t in range(vocab) if (int(bits[t // 32]) >> (t % 32)) & 1]

    cases = []
    for kind in ["json", "regex", "choice"] * 3:
        m = grammars_of(llm).matcher(constrained(kind, 0).structured_outputs)
        for _ in range(rng.randrange(0, 6)):
            options = [t for t in allowed(m) if t not in llm.config.eos_token_ids]
            if not options:
                break
            assert m.consume_token(rng.choice(options))
        drafts, probe = [], m.deep_copy()
        for _ in range(rng.randrange(0, 4)):
            options = [] if probe.is_error() else allowed(probe)
            drafts.append(rng.choice(options) if options and rng.random() < 0.7 else rng.randrange(vocab))
            probe.consume_token(drafts[-1])  # a refused draft leaves the probe in error: later drafts are random
        cases.append((m, drafts))
    before = [llguidance_mask(m, words) for m, _ in cases]
    mask = allowed_tokens(cases, vocab)
    row = 0
    for (m, drafts), was in zip(cases, before):
        assert torch.equal(llguidance_mask(m, words), was), "the matcher was not rolled back"
        expected, probe = [was], m.deep_copy()
        for token in drafts:
            ok = not probe.is_stopped() and probe.try_consume_tokens([token]) == 1
            expected.append(llguidance_mask(probe, words) if ok else expected[-1])
            if not ok:
                expected += [expected[-1]] * (len(drafts) + 1 - len(expected))
                break
        assert torch.equal(mask[row : row + 1 + len(drafts)], torch.stack(expected)), (row, drafts)
        row += 1 + len(drafts)
    assert row == mask.shape[0]


def test_a_constraint_compiles_once_and_each_request_gets_a_matcher_of_its_own(llm, monkeypatch):
    calls = []
    compile_ = Grammars._compile

    def spy(self, fmt, text):
        calls.append(fmt)
        return compile_(self, fmt, text)

    monkeypatch.setattr(Grammars, "_compile", spy)
    so = StructuredOutputsParams(regex=f"x{random.randrange(10**6)}[0-9]+")  # a constraint not compiled before
    first = grammars_of(llm).matcher(so)
    words = (llm.config.vocab_size + 31) // 32
    fresh = llguidance_mask(first, words)
    token = next(t for t in range(llm.config.vocab_size) if (int(fresh[t // 32]) >> (t % 32)) & 1)
    assert first.consume_token(token)
    assert not torch.equal(llguidance_mask(first, words), fresh)
    second = grammars_of(llm).matcher(so)
    assert calls == ["regex"], calls
    assert torch.equal(llguidance_mask(second, words), fresh), "a request's tokens reached the cached matcher"
    assert second is not first


def test_a_matcher_that_refuses_its_token_ends_the_request_with_error(llm, monkeypatch):
    """A planted sampler: the mask handed to the sampler is the grammar's inverted, so every token sampled for the
    constrained request is one its grammar refuses. It ends at once with ``error`` and the grammar's message; its
    unconstrained neighbour is untouched; the constrained request alone, unplanted, ends with ``stop``."""
    real = model_runner_module.allowed_tokens
    monkeypatch.setattr(model_runner_module, "allowed_tokens", lambda *a, **k: ~real(*a, **k))
    free = SamplingParams(max_tokens=6, temperature=0)
    outs = llm.generate([PROMPTS[1], PROMPTS[0]], [constrained("regex", 3), free])
    bad = outs[0].outputs[0]
    assert bad.finish_reason == "error", bad
    assert len(bad.token_ids) == 1
    assert isinstance(bad.stop_reason, str) and bad.stop_reason.startswith("structured output: "), bad.stop_reason
    assert "\n" not in bad.stop_reason
    monkeypatch.undo()
    assert outs[1].outputs[0].token_ids == llm.generate(PROMPTS[0], free)[0].outputs[0].token_ids
    assert llm.generate(PROMPTS[1], constrained("regex", 3))[0].outputs[0].finish_reason == "stop"


# --- a random small checkpoint (byte-level tokenizer) ---


@pytest.fixture(scope="module")
def small(tmp_path_factory, deepinfer_backend, deepinfer_device):
    path = small_checkpoint(tmp_path_factory.mktemp("small"), seed=int.from_bytes(os.urandom(2), "little"))
    return LLM(path, deepinfer_backend, device=deepinfer_device, dtype="float32", progress=False, block_size=8)


@pytest.mark.parametrize("kind", ["choice", "regex"])
def test_a_random_checkpoint_keeps_choices_and_regexes(small, kind):
    """Random weights give no preference for the grammar's tokens: every completion is held to it by the masks
    alone. Both constraints are bounded, so each ends with ``stop`` well within ``max_tokens``."""
    seed = int.from_bytes(os.urandom(2), "little")
    params = [constrained(kind, seed + i) for i in range(12)] + [constrained(kind, 0, temperature=0.0)]
    prompts = [[random.Random(seed + i).randrange(3, 200) for _ in range(1 + i % 5)] for i in range(len(params))]
    for out in small.generate(prompts, params):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0]
        check(kind, out.outputs[0].text)


# --- the server's engine loop ---


def big_schema(rng: random.Random) -> dict:
    """A JSON schema of 40 properties of mixed types, nested objects and arrays, with random names (so each is a
    constraint of its own)."""
    kinds = [
        {"type": "integer", "minimum": 0, "maximum": 10**6},
        {"type": "string", "maxLength": 16},
        {"enum": ["a", "b", "c", "d"]},
        {"type": "array", "items": {"type": "number"}, "maxItems": 5},
        {"type": "object", "properties": {"x": {"type": "boolean"}, "y": {"type": "string"}}, "required": ["x"]},
    ]
    props = {f"p{rng.randrange(10**9)}_{i}": kinds[i % len(kinds)] for i in range(40)}
    return {"type": "object", "properties": props, "required": list(props)[:20], "additionalProperties": False}


def test_the_engine_loop_never_compiles_a_constraint(deepinfer_backend, deepinfer_device, monkeypatch):
    """One free request streams in an ``AsyncEngine`` while 6 large JSON schemas (each new) are submitted: every
    compilation (``Grammars._compile``) and every matcher built for a request (``LLM._matcher``) runs on the
    compiling threads, never on the engine's loop thread, so the running stream never waits for one; the constrained
    requests still run under their grammars."""
    llm = LLM(None, deepinfer_backend, device=deepinfer_device, progress=False)
    threads: list[threading.Thread] = []
    compile_, matcher_ = Grammars._compile, llm._matcher

    def spy_compile(self, fmt, text):
        threads.append(threading.current_thread())
        return compile_(self, fmt, text)

    def spy_matcher(params):
        threads.append(threading.current_thread())
        return matcher_(params)

    monkeypatch.setattr(Grammars, "_compile", spy_compile)
    monkeypatch.setattr(llm, "_matcher", spy_matcher)
    engine = AsyncEngine(llm)
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    schemas = [big_schema(rng) for _ in range(6)]

    async def collect(stream) -> tuple[str, str | None]:
        text, reason = "", None
        async for d in stream:
            text, reason = text + d.text, d.finish_reason
        return text, reason

    async def main():
        free = await engine.submit(
            [1, 2, 3, 4], SamplingParams(max_tokens=48, temperature=0, ignore_eos=True), "free", None
        )
        first = await free.__anext__()  # the free request is running
        submitted = [
            engine.submit(
                [5, 6, 7],
                SamplingParams(max_tokens=16, temperature=1.0, seed=i, structured_outputs={"json": schema}),
                f"json{i}",
                None,
            )
            for i, schema in enumerate(schemas)
        ]
        streams = await asyncio.gather(*submitted)
        outs = await asyncio.gather(collect(free), *(collect(s) for s in streams))
        return first, outs

    try:
        first, outs = asyncio.run(main())
    finally:
        engine.shutdown()
    assert first.token_ids and outs[0][1] == "length"
    compiled = [t for t in threads if t is not engine._thread]
    assert len(threads) >= 12 and compiled == threads, {t.name for t in threads}
    assert all(t.name.startswith("deepinfer-grammar") for t in threads), {t.name for t in threads}
    for text, reason in outs[1:]:
        assert reason in ("stop", "length") and text.startswith('{"p'), text


def test_a_constrained_step_does_not_import_llguidance_s_torch_module(deepinfer_backend, deepinfer_device):
    """``llguidance.torch`` compiles its kernel with ``torch.compile`` on import (seconds, on the first constrained
    step): the masks are filled without it. A fresh process, so no earlier test's imports count."""
    code = (
        "import sys\n"
        "from deepinfer.model import LLM, SamplingParams\n"
        f"llm = LLM(None, {deepinfer_backend!r}, device={deepinfer_device!r}, progress=False)\n"
        "out = llm.generate('n = ', SamplingParams(max_tokens=8, structured_outputs={'regex': '[0-9]{3}'}))[0]\n"
        "assert out.outputs[0].finish_reason == 'stop', out\n"
        "print(sorted(m for m in sys.modules if m.startswith('llguidance')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    loaded = done.stdout.strip().splitlines()[-1]
    assert "'llguidance'" in loaded and "llguidance.torch" not in loaded, loaded
