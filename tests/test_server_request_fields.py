"""``deepinfer serve``: request fields at the edges of what the server implements, through a real server over the
embedded model (``test_server.py``'s fixtures).

A ``top_k`` beyond int32 is off, as any ``top_k`` of the vocabulary or more, and never fails the requests batched
with it; ``chat_template_kwargs`` override the template's default variables as in vLLM (only ``messages`` is refused,
with a 400), and a template that fails on a request's own values is a 400, never a 500; a prompt that fills the
context is refused with a message naming its length; vLLM's fields that the server does not implement are refused
unless neutral, never dropped; ``stream_options.continuous_usage_stats`` puts each choice's usage so far in every
chunk.
"""

from __future__ import annotations

import threading

import openai
import pytest
import torch
from test_server import MAX_LEN, NUM_BLOCKS, TEMPLATE, embedded_server, wait_idle

from deepinfer.model.chat_template import ChatTemplate, ChatTemplateError

try:  # the HTTP client the openai package is built on
    import httpx2 as httpx
except ImportError:
    import httpx

HI = [{"role": "user", "content": "hi"}]
HI_TEXT = "<｜begin▁of▁sentence｜># user: hi\n# assistant:"  # TEMPLATE's rendering of HI


@pytest.fixture(scope="module")
def served(pytestconfig):
    """(server state, base URL) of a server over the embedded model with ``test_server.TEMPLATE``."""
    yield from embedded_server(pytestconfig.getoption("deepinfer_backend") or "reference", chat_template=TEMPLATE)


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def tokenizer(served):
    return served[0].llm.tokenizer


def test_a_top_k_beyond_int32_is_off_and_fails_no_request_beside_it(client, served, tokenizer):
    vocab = tokenizer.vocab_size
    kw = {"model": "tiny-py", "prompt": "def f(x):", "max_tokens": 8, "temperature": 1.0, "seed": 3}
    want = client.completions.create(**kw).choices[0].text
    results = {}

    def long_request():
        try:
            r = client.completions.create(
                model="tiny-py", prompt="import os\n", max_tokens=200, temperature=0, extra_body={"ignore_eos": True}
            )
            results["long"] = r.choices[0].finish_reason
        except Exception as e:
            results["long"] = repr(e)

    beside = threading.Thread(target=long_request)
    beside.start()
    try:
        for top_k in (2**40, vocab, vocab + 1):
            assert client.completions.create(**kw, extra_body={"top_k": top_k}).choices[0].text == want
    finally:
        beside.join(120)
    assert results == {"long": "length"}


def test_chat_template_kwargs_override_the_template_defaults(client, tokenizer):
    def prompt_tokens(**kwargs):
        r = client.chat.completions.create(
            model="tiny-py", messages=HI, max_tokens=1, temperature=0, extra_body={"chat_template_kwargs": kwargs}
        )
        return r.usage.prompt_tokens

    def count(text):
        return len(tokenizer.encode(text, add_special_tokens=False))

    assert prompt_tokens() == count(HI_TEXT)
    assert prompt_tokens(add_generation_prompt=False) == count(HI_TEXT.removesuffix("# assistant:"))
    assert prompt_tokens(bos_token="") == count(HI_TEXT.removeprefix("<｜begin▁of▁sentence｜>"))
    with pytest.raises(openai.BadRequestError) as err:
        prompt_tokens(messages=HI)
    assert "messages" in err.value.body["message"]


def test_a_template_that_fails_on_a_request_s_values_is_a_400(served, client):
    source = "{% for m in messages %}{% for call in m['tool_calls'] %}{{ call }}{% endfor %}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="TypeError"):
        ChatTemplate(source).render([{"role": "assistant", "content": "", "tool_calls": 5}])
    state = served[0]
    template, state.chat_template = state.chat_template, ChatTemplate(source)
    try:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="tiny-py", messages=[{"role": "assistant", "content": "", "tool_calls": 5}], max_tokens=2
            )
    finally:
        state.chat_template = template
    assert "TypeError" in err.value.body["message"]
    assert httpx.get(served[1] + "/health").status_code == 200


def test_a_prompt_that_fills_the_context_is_refused_by_its_length(served):
    long = [{"role": "user", "content": "x " * MAX_LEN}]
    resp = httpx.post(served[1] + "/v1/chat/completions", json={"messages": long})
    assert resp.status_code == 400
    message = resp.json()["error"]["message"]
    assert f"maximum context length is {MAX_LEN} tokens" in message and "input tokens" in message
    assert "-" not in message.split("However")[1], message  # no negative completion length


