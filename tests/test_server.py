"""``deepinfer serve``: a real server (uvicorn in a thread, on a free localhost port) over the embedded model, driven by
the official ``openai`` client and by raw HTTP.

The oracle of every generated text is the offline API (``LLM.generate``) on a second ``LLM`` of the same checkpoint:
greedy requests through the server, alone or concurrent, streamed or not, must give exactly its tokens and text (the
reference backend's ops are batch-invariant, so a request's tokens do not depend on what runs beside it). Also here:
``LLMEngine.abort`` (one request ended, its pages back) and ``RequestStream``'s stop strings, chat templates, and the
load-test script.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

import deepinfer
from deepinfer.model import LLM, SamplingParams
from deepinfer.model.chat_template import ChatTemplate, ChatTemplateError
from deepinfer.model.sequence import Status
from deepinfer.model.server import build_app, make_server

try:  # the HTTP client the openai package is built on
    import httpx2 as httpx
except ImportError:
    import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import serve_load  # noqa: E402

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}# assistant:{% endif %}"
)
MAX_LEN = 512
NUM_BLOCKS = 64
BLOCK = 16
CHUNK = 32  # prefix-cache hits come in whole chunks
PROMPTS = [
    "def fibonacci(n):",
    "import os\n",
    "class Parser:\n    def",
    "# Copyright",
    "for i in range(",
    "x = [",
    "if",
]


def llm_kwargs():
    return {
        "dtype": "float32",
        "max_model_len": MAX_LEN,
        "num_blocks": NUM_BLOCKS,
        "block_size": BLOCK,
        "prefill_chunk_size": CHUNK,
    }


@pytest.fixture(scope="module")
def offline(deepinfer_backend_name):
    return LLM(None, deepinfer_backend_name, progress=False, **llm_kwargs())


@pytest.fixture(scope="module")
def deepinfer_backend_name(pytestconfig):
    return pytestconfig.getoption("deepinfer_backend") or "reference"


@contextlib.contextmanager
def running_server(llm: LLM, **kw):
    """(server state, base URL) of a server over ``llm`` on a free localhost port, for the ``with`` block."""
    state = make_server(llm, "tiny-py", **kw)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(state), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield state, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def embedded_server(backend: str, **kw):
    """(server state, base URL) of a server over the embedded model (``llm_kwargs``, ``running_server``'s ``kw``),
    torch on one thread while it runs: the body of a module's ``served`` fixture."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM(None, backend, progress=False, **llm_kwargs())
    with running_server(llm, **kw) as running:
        yield running
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def served(deepinfer_backend_name):
    """(server state, base URL) of a server running on a free port for the whole module."""
    yield from embedded_server(deepinfer_backend_name, chat_template=TEMPLATE)


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0, timeout=120)


def wait_idle(state, timeout=60.0):
    """Waits until the server's engine holds no request; returns its allocator."""
    engine = state.llm.engine
    deadline = time.monotonic() + timeout
    while engine.has_unfinished() or state.engine._live:
        assert time.monotonic() < deadline, "the engine still holds requests"
        time.sleep(0.02)
    return engine.allocator


def offline_out(offline, prompt, **params):
    return offline.generate(prompt, SamplingParams(**params))[0]


