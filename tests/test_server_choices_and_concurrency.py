"""``deepinfer serve`` with several choices a request and many requests at once, through a real server over the
embedded model (``test_server.py``'s helpers).

Seeded sampling gives the same choices streamed and whole, run after run, its first choice the one ``n=1`` gives; a
client that goes away mid-stream from a request of several choices (of one prompt or several) has every choice
aborted and every page freed; sixteen requests at once, streamed and whole, with stop strings and log-probabilities,
give each the text, finish reason and usage it gets alone.
"""

from __future__ import annotations

import concurrent.futures

import openai
import pytest
from test_server import NUM_BLOCKS, PROMPTS, embedded_server, wait_idle

try:  # the HTTP client the openai package is built on
    import httpx2 as httpx
except ImportError:
    import httpx


@pytest.fixture(scope="module")
def served(pytestconfig):
    yield from embedded_server(pytestconfig.getoption("deepinfer_backend") or "reference")


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0, timeout=120)


def joined(chunks) -> dict[int, str]:
    text: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + c.text
    return text


def test_seeded_choices_are_the_same_streamed_whole_and_again(client):
    kw = {"model": "tiny-py", "prompt": "def f(x):", "max_tokens": 12, "temperature": 0.9, "seed": 1234, "n": 3}
    whole = [c.text for c in client.completions.create(**kw).choices]
    assert len(set(whole)) == 3, whole
    assert [c.text for c in client.completions.create(**kw).choices] == whole
    assert joined(client.completions.create(**kw, stream=True)) == dict(enumerate(whole))
    assert client.completions.create(**{**kw, "n": 1}).choices[0].text == whole[0]


@pytest.mark.parametrize("prompt,n", [(PROMPTS[1], 3), (PROMPTS[:2], 2)])
def test_a_client_gone_mid_stream_aborts_every_choice(served, prompt, n):
    state, url = served
    body = {"prompt": prompt, "n": n, "max_tokens": 400, "temperature": 0.8, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", url + "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        assert [next(lines) for _ in range(8)]
        assert len(state.engine._live) == n * (1 if isinstance(prompt, str) else len(prompt))
    assert wait_idle(state).num_free == NUM_BLOCKS


def test_sixteen_requests_at_once_get_what_each_gets_alone(client, served):
    prompts = [*PROMPTS, *(f"{p} " for p in PROMPTS), "yield", "lambda"]

    def ask(i: int, stream: bool):
        kw = {"model": "tiny-py", "prompt": prompts[i], "max_tokens": 16 + i, "temperature": 0, "logprobs": 1}
        kw["stop"] = ["\n\n"] if i % 3 == 0 else None
        extra = {"ignore_eos": i % 2 == 0}
        if not stream:
            r = client.completions.create(**kw, extra_body=extra)
            c = r.choices[0]
            return c.text, c.finish_reason, c.logprobs.tokens, r.usage.completion_tokens
        chunks = list(
            client.completions.create(**kw, extra_body=extra, stream=True, stream_options={"include_usage": True})
        )
        pieces = [c.choices[0] for c in chunks if c.choices]
        tokens = [t for p in pieces for t in p.logprobs.tokens]
        return "".join(p.text for p in pieces), pieces[-1].finish_reason, tokens, chunks[-1].usage.completion_tokens

    alone = [ask(i, False) for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(ask, range(16), [i % 2 == 1 for i in range(16)]))
    assert together == alone
    assert {a[1] for a in alone} == {"stop", "length"}
    assert wait_idle(served[0]).num_free == NUM_BLOCKS