@pytest.mark.parametrize(
    "field,value",
    [
        ("min_p", 0.1),
        ("use_beam_search", True),
        ("prompt_logprobs", 1),
        ("truncate_prompt_tokens", 4),
        ("allowed_token_ids", [1, 2]),
        ("chat_template", "{{ messages }}"),
        ("continue_final_message", True),
        ("presence_penalty", 0.5),
        ("frequency_penalty", -0.5),
        ("repetition_penalty", 1.2),
        ("logit_bias", {"1": 5}),
        ("min_tokens", 2),
        ("tools", [{"type": "function"}]),
        ("best_of", 2),
        ("echo", True),
    ],
)
def test_unimplemented_fields_are_refused_unless_neutral(served, field, value):
    url = served[1]
    body = {"messages": HI, "max_tokens": 2, field: value}
    resp = httpx.post(url + "/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == field
    neutral = {
        "min_p": 0,
        "use_beam_search": False,
        "presence_penalty": 0.0,
        "frequency_penalty": 0,
        "repetition_penalty": 1.0,
    }
    neutral |= {"logit_bias": {}, "min_tokens": 0, "tools": [], "best_of": 1, "echo": False}
    neutral = neutral.get(field)
    assert httpx.post(url + "/v1/chat/completions", json={**body, field: neutral}).status_code == 200


def test_continuous_usage_stats_give_each_choice_s_usage_so_far(client, tokenizer, served):
    prompts = ["def f(x):", "import os\n"]
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        client.completions.create(
            model="tiny-py", prompt=prompts, n=2, max_tokens=6, temperature=0, stream=True, stream_options=options
        )
    )
    lengths = [len(tokenizer.encode(p)) for p in prompts]
    so_far = {}
    for c in chunks[:-1]:
        (choice,) = c.choices
        assert c.usage.prompt_tokens == lengths[choice.index // 2]
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
        assert c.usage.completion_tokens >= so_far.get(choice.index, 0)
        so_far[choice.index] = c.usage.completion_tokens
    assert so_far == dict.fromkeys(range(4), 6)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == sum(lengths)

    chat = list(
        client.chat.completions.create(
            model="tiny-py", messages=HI, max_tokens=5, temperature=0, stream=True, stream_options=options
        )
    )
    n_prompt = len(tokenizer.encode(HI_TEXT, add_special_tokens=False))
    assert chat[0].usage.prompt_tokens == n_prompt and chat[0].usage.completion_tokens == 0
    assert [c.usage.completion_tokens for c in chat[1:-1]] == sorted(c.usage.completion_tokens for c in chat[1:-1])
    assert chat[-2].usage.completion_tokens == chat[-1].usage.completion_tokens == 5
    plain = list(
        client.chat.completions.create(
            model="tiny-py",
            messages=HI,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 5
    assert wait_idle(served[0]).num_free == NUM_BLOCKS


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_stream_options_without_stream_are_a_400_naming_the_field(client, route):
    kw = {"model": "tiny-py", "max_tokens": 2, "stream_options": {"include_usage": True}}
    create = client.completions.create if route == "completions" else client.chat.completions.create
    where = {"prompt": "def f("} if route == "completions" else {"messages": HI}
    with pytest.raises(openai.BadRequestError) as e:
        create(**kw, **where)
    assert e.value.body["param"] == "stream_options"
    usage = [c.usage for c in create(**kw, **where, stream=True) if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == 2


def test_streamed_text_offsets_are_where_each_token_starts_with_stop_strings(client):
    seed = int(torch.randint(0, 2**31, ()))
    kw = {"model": "tiny-py", "prompt": ["def f(", "import"], "max_tokens": 16, "n": 2, "logprobs": 1, "seed": seed}
    kw["stop"] = ["\n\n\n", "xyzzy"]  # held back while they may be forming, rarely met
    tokens, offsets = {}, {}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
            offsets.setdefault(c.index, []).extend(c.logprobs.text_offset)
    assert sorted(tokens) == [0, 1, 2, 3]
    for i, toks in tokens.items():
        starts = [sum(len(t) for t in toks[:j]) for j in range(len(toks))]
        assert offsets[i] == starts, (i, seed)