def metric(url, name, **labels):
    text = httpx.get(url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


# --- the OpenAI API ---


def test_completion_matches_offline_generation(client, offline):
    for prompt in PROMPTS[:3]:
        got = client.completions.create(model="tiny-py", prompt=prompt, max_tokens=20, temperature=0, logprobs=2)
        want = offline_out(offline, prompt, max_tokens=20, temperature=0, logprobs=2)
        choice, w = got.choices[0], want.outputs[0]
        assert choice.text == w.text and choice.finish_reason == w.finish_reason
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.usage.completion_tokens == len(w.token_ids)
        assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
        assert got.usage.prompt_tokens_details.cached_tokens == 0
        assert choice.logprobs.tokens == [offline.tokenizer.decode([t], False) for t in w.token_ids]
        assert choice.logprobs.token_logprobs == pytest.approx(w.logprobs)
        for top, want_top in zip(choice.logprobs.top_logprobs, w.top_logprobs):
            assert top == pytest.approx({offline.tokenizer.decode([k], False): v for k, v in want_top.items()})


def test_a_batch_of_prompts_and_token_id_prompts(client, offline):
    ids = offline.tokenizer.encode(PROMPTS[3])
    got = client.completions.create(model="tiny-py", prompt=PROMPTS[:2], max_tokens=8, temperature=0)
    assert [c.index for c in got.choices] == [0, 1]
    for c, p in zip(got.choices, PROMPTS[:2]):
        assert c.text == offline_out(offline, p, max_tokens=8, temperature=0).outputs[0].text
    by_ids = client.completions.create(model="tiny-py", prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == offline_out(offline, ids, max_tokens=8, temperature=0).outputs[0].text


def test_n_choices_per_prompt(client, offline):
    """``n`` completions of each prompt, choice ``p n + c`` completion ``c`` of prompt ``p`` (greedy here, so each
    is the offline output: the seeds are checked offline, tests/test_n_completions.py); each prompt's tokens count
    once in ``usage``; streaming tags every piece with its choice."""
    got = client.completions.create(model="tiny-py", prompt=PROMPTS[:2], n=2, max_tokens=8, temperature=0)
    want = [offline_out(offline, p, max_tokens=8, temperature=0) for p in PROMPTS[:2]]
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.text for c in got.choices] == [w.outputs[0].text for w in want for _ in range(2)]
    assert got.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    assert got.usage.completion_tokens == 2 * sum(len(w.outputs[0].token_ids) for w in want)
    chat = client.chat.completions.create(
        model="tiny-py", messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=6, temperature=0, stream=True
    )
    pieces: dict[int, str] = {}
    for chunk in chat:
        for c in chunk.choices:
            pieces[c.index] = pieces.get(c.index, "") + (c.delta.content or "")
    ids = offline.tokenizer.encode("<｜begin▁of▁sentence｜># user: hi\n# assistant:", add_special_tokens=False)
    assert pieces == dict.fromkeys(range(3), offline_out(offline, ids, max_tokens=6, temperature=0).outputs[0].text)


def test_chat_renders_the_template_and_generates_from_it(client, offline):
    messages = [{"role": "system", "content": "Write Python."}, {"role": "user", "content": "a sort function"}]
    got = client.chat.completions.create(model="tiny-py", messages=messages, max_tokens=12, temperature=0)
    # the template by hand: BOS, one "# role: content" line per message, then the generation prompt
    text = "<｜begin▁of▁sentence｜># system: Write Python.\n# user: a sort function\n# assistant:"
    ids = offline.tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == offline.config.bos_token_id and ids.count(offline.config.bos_token_id) == 1
    want = offline_out(offline, ids, max_tokens=12, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == len(want.outputs[0].token_ids)
    parts = [{"type": "text", "text": "Write Python."}]
    as_parts = client.chat.completions.create(
        model="tiny-py", messages=[{"role": "system", "content": parts}, messages[1]], max_tokens=12, temperature=0
    )
    assert as_parts.choices[0].message.content == want.outputs[0].text


def test_chat_logprobs(client, offline):
    messages = [{"role": "user", "content": "hi"}]
    got = client.chat.completions.create(
        model="tiny-py", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    ids = offline.tokenizer.encode("<｜begin▁of▁sentence｜># user: hi\n# assistant:", add_special_tokens=False)
    want = offline_out(offline, ids, max_tokens=6, temperature=0, logprobs=3).outputs[0]
    content = got.choices[0].logprobs.content
    assert [c.token for c in content] == [offline.tokenizer.decode([t], False) for t in want.token_ids]
    assert [c.logprob for c in content] == pytest.approx(want.logprobs)
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)


def test_a_checkpoint_without_a_chat_template_refuses_chat_with_a_clear_error(served, client):
    state, _ = served
    template, state.chat_template = state.chat_template, None
    try:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny-py", messages=[{"role": "user", "content": "hi"}])
    finally:
        state.chat_template = template
    assert "--chat-template" in err.value.body["message"]


def test_streaming_pieces_add_up_to_the_whole(client, offline):
    want = offline_out(offline, PROMPTS[0], max_tokens=24, temperature=0).outputs[0]
    chunks = list(
        client.completions.create(
            model="tiny-py",
            prompt=PROMPTS[0],
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert len(texts) > 3, "the text arrives in pieces"
    assert "".join(texts) == want.text
    assert reasons[-1] == want.finish_reason and not any(reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)

    ids = offline.tokenizer.encode("<｜begin▁of▁sentence｜># user: hi\n# assistant:", add_special_tokens=False)
    chat_want = offline_out(offline, ids, max_tokens=16, temperature=0).outputs[0]
    stream = client.chat.completions.create(
        model="tiny-py", messages=[{"role": "user", "content": "hi"}], max_tokens=16, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat_want.text
    assert chunks[-1].choices[0].finish_reason == chat_want.finish_reason


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_end_the_text_and_the_request(client, offline, served, stream, include):
    full = offline_out(offline, PROMPTS[0], max_tokens=40, temperature=0, ignore_eos=True).outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert len(stop) == 3 and stop.strip(), full
    cut = full.index(stop)
    kw = {"model": "tiny-py", "prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0, "stop": [stop, "\x00never"]}
    extra = {"ignore_eos": True, "include_stop_str_in_output": include}
    if stream:
        chunks = list(client.completions.create(**kw, stream=True, extra_body=extra))
        text = "".join(c.choices[0].text for c in chunks)
        last = chunks[-1].choices[0]
    else:
        last = client.completions.create(**kw, extra_body=extra).choices[0]
        text = last.text
    assert text == full[: cut + len(stop)] if include else text == full[:cut]
    assert last.finish_reason == "stop" and last.stop_reason == stop
    assert wait_idle(served[0]).num_free == NUM_BLOCKS
    offline_cut = offline_out(
        offline,
        PROMPTS[0],
        max_tokens=40,
        temperature=0,
        ignore_eos=True,
        stop=stop,
        include_stop_str_in_output=include,
    ).outputs[0]
    assert offline_cut.text == text and offline_cut.finish_reason == "stop" and offline_cut.stop_reason == stop


def test_concurrent_clients_share_the_running_batch(client, offline, served):
    state, _ = served
    steps0 = state.llm.engine.stats["steps"]
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def ask(i: int) -> None:
        try:
            r = client.completions.create(
                model="tiny-py", prompt=PROMPTS[i], max_tokens=48, temperature=0, extra_body={"ignore_eos": True}
            )
            results[i] = r.choices[0].text
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    for i, p in enumerate(PROMPTS):
        assert results[i] == offline_out(offline, p, max_tokens=48, temperature=0, ignore_eos=True).outputs[0].text
    steps = state.llm.engine.stats["steps"] - steps0
    assert steps < 48 * len(PROMPTS) / 2, f"{steps} steps for {len(PROMPTS)} requests of 48 tokens: no batching"


def test_a_client_that_disconnects_mid_stream_frees_its_request(served):
    state, url = served
    aborted0 = metric(url, "deepinfer_requests_total", finish_reason="abort")
    generated0 = metric(url, "deepinfer_generation_tokens_total")
    body = {"prompt": PROMPTS[1], "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        engine = state.llm.engine
        assert engine.has_unfinished() and engine.allocator.num_free < NUM_BLOCKS, "the request holds pages"
    allocator = wait_idle(state)
    assert allocator.num_free == NUM_BLOCKS
    assert metric(url, "deepinfer_requests_total", finish_reason="abort") == aborted0 + 1
    assert metric(url, "deepinfer_generation_tokens_total") - generated0 < 400, "it stopped before max_tokens"


def test_a_client_that_gives_up_on_a_whole_response_frees_its_request(served):
    state, url = served
    aborted0 = metric(url, "deepinfer_requests_total", finish_reason="abort")
    body = {"prompt": PROMPTS[2], "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/v1/completions", json=body, timeout=0.5)
    assert wait_idle(state).num_free == NUM_BLOCKS
    assert metric(url, "deepinfer_requests_total", finish_reason="abort") == aborted0 + 1


BAD_BODIES = [
    (b"{not json", 400),
    ({"model": "tiny-py"}, 400),  # no prompt
    ({"prompt": "x", "max_tokens": "many"}, 400),
    ({"prompt": "x", "max_tokens": 0}, 400),
    ({"prompt": "x", "temperature": -1}, 400),
    ({"prompt": "x", "top_p": 2}, 400),
    ({"prompt": "x", "n": 0}, 400),
    ({"prompt": "x", "n": 1000}, 400),
    ({"prompt": "x", "logprobs": 50}, 400),
    ({"prompt": "x", "presence_penalty": 0.5}, 400),
    ({"prompt": "x", "stop": 3}, 400),
    ({"prompt": "x", "max_tokens": MAX_LEN}, 400),  # prompt + completion beyond the context
    ({"prompt": []}, 400),
    ({"prompt": [5000]}, 400),  # a token id outside the vocabulary
    ({"prompt": "x", "model": "gpt-4"}, 404),
    ({"prompt": "x", "response_format": {"type": "xml"}}, 400),
    ({"prompt": "x", "guided_regex": "[a-", "max_tokens": 3}, 400),
    ({"prompt": "x", "guided_choice": ["a"], "guided_regex": "a"}, 400),
]


@pytest.mark.parametrize("body,status", BAD_BODIES, ids=lambda v: str(v)[:40])
def test_bad_completion_requests_get_openai_error_bodies(served, body, status):
    url = served[1]
    if isinstance(body, bytes):
        resp = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    else:
        resp = httpx.post(url + "/v1/completions", json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and error["code"] == status
    assert httpx.get(url + "/health").status_code == 200


@pytest.mark.parametrize(
    "field, value",
    [("top_k", -2), ("stop", [""]), ("stop_token_ids", [-1]), ("top_p", 2), ("temperature", -1), ("n", 0)],
)
def test_a_bad_sampling_value_names_its_field(served, field, value):
    """A sampling parameter the engine refuses gets a 400 whose ``param`` is that field."""
    resp = httpx.post(f"{served[1]}/v1/completions", json={"prompt": "x", "max_tokens": 3, field: value})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == field and field in error["message"], error


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("completions", {"prompt": "x", "guided_regex": "[a-"}, "guided_regex"),
        (
            "completions",
            {"prompt": "x", "structured_outputs": {"grammar": "start: undefined_rule"}},
            "structured_outputs",
        ),
        ("completions", {"prompt": "x", "structured_outputs": {"regex": 5}}, "structured_outputs"),
        ("completions", {"prompt": "x", "guided_choice": []}, "guided_choice"),
        ("chat/completions", {"guided_json": '{"type": "object", "properties": '}, "guided_json"),
        (
            "chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
            "response_format",
        ),
        ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_a_constraint_that_does_not_compile_names_its_field(served, path, body, param):
    """A structured-output constraint that is malformed or that the grammar engine refuses gets a 400 whose
    ``param`` is the request field it came from, on both endpoints."""
    if path.startswith("chat"):
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
    resp = httpx.post(f"{served[1]}/v1/{path}", json={"max_tokens": 3, **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["message"], error


@pytest.mark.parametrize(
    "body",
    [
        {"messages": []},
        {"messages": [{"content": "no role"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {"messages": "hi"},
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
    ],
    ids=lambda v: str(v)[:40],
)
def test_bad_chat_requests_get_openai_error_bodies(served, body):
    resp = httpx.post(served[1] + "/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"]


def test_the_client_sees_errors_as_exceptions_and_the_server_keeps_serving(client, offline):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny-py", prompt="x", max_tokens=MAX_LEN * 2)
    ok = client.completions.create(model="tiny-py", prompt="x", max_tokens=4, temperature=0)
    assert ok.choices[0].text == offline_out(offline, "x", max_tokens=4, temperature=0).outputs[0].text
    assert [m.id for m in client.models.list().data] == ["tiny-py"]


CHAT_JSON = "<｜begin▁of▁sentence｜># user: json\n# assistant:"  # the template's rendering of one "json" message
SIZE_REGEX = r"(0|[1-9][0-9]{0,3})\.[0-9]{2} (KB|MB)"


def test_structured_outputs(client, offline):
    """Each way of asking for a constraint; the oracle is the offline API under the same constraint (greedy)."""
    choice = client.completions.create(
        model="tiny-py", prompt="answer = ", max_tokens=8, extra_body={"guided_choice": ["yes", "no", "maybe"]}
    )
    assert choice.choices[0].text in ("yes", "no", "maybe")
    digits = client.completions.create(
        model="tiny-py", prompt="n = ", max_tokens=8, extra_body={"structured_outputs": {"regex": "[0-9]{3}"}}
    )
    assert re.fullmatch("[0-9]{3}", digits.choices[0].text)
    # small enough that any output ends within max_tokens: {"a":D} with one digit, no free whitespace
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"],
        "additionalProperties": False,
    }
    js = client.chat.completions.create(
        model="tiny-py",
        messages=[{"role": "user", "content": "json"}],
        max_tokens=24,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )
    assert js.choices[0].finish_reason == "stop", js.choices[0]
    value = json.loads(js.choices[0].message.content)
    assert set(value) == {"a"} and isinstance(value["a"], int) and 0 <= value["a"] <= 9, value
    ids = offline.tokenizer.encode(CHAT_JSON, add_special_tokens=False)
    want = offline_out(offline, ids, max_tokens=24, temperature=0, structured_outputs={"json": schema})
    assert js.choices[0].message.content == want.outputs[0].text


def test_structured_outputs_json_object(client, offline):
    """``response_format`` ``json_object``: any JSON object (the offline API with the schema ``{"type": "object"}``
    is the oracle); the embedded model closes it within ``max_tokens`` here, and it parses to an object."""
    got = client.chat.completions.create(
        model="tiny-py",
        messages=[{"role": "user", "content": "json"}],
        max_tokens=48,
        temperature=0,
        response_format={"type": "json_object"},
    )
    ids = offline.tokenizer.encode(CHAT_JSON, add_special_tokens=False)
    want = offline_out(offline, ids, max_tokens=48, temperature=0, structured_outputs={"json": {"type": "object"}})
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.choices[0].finish_reason == want.outputs[0].finish_reason == "stop"
    assert isinstance(json.loads(got.choices[0].message.content), dict)


def test_structured_outputs_streamed(client, offline):
    """A constrained, sampled (seeded) request streamed: its pieces add up to the offline output, which matches."""
    so = {"regex": SIZE_REGEX}
    chunks = list(
        client.completions.create(
            model="tiny-py",
            prompt=PROMPTS[1],
            max_tokens=32,
            temperature=1.0,
            seed=11,
            stream=True,
            extra_body={"structured_outputs": so},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    want = offline_out(offline, PROMPTS[1], max_tokens=32, temperature=1.0, seed=11, structured_outputs=so)
    assert text == want.outputs[0].text and re.fullmatch(SIZE_REGEX, text), text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_structured_outputs_with_n_choices(client, offline):
    """``n=2`` under one constraint: each choice is its own seeded completion (the offline ``n=2`` outputs), each
    held to the constraint."""
    options = ["alpha", "beta", "gamma", "delta"]
    got = client.completions.create(
        model="tiny-py",
        prompt=PROMPTS[4],
        n=2,
        max_tokens=8,
        temperature=1.0,
        seed=5,
        extra_body={"guided_choice": options},
    )
    want = offline_out(
        offline, PROMPTS[4], n=2, max_tokens=8, temperature=1.0, seed=5, structured_outputs={"choice": options}
    )
    assert [c.text for c in got.choices] == [o.text for o in want.outputs]
    assert all(c.text in options and c.finish_reason == "stop" for c in got.choices), got.choices


def test_structured_outputs_grammar_error_ends_the_choice_with_error(client, served, monkeypatch):
    """A planted sampler (the grammar's mask inverted, so the constrained request samples a token its grammar
    refuses): the choice ends with ``finish_reason`` ``error`` and the grammar's message in ``stop_reason``, counted
    under ``error`` in the metrics, not as a cancellation (``abort``); the server goes on serving."""
    from deepinfer.model import model_runner

    url = served[1]
    errors0 = metric(url, "deepinfer_requests_total", finish_reason="error")
    aborts0 = metric(url, "deepinfer_requests_total", finish_reason="abort")
    real = model_runner.allowed_tokens
    monkeypatch.setattr(model_runner, "allowed_tokens", lambda *a, **k: ~real(*a, **k))
    got = client.completions.create(
        model="tiny-py", prompt="n = ", max_tokens=8, extra_body={"structured_outputs": {"regex": "[0-9]{3}"}}
    )
    monkeypatch.undo()
    choice = got.choices[0]
    assert choice.finish_reason == "error", choice
    assert choice.model_extra["stop_reason"].startswith("structured output: "), choice.model_extra
    assert metric(url, "deepinfer_requests_total", finish_reason="error") == errors0 + 1
    assert metric(url, "deepinfer_requests_total", finish_reason="abort") == aborts0
    ok = client.completions.create(
        model="tiny-py", prompt="n = ", max_tokens=8, extra_body={"structured_outputs": {"regex": "[0-9]{3}"}}
    )
    assert ok.choices[0].finish_reason == "stop" and re.fullmatch("[0-9]{3}", ok.choices[0].text)


def test_usage_and_metrics_report_prefix_cache_hits(client, served, offline):
    url = served[1]
    hits0, queries0 = (
        metric(url, "deepinfer_prefix_cache_hits_total"),
        metric(url, "deepinfer_prefix_cache_queries_total"),
    )
    base = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser(description=__doc__)\n"
    first = client.completions.create(model="tiny-py", prompt=base * 2, max_tokens=2, temperature=0)
    second = client.completions.create(model="tiny-py", prompt=base * 2 + "    args", max_tokens=2, temperature=0)
    a, b = offline.tokenizer.encode(base * 2), offline.tokenizer.encode(base * 2 + "    args")
    common = next(i for i, (x, y) in enumerate(zip([*a, -1], b)) if x != y)
    expected = min(common // BLOCK * BLOCK, len(b) - 1) // CHUNK * CHUNK  # whole pages of a, in whole chunks
    assert expected >= CHUNK, (len(a), common)
    assert second.usage.prompt_tokens_details.cached_tokens == expected
    assert second.usage.prompt_tokens == len(b)
    assert second.choices[0].text == offline_out(offline, b, max_tokens=2, temperature=0).outputs[0].text
    wait_idle(served[0])
    hits = metric(url, "deepinfer_prefix_cache_hits_total") - hits0
    queries = metric(url, "deepinfer_prefix_cache_queries_total") - queries0
    assert hits == first.usage.prompt_tokens_details.cached_tokens + expected
    assert queries == first.usage.prompt_tokens + second.usage.prompt_tokens
    assert 0 < metric(url, "deepinfer_prefix_cache_hit_rate") <= 1


def test_a_host_tier_serves_an_evicted_prefix(deepinfer_backend_name, offline):
    """A server with 8 device pages of 16 tokens and a host tier: a prompt's prefix, evicted by the two
    100-token prompts after it, is copied back for the next prompt that shares it (``usage`` counts it cached,
    ``/metrics`` the pages copied back), and the text is the offline output's."""
    llm = LLM(None, deepinfer_backend_name, progress=False, **(llm_kwargs() | {"num_blocks": 8}), host_cache_gb=0.01)
    base = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser(description=__doc__)\n"
    fillers = []
    for line in ("class Parser:\n    def parse(self, text):\n", "for i in range(10):\n    print(i)\n"):
        text = line
        while len(offline.tokenizer.encode(text + line)) <= 100:
            text += line
        fillers.append(text)
    with running_server(llm, chat_template=TEMPLATE) as (state, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        client.completions.create(model="tiny-py", prompt=base * 2, max_tokens=2, temperature=0)
        for text in fillers:
            client.completions.create(model="tiny-py", prompt=text, max_tokens=2, temperature=0)
        again = client.completions.create(model="tiny-py", prompt=base * 2 + "    args", max_tokens=4, temperature=0)
        wait_idle(state)
        loaded = metric(url, "deepinfer_host_cache_pages", kind="loaded")
    ids = offline.tokenizer.encode(base * 2 + "    args")
    assert again.usage.prompt_tokens_details.cached_tokens >= CHUNK and loaded >= CHUNK // BLOCK
    assert again.choices[0].text == offline_out(offline, ids, max_tokens=4, temperature=0).outputs[0].text


def test_metrics_count_requests_tokens_and_latencies(client, served):
    url = served[1]
    before = {
        n: metric(url, n)
        for n in (
            "deepinfer_prompt_tokens_total",
            "deepinfer_generation_tokens_total",
            "deepinfer_time_to_first_token_seconds_count",
            "deepinfer_time_per_output_token_seconds_count",
            "deepinfer_prefix_cache_queries_total",
        )
    }
    length0 = metric(url, "deepinfer_requests_total", finish_reason="length")
    usage = [
        client.completions.create(
            model="tiny-py", prompt=p, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
        ).usage
        for p in PROMPTS[:3]
    ]
    wait_idle(served[0])
    assert metric(url, "deepinfer_requests_total", finish_reason="length") == length0 + 3
    prompt = sum(u.prompt_tokens for u in usage)
    assert metric(url, "deepinfer_prompt_tokens_total") == before["deepinfer_prompt_tokens_total"] + prompt
    assert (
        metric(url, "deepinfer_prefix_cache_queries_total") == before["deepinfer_prefix_cache_queries_total"] + prompt
    )
    assert metric(url, "deepinfer_generation_tokens_total") == before["deepinfer_generation_tokens_total"] + 15
    assert metric(url, "deepinfer_time_to_first_token_seconds_count") == (
        before["deepinfer_time_to_first_token_seconds_count"] + 3
    )
    assert metric(url, "deepinfer_time_per_output_token_seconds_count") == (
        before["deepinfer_time_per_output_token_seconds_count"] + 3
    )
    assert 0 <= metric(url, "deepinfer_prefix_cache_hit_rate") <= 1
    assert metric(url, "deepinfer_num_requests_running") == 0


def test_the_load_test_script_reports_every_request_finished(served):
    report = serve_load.run_load(served[1], "tiny-py", num_requests=12, concurrency=4, max_tokens=16, time_limit=240)
    assert report["finished"] == report["requests"] == 12 and report["failed"] == 0
    assert report["completion_tokens"] == 12 * 16
    assert 0 < report["ttft_p50_s"] <= report["ttft_p99_s"]


# --- the engine and the output stream underneath ---


def test_engine_abort_frees_each_request_s_pages_and_leaves_the_others_unchanged(offline):
    engine = offline.engine
    prompts = [offline.tokenizer.encode(p) for p in PROMPTS[:4]]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    alone = [offline.generate(p, params)[0].outputs[0].token_ids for p in prompts]
    with deepinfer.use(offline.backend):
        seqs = [engine.add_request(p, params) for p in prompts]
        free = engine.allocator.num_free
        assert engine.abort(seqs[3]) and seqs[3].status is Status.FINISHED  # while waiting: it held no page
        assert engine.allocator.num_free == free and seqs[3] not in engine.scheduler.waiting
        for _ in range(5):
            engine.step()
        running = seqs[1]
        assert running.block_table and running.status is Status.RUNNING
        held = len(running.block_table)
        free = engine.allocator.num_free
        assert engine.abort(running) and not engine.abort(running)
        assert engine.allocator.num_free == free + held and running.finish_reason == "abort"
        assert -1 not in running.token_ids
        done = engine.run_until_done()
    assert {s.arrival for s in done} == {seqs[0].arrival, seqs[2].arrival}
    assert seqs[0].generated_ids == alone[0] and seqs[2].generated_ids == alone[2]
    assert engine.allocator.num_free == NUM_BLOCKS and not engine.has_unfinished()


def test_engine_abort_of_a_swapped_out_request(offline):
    """A request preempted to host memory is aborted from the swapped queue, its host copy dropped."""
    engine = offline.engine
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    with deepinfer.use(offline.backend):
        # 64 pages of 16 tokens: five requests growing to 300 tokens each cannot all stay
        seqs = [engine.add_request(offline.tokenizer.encode(p) * 20, params) for p in PROMPTS[:5]]
        for _ in range(400):
            engine.step()
            swapped = [s for s in seqs if s.status is Status.SWAPPED]
            if swapped:
                break
        assert swapped, "no request was swapped out"
        victim = swapped[0]
        assert engine.abort(victim) and victim.swapped is None and victim not in engine.scheduler.swapped
        engine.run_until_done()
    assert all(s.finish_reason == "length" for s in seqs if s is not victim)
    assert engine.allocator.num_free == NUM_BLOCKS


def test_chat_template_sources(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<s>"},
                "eos_token": "</s>",
                "chat_template": [
                    {"name": "tool_use", "template": "TOOLS"},
                    {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] | tojson }}{{ x }}"},
                ],
            }
        )
    )
    t = ChatTemplate.load(tmp_path)
    assert t.render([{"role": "user", "content": "é"}], x="!") == '<s>"é"!'
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.role }}{% endfor %}{{ eos_token }}")
    assert ChatTemplate.load(tmp_path).render([{"role": "a", "content": ""}, {"role": "b"}]) == "ab</s>"
    assert ChatTemplate.load(tmp_path, "[{{ messages|length }}]").render([{"role": "u", "content": "x"}]) == "[1]"
    refusing = ChatTemplate("{{ raise_exception('only users') }}")
    with pytest.raises(ChatTemplateError, match="only users"):
        refusing.render([{"role": "user", "content": "x"}])
    empty = tmp_path / "none"
    empty.mkdir()
    assert ChatTemplate.load(empty) is None


def test_the_load_script_starts_deepinfer_serve_itself(tmp_path):
    """The command line end to end: ``benchmarks/serve_load.py`` starts ``deepinfer serve`` (the embedded model) on a
    free port, loads it and stops it."""
    import subprocess

    args = ["--requests", "6", "--concurrency", "3", "--max-tokens", "4", "--time-limit", "240"]
    args += ["--json", str(tmp_path / "load.json")]
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), *args],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((tmp_path / "load.json").read_text())
    assert report["finished"] == 6 and report["completion_tokens"] == 24
    assert "every request finished" in run.stdout


def test_offline_streaming_grows_to_the_generated_output_and_closing_it_frees_the_requests(offline):
    params = [
        SamplingParams(max_tokens=20, temperature=0, logprobs=1),
        SamplingParams(max_tokens=12, temperature=0.8, seed=3, stop=["\n"]),
    ]
    want = offline.generate(PROMPTS[:2], params)
    seen: dict[str, list] = {}
    for out in offline.stream(PROMPTS[:2], params):
        seen.setdefault(out.request_id, []).append(out)
    assert len(seen) == 2
    for outs, w in zip(seen.values(), want):
        *partial, final = outs
        assert final.finished and not any(o.finished for o in partial) and len(partial) >= 2
        for a, b in zip(partial, [*partial[1:], final]):  # each holds the one before
            assert b.outputs[0].text.startswith(a.outputs[0].text)
            assert b.outputs[0].token_ids[: len(a.outputs[0].token_ids)] == a.outputs[0].token_ids
        f, g = final.outputs[0], w.outputs[0]
        assert (f.text, f.token_ids, f.finish_reason, f.stop_reason) == (
            g.text,
            g.token_ids,
            g.finish_reason,
            g.stop_reason,
        )
        assert f.logprobs == g.logprobs
    it = offline.stream(PROMPTS[2], SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))
    first = next(it)
    assert not first.finished and offline.engine.has_unfinished()
    it.close()
    assert not offline.engine.has_unfinished() and offline.engine.allocator.num_free == NUM_BLOCKS


def test_a_failing_step_ends_its_requests_with_a_500_and_the_server_goes_on(served, client, offline, monkeypatch):
    state, url = served
    engine = state.llm.engine
    real_step = engine.step

    def broken_step():
        monkeypatch.setattr(engine, "step", real_step)  # only once
        raise RuntimeError("planted failure")

    monkeypatch.setattr(engine, "step", broken_step)
    resp = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=60)
    assert resp.status_code == 500 and "planted failure" in resp.json()["error"]["message"]
    assert httpx.get(url + "/health").status_code == 200
    ok = client.completions.create(model="tiny-py", prompt="x", max_tokens=4, temperature=0)
    assert ok.choices[0].text == offline_out(offline, "x", max_tokens=4, temperature=0).outputs[0].text
    assert wait_idle(state).num_free == NUM_BLOCKS


def test_a_server_with_speculative_decoding_gives_the_same_text(offline, deepinfer_backend_name):
    llm = LLM(
        None, deepinfer_backend_name, progress=False, speculative_config={"num_speculative_tokens": 2}, **llm_kwargs()
    )
    with running_server(llm) as (state, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for prompt in PROMPTS[:3]:
            got = client.completions.create(model="tiny-py", prompt=prompt, max_tokens=30, temperature=0, stop=["\n\n"])
            want = offline_out(offline, prompt, max_tokens=30, temperature=0, stop=["\n\n"]).outputs[0]
            assert (got.choices[0].text, got.choices[0].finish_reason) == (want.text, want.finish_reason)
        body = {"prompt": PROMPTS[4], "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as http, http.stream("POST", url + "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            assert [next(lines) for _ in range(4)]
        assert wait_idle(state).num_free == NUM_BLOCKS
        assert llm.engine.spec_stats.drafted > 0
