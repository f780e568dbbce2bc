"""``deepinfer serve``: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over one ``LLM``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``"stream": true`` as server-sent
events, ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus text).
The engine runs in its own thread (``AsyncEngine``); each request joins the running batch at the next step, and a
client that disconnects (mid-stream or while waiting for a whole response) has its request aborted and its cache
pages freed.

Request fields are OpenAI's, with vLLM's extra fields where a vLLM user would send them: ``max_tokens`` (chat also
``max_completion_tokens``; default 16 for completions, the rest of the context for chat), ``temperature``,
``top_p``, ``seed``, ``stop`` (strings), ``logprobs`` (completions: an int; chat: a bool with ``top_logprobs``),
``stream_options.include_usage`` (and ``continuous_usage_stats``: every chunk with its choice's usage so far),
``n`` (up to 128 completions a prompt), and ``top_k``, ``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens``,
``include_stop_str_in_output``; structured output by ``response_format`` (``json_object`` or ``json_schema``),
``structured_outputs`` (``{"json"|"regex"|"grammar"|"choice": ...}``) or ``guided_json``/``guided_regex``/
``guided_grammar``/``guided_choice`` (compiled off the engine loop; a choice whose grammar refuses its sampled token
ends with ``finish_reason`` ``error``, the grammar's message in ``stop_reason``).
A field the engine does not implement with a value other than its neutral one (``presence_penalty``,
``frequency_penalty``, ``repetition_penalty``, ``logit_bias``, ``min_tokens``, ``best_of``, ``suffix``, ``echo``,
``tools``, and vLLM's ``min_p``, ``use_beam_search``, ``prompt_logprobs``, ``truncate_prompt_tokens``, a per-request
``chat_template`` and the others of ``UNIMPLEMENTED_FIELDS``) is refused rather than ignored.
``usage`` reports prompt, completion and cached prompt tokens (``prompt_tokens_details.cached_tokens``).

Every bad request gets an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status
(400 for a malformed or invalid body, 404 for an unknown model, 401 for a wrong API key); an unexpected failure gets
a 500 with the same body, and the server keeps serving.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from .async_engine import AsyncEngine, EngineDeadError, FinishedRequest
from .chat_template import ChatTemplate
from .errors import DeepInferError, RequestError, StructuredOutputError
from .llm import LLM
from .sampling_params import SamplingParams
from .streaming import StreamDelta
from .structured_output import StructuredOutputsParams

try:
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from pydantic import BaseModel, ConfigDict, Field
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:  # pragma: no cover - the message says what to install
    raise ImportError(
        f"deepinfer serve needs the server dependencies ({e.name} is missing): pip install 'deepinfer[serve]'"
    ) from e

log = logging.getLogger("deepinfer.serve")

MAX_LOGPROBS = 20  # top log-probabilities per token at most, as vLLM's default max_logprobs
DEFAULT_COMPLETION_TOKENS = 16
# Fields of OpenAI's and vLLM's requests that this server does not implement, each with its neutral values: any other
# value is refused rather than ignored (the request's declared fields, and the extra ones a body would otherwise drop
# without a word).
UNIMPLEMENTED_FIELDS: dict[str, tuple] = {
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "logit_bias": (None, {}),
    "min_tokens": (None, 0),
    "best_of": (None, 1),
    "suffix": (None,),
    "echo": (None, False),
    "tools": (None, []),
    "min_p": (None, 0),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1),
    "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "logits_processors": (None, []),
    "return_tokens_as_token_ids": (None, False),
    "prompt_embeds": (None,),
    "chat_template": (None,),
    "continue_final_message": (None, False),
    "documents": (None,),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
}


class APIError(Exception):
    """A request refused with an OpenAI-style error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(
            status, "internal_error"
        )


def error_body(message: str, kind: str, status: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


# --- request bodies ---


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    """The fields completions and chat completions share."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_tokens: int = 0
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # structured output
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(_Common):
    messages: list[dict[str, Any]]
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    echo: bool = False


# --- metrics ---


class ServerMetrics:
    """The Prometheus metrics of one server, in a registry of their own (``/metrics``)."""

    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        m = ["model_name"]
        self.requests = Counter(
            "deepinfer_requests", "Requests finished, by finish reason", [*m, "finish_reason"], registry=r
        )
        self.errors = Counter(
            "deepinfer_request_errors", "Requests refused or failed, by HTTP status", [*m, "status"], registry=r
        )
        self.prompt_tokens = Counter("deepinfer_prompt_tokens", "Prompt tokens of finished requests", m, registry=r)
        self.generation_tokens = Counter(
            "deepinfer_generation_tokens", "Tokens generated by finished requests", m, registry=r
        )
        self.ttft = Histogram(
            "deepinfer_time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token",
            m,
            buckets=(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40),
            registry=r,
        )
        self.tpot = Histogram(
            "deepinfer_time_per_output_token_seconds",
            "Mean time between a request's generated tokens after its first",
            m,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5),
            registry=r,
        )
        self.e2e = Histogram(
            "deepinfer_e2e_request_latency_seconds",
            "Time from a request's arrival to its end",
            m,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80),
            registry=r,
        )
        self.cache_queries = Counter(
            "deepinfer_prefix_cache_queries",
            "Prompt tokens of finished requests looked up in the prefix cache",
            m,
            registry=r,
        )
        self.cache_hits = Counter(
            "deepinfer_prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled)", m, registry=r
        )
        hit_rate = Gauge("deepinfer_prefix_cache_hit_rate", "Cached share of all prompt tokens so far", m, registry=r)
        hit_rate.labels(model_name).set_function(self._hit_rate)
        self.running = Gauge("deepinfer_num_requests_running", "Requests in the running batch", m, registry=r)
        self.waiting = Gauge("deepinfer_num_requests_waiting", "Requests waiting or swapped out", m, registry=r)
        self.cache_usage = Gauge("deepinfer_kv_cache_usage_perc", "Share of cache pages in use (0 to 1)", m, registry=r)
        self.host_pages = Gauge(
            "deepinfer_host_cache_pages",
            "The host tier's pages (--host-cache-gb): held now, and copied out and back since the start",
            [*m, "kind"],
            registry=r,
        )
        self._queries = self._hits = 0

    def _hit_rate(self) -> float:
        return self._hits / self._queries if self._queries else 0.0

    def first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def finished(self, f: FinishedRequest) -> None:
        name = self.model_name
        self.requests.labels(name, f.finish_reason or "unknown").inc()
        self.prompt_tokens.labels(name).inc(f.num_prompt_tokens)
        self.generation_tokens.labels(name).inc(f.num_generated)
        self.cache_queries.labels(name).inc(f.num_prompt_tokens)
        self.cache_hits.labels(name).inc(f.num_cached_tokens)
        self._queries += f.num_prompt_tokens
        self._hits += f.num_cached_tokens
        self.e2e.labels(name).observe(f.finish_s - f.arrival_s)
        if f.first_token_s is not None and f.num_generated > 1:
            self.tpot.labels(name).observe((f.finish_s - f.first_token_s) / (f.num_generated - 1))

    def render(self, engine: AsyncEngine) -> bytes:
        name = self.model_name
        self.running.labels(name).set(engine.num_running)
        self.waiting.labels(name).set(engine.num_waiting)
        alloc = engine.engine.allocator
        self.cache_usage.labels(name).set(1 - alloc.num_free / alloc.num_blocks)
        host = engine.engine.host_cache_stats
        if host is not None:
            for kind in ("held", "saved", "loaded"):
                self.host_pages.labels(name, kind).set(host[f"{kind}_pages"])
        return generate_latest(self.registry)


# --- the server ---


class OpenAIServer:
    """The state behind the endpoints: the LLM, its engine loop, the chat template and the metrics."""

    def __init__(
        self,
        llm: LLM,
        served_model_name: str,
        chat_template: ChatTemplate | None = None,
        api_key: str | None = None,
    ):
        self.llm, self.model_name, self.chat_template, self.api_key = llm, served_model_name, chat_template, api_key
        self.created = int(time.time())
        self.metrics = ServerMetrics(served_model_name)
        self.engine = AsyncEngine(llm, on_finish=self.metrics.finished, on_first_token=self.metrics.first_token)

    # -- request to engine --

    def check_model(self, body: _Common) -> None:
        if body.model is not None and body.model != self.model_name:
            raise APIError(f"The model `{body.model}` does not exist.", 404, "model")

    def sampling_params(self, body: _Common, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The engine's parameters of a request; ``APIError`` for a field that is invalid or not implemented."""
        if body.stream_options is not None and not body.stream:  # as vLLM: it would be dropped without a word
            raise APIError("stream_options can only be given with stream=true", 400, "stream_options")
        for name, neutral in UNIMPLEMENTED_FIELDS.items():
            value = getattr(body, name, None)  # a declared field, or an extra one (None where absent)
            if value not in neutral:
                raise APIError(f"{name}={value!r} is not supported by this server", 400, name)
        if logprobs is not None and logprobs > MAX_LOGPROBS:
            raise APIError(f"at most {MAX_LOGPROBS} log-probabilities per token, got {logprobs}", 400, "logprobs")
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=0 if body.top_k is None else body.top_k,
                seed=body.seed,
                stop=body.stop,
                stop_token_ids=body.stop_token_ids,
                ignore_eos=body.ignore_eos,
                include_stop_str_in_output=body.include_stop_str_in_output,
                logprobs=logprobs,
                skip_special_tokens=body.skip_special_tokens,
                structured_outputs=self.structured(body),
                n=body.n,
            )
        except RequestError as e:  # ``param``: the field at fault, where the request has a field of that name
            raise APIError(str(e), 400, e.field if e.field in type(body).model_fields else None) from e

    def structured(self, body: _Common) -> StructuredOutputsParams | None:
        """The request's structured-output constraint, from whichever one field gives it."""
        given = self._constraints(body)
        if len(given) > 1:
            raise APIError(f"give one structured-output constraint, got {[n for n, _ in given]}", 400)
        return given[0][1] if given else None

    def constraint_field(self, body: _Common) -> str | None:
        """The request field that gives its structured-output constraint: the ``param`` of an error in it."""
        given = self._constraints(body)
        return given[0][0] if len(given) == 1 else None

    @staticmethod
    def _constraints(body: _Common) -> list[tuple[str, StructuredOutputsParams]]:
        """Each structured-output constraint the request gives, by the field it is in; a malformed one is refused,
        naming its field."""
        given: list[tuple[str, StructuredOutputsParams]] = []
        fmt = body.response_format
        if fmt is not None:
            kind = fmt.get("type")
            if kind == "json_object":
                given.append(("response_format", StructuredOutputsParams(json={"type": "object"})))
            elif kind == "json_schema":
                spec = fmt.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise APIError(
                        "response_format json_schema needs json_schema.schema (an object)", 400, "response_format"
                    )
                given.append(("response_format", StructuredOutputsParams(json=schema)))
            elif kind != "text":
                raise APIError(
                    f"response_format type must be text, json_object or json_schema, got {kind!r}", 400,
                    "response_format",
                )  # fmt: skip
        for name, field in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_grammar", "grammar"),
            ("guided_choice", "choice"),
        ):
            value = getattr(body, name)
            if value is not None:
                try:
                    given.append((name, StructuredOutputsParams(**{field: value})))
                except StructuredOutputError as e:
                    raise APIError(str(e), 400, name) from e
        if body.structured_outputs is not None:
            try:
                given.append(("structured_outputs", StructuredOutputsParams(**body.structured_outputs)))
            except (TypeError, StructuredOutputError) as e:
                raise APIError(f"structured_outputs: {e}", 400, "structured_outputs") from e
        return given

    def encode(self, prompt: str | list[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.llm.tokenizer is None:
                raise APIError("this model has no tokenizer: send token ids as the prompt", 400, "prompt")
            return self.llm.tokenizer.encode(prompt), prompt
        return list(prompt), None

    def check_length(self, n_prompt: int, max_tokens: int | None, what: str) -> int:
        """``max_tokens``, checked against the context (default: the rest of the context)."""
        limit = self.llm.max_model_len
        if n_prompt == 0:
            raise APIError(f"the {what} is empty", 400)
        if max_tokens is None and n_prompt >= limit:  # no room left for even one token
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, your request has {n_prompt} "
                f"input tokens ({what}), which leaves no room for the completion. Please reduce the length of the "
                f"{what}.",
                400,
                what,
            )
        if max_tokens is None:
            max_tokens = limit - n_prompt
        if n_prompt + max_tokens > limit or max_tokens < 1:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the {what}, {max_tokens} in the completion). "
                "Please reduce the length of the messages or completion.",
                400,
            )
        return max_tokens

    async def run(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, prompt: str | None, constraint: str | None
    ):
        """The request's stream; a refused request raises ``APIError`` (a constraint that does not compile names
        ``constraint``, the field it came from)."""
        try:
            return await self.engine.submit(prompt_ids, params, request_id, prompt)
        except StructuredOutputError as e:
            raise APIError(str(e), 400, constraint) from e
        except RequestError as e:
            raise APIError(str(e), 400) from e
        except EngineDeadError as e:
            raise APIError(str(e), 503) from e

    async def run_choices(
        self, prompts: list[tuple[list[int], str | None]], params: list[SamplingParams], rid: str, body: _Common
    ):
        """The streams of every choice: each prompt's ``n`` completions in order (choice ``p n + c``: completion
        ``c`` of prompt ``p``, request ``{rid}-{choice}``); if one cannot start, those started are closed."""
        streams, constraint = [], self.constraint_field(body)
        try:
            for (ids, text), sp in zip(prompts, params, strict=True):
                for child in sp.children():
                    streams.append(await self.run(ids, child, f"{rid}-{len(streams)}", text, constraint))
        except BaseException:
            for s in streams:
                await s.aclose()
            raise
        return streams

    def token_text(self, token: int) -> str:
        tok = self.llm.tokenizer
        return tok.decode([token], skip_special_tokens=False) if tok is not None else str(token)


def _running_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """The ``usage`` of one streamed chunk with ``stream_options.continuous_usage_stats``: its choice's prompt and
    the tokens generated for that choice so far (vLLM's continuous usage)."""
    total = prompt_tokens + completion_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total}


def _usage(finals: dict[int, StreamDelta], n: int) -> dict:
    """Token counts of the final deltas by choice index (``n`` choices a prompt, in prompt order): each prompt's
    tokens counted once, with the cached ones of its first choice."""
    firsts = [f for i, f in finals.items() if i % n == 0]
    prompt = sum(f.num_prompt_tokens for f in firsts)
    completion = sum(f.num_generated for f in finals.values())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(f.num_cached_tokens for f in firsts)},
    }


async def _merge(streams: list[AsyncIterator[StreamDelta]]) -> AsyncIterator[tuple[int, StreamDelta]]:
    """The deltas of several requests as they come, tagged with each one's index. Closing this closes them all
    (their requests are aborted)."""
    if len(streams) == 1:
        try:
            async for delta in streams[0]:
                yield 0, delta
        finally:
            await streams[0].aclose()
        return
    out: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[StreamDelta]) -> None:
        try:
            async for delta in stream:
                await out.put((i, delta))
        except BaseException as e:  # handed to the consumer
            await out.put((i, e))
        finally:
            await out.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await out.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            with contextlib.suppress(BaseException):
                await s.aclose()


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(request: Request, deltas: AsyncIterator[tuple[int, StreamDelta]], n: int) -> list[dict]:
    """Every delta of ``n`` requests gathered per request; aborts them all if the client goes away first."""
    acc = [{"text": [], "ids": [], "logprobs": [], "top": [], "final": None} for _ in range(n)]

    async def gather() -> None:
        async for i, d in deltas:
            a = acc[i]
            a["text"].append(d.text)
            a["ids"].extend(d.token_ids)
            a["logprobs"].extend(d.logprobs or [])
            a["top"].extend(d.top_logprobs or [])
            if d.finished:
                a["final"] = d

    work = asyncio.create_task(gather())
    watch = asyncio.create_task(_until_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
            await deltas.aclose()
            raise APIError("the client disconnected", 499)
    work.result()
    return acc


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _event_stream(chunks: AsyncGenerator[dict], deltas: AsyncGenerator) -> AsyncIterator[str]:
    """A streamed response's server-sent events: each of ``chunks``, then ``[DONE]``. The stream has started, so an
    error is reported in it as an error body; ``chunks`` and ``deltas`` (what it reads) are closed however it ends."""
    try:
        async for chunk in chunks:
            yield _sse(chunk)
    except APIError as e:
        yield _sse(error_body(e.message, e.kind, e.status))
    except Exception as e:
        log.exception("stream failed")
        yield _sse(error_body(f"{type(e).__name__}: {e}", "internal_error", 500))
    finally:
        await chunks.aclose()
        await deltas.aclose()
    yield "data: [DONE]\n\n"


def build_app(server: OpenAIServer) -> FastAPI:
    """The FastAPI application of ``server``. Its shutdown stops the engine thread."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        server.engine.shutdown()

    app = FastAPI(title="deepinfer", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        server.metrics.errors.labels(server.model_name, str(e.status)).inc()
        return JSONResponse(error_body(e.message, e.kind, e.status, e.param), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError):
        server.metrics.errors.labels(server.model_name, "400").inc()
        parts = []
        for err in e.errors():
            where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        param = None
        if e.errors():
            loc = [str(x) for x in e.errors()[0].get("loc", ()) if x != "body"]
            param = loc[0] if loc else None
        return JSONResponse(
            error_body("; ".join(parts) or "invalid request body", "invalid_request_error", 400, param), 400
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        server.metrics.errors.labels(server.model_name, str(e.status_code)).inc()
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind, e.status_code), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception):
        log.exception("request failed")
        server.metrics.errors.labels(server.model_name, "500").inc()
        status = 400 if isinstance(e, DeepInferError) else 500
        kind = "invalid_request_error" if status == 400 else "internal_error"
        return JSONResponse(error_body(f"{type(e).__name__}: {e}", kind, status), status_code=status)

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        key = server.api_key
        if (
            key is not None
            and request.url.path.startswith("/v1")
            and (request.headers.get("authorization") != f"Bearer {key}")
        ):
            server.metrics.errors.labels(server.model_name, "401").inc()
            return JSONResponse(error_body("invalid API key", "authentication_error", 401), status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health():
        if not server.engine.is_alive():
            return JSONResponse(error_body("the engine loop has stopped", "internal_error", 503), 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(server.engine), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        card = {
            "id": server.model_name,
            "object": "model",
            "created": server.created,
            "owned_by": "deepinfer",
            "root": str(server.llm.path),
            "max_model_len": server.llm.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        server.check_model(body)
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise APIError("prompt must not be empty", 400, "prompt")
        encoded = [server.encode(p) for p in prompts]
        requested = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_TOKENS
        params = [
            server.sampling_params(body, server.check_length(len(ids), requested, "prompt"), body.logprobs)
            for ids, _ in encoded
        ]
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = await server.run_choices(encoded, params, rid, body)
        deltas = _merge(streams)
        created = int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": server.model_name}
        want_logprobs = body.logprobs is not None

        def logprobs_of(ids, lps, tops, offset0: int) -> dict:
            tokens = [server.token_text(t) for t in ids]
            offsets, at = [], offset0
            for t in tokens:
                offsets.append(at)
                at += len(t)
            top = [{server.token_text(k): v for k, v in d.items()} for d in tops] if tops else None
            return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}

        if not body.stream:
            acc = await _collect(request, deltas, len(streams))
            finals = {i: a["final"] for i, a in enumerate(acc)}
            choices = []
            for i, a in enumerate(acc):
                choices.append(
                    {
                        "index": i,
                        "text": "".join(a["text"]),
                        "logprobs": logprobs_of(a["ids"], a["logprobs"], a["top"], 0) if want_logprobs else None,
                        "finish_reason": finals[i].finish_reason,
                        "stop_reason": finals[i].stop_reason,
                    }
                )
            return {**base, "choices": choices, "usage": _usage(finals, body.n)}

        include_usage = body.stream_options is not None and body.stream_options.include_usage
        continuous = include_usage and body.stream_options.continuous_usage_stats
        prompt_counts = [len(ids) for ids, _ in encoded for _ in range(body.n)]

        async def chunks():
            finals: dict[int, StreamDelta] = {}
            offsets = [0] * len(streams)
            generated = [0] * len(streams)
            async for i, d in deltas:
                generated[i] += len(d.token_ids)
                lp = None
                if want_logprobs:
                    lp = logprobs_of(d.token_ids, d.logprobs or [], d.top_logprobs or [], offsets[i])
                    # by the tokens' text, as without streaming: a delta's text lags its tokens' while a stop
                    # string may still be forming
                    offsets[i] += sum(len(t) for t in lp["tokens"])
                choice = {
                    "index": i,
                    "text": d.text,
                    "logprobs": lp,
                    "finish_reason": d.finish_reason if d.finished else None,
                    "stop_reason": d.stop_reason if d.finished else None,
                }
                if d.finished:
                    finals[i] = d
                usage = _running_usage(prompt_counts[i], generated[i]) if continuous else None
                yield {**base, "choices": [choice], "usage": usage}
            if include_usage:
                yield {**base, "choices": [], "usage": _usage(finals, body.n)}

        return StreamingResponse(_event_stream(chunks(), deltas), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        server.check_model(body)
        if server.chat_template is None:
            raise APIError(
                "this model has no chat template (neither chat_template.jinja nor tokenizer_config.json's "
                "chat_template in its checkpoint): start the server with --chat-template FILE, or use "
                "/v1/completions",
                400,
                "messages",
            )
        if server.llm.tokenizer is None:
            raise APIError("this model has no tokenizer: chat needs one", 400)
        try:
            text = server.chat_template.render(
                body.messages, body.add_generation_prompt, **(body.chat_template_kwargs or {})
            )
        except RequestError as e:
            raise APIError(str(e), 400, "messages") from e
        ids = server.llm.tokenizer.encode(text, add_special_tokens=False)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = server.check_length(len(ids), max_tokens, "messages")
        top = body.top_logprobs if body.top_logprobs is not None else 0
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError("top_logprobs needs logprobs=true", 400, "top_logprobs")
        params = server.sampling_params(body, max_tokens, top if body.logprobs else None)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await server.run_choices([(ids, text)], [params], rid, body)
        deltas = _merge(streams)
        created = int(time.time())
        base = {"id": rid, "created": created, "model": server.model_name}

        def logprobs_of(ids, lps, tops) -> dict:
            content = []
            for j, (t, lp) in enumerate(zip(ids, lps)):
                s = server.token_text(t)
                alts = tops[j] if tops and j < len(tops) else {}
                content.append(
                    {
                        "token": s,
                        "logprob": lp,
                        "bytes": list(s.encode()),
                        "top_logprobs": [
                            {"token": server.token_text(k), "logprob": v, "bytes": list(server.token_text(k).encode())}
                            for k, v in alts.items()
                        ],
                    }
                )
            return {"content": content}

        if not body.stream:
            acc = await _collect(request, deltas, len(streams))
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": "".join(a["text"])},
                    "logprobs": logprobs_of(a["ids"], a["logprobs"], a["top"]) if body.logprobs else None,
                    "finish_reason": a["final"].finish_reason,
                    "stop_reason": a["final"].stop_reason,
                }
                for i, a in enumerate(acc)
            ]
            usage = _usage({i: a["final"] for i, a in enumerate(acc)}, body.n)
            return {**base, "object": "chat.completion", "choices": choices, "usage": usage}

        include_usage = body.stream_options is not None and body.stream_options.include_usage
        continuous = include_usage and body.stream_options.continuous_usage_stats
        chunk = {**base, "object": "chat.completion.chunk"}

        async def chunks():
            finals: dict[int, StreamDelta] = {}
            generated = [0] * len(streams)
            for i in range(len(streams)):
                first = {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                usage = _running_usage(len(ids), 0) if continuous else None
                yield {**chunk, "choices": [first], "usage": usage}
            async for i, d in deltas:
                generated[i] += len(d.token_ids)
                if d.finished:
                    finals[i] = d
                choice = {
                    "index": i,
                    "delta": {"content": d.text} if d.text or not d.finished else {},
                    "logprobs": logprobs_of(d.token_ids, d.logprobs or [], d.top_logprobs or [])
                    if body.logprobs
                    else None,
                    "finish_reason": d.finish_reason if d.finished else None,
                    "stop_reason": d.stop_reason if d.finished else None,
                }
                usage = _running_usage(len(ids), generated[i]) if continuous else None
                yield {**chunk, "choices": [choice], "usage": usage}
            if include_usage:
                yield {**chunk, "choices": [], "usage": _usage(finals, body.n)}

        return StreamingResponse(_event_stream(chunks(), deltas), media_type="text/event-stream")

    return app


def default_model_name(model: str | None) -> str:
    """The name ``/v1/models`` lists: the ``--model`` argument as given, or ``tiny-py`` for the embedded model."""
    return model if model is not None else "tiny-py"


def make_server(
    llm: LLM,
    served_model_name: str | None = None,
    chat_template: str | None = None,
    api_key: str | None = None,
) -> OpenAIServer:
    """An ``OpenAIServer`` over ``llm`` (its engine thread started). ``chat_template``: a file or the template text
    (default: the checkpoint's own, if any)."""
    tok = llm.tokenizer
    cfg = llm.config

    def special(token_id: Any) -> str | None:
        if tok is None or not isinstance(token_id, int):
            return None
        return tok.decode([token_id], skip_special_tokens=False)

    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else None
    template = ChatTemplate.load(llm.path, chat_template, special(cfg.bos_token_id), special(eos))
    return OpenAIServer(llm, served_model_name or llm.path.name, template, api_key)


def serve(args: argparse.Namespace, console) -> int:
    """``deepinfer serve``: loads the model, then serves until interrupted."""
    import torch
    import uvicorn

    llm = LLM(
        args.model,
        args.backend,
        dtype=args.dtype,
        kv_format=args.kv_format,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        prefill_chunk_size=args.prefill_chunk_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_gb=args.kv_cache_gb,
        enforce_eager=args.enforce_eager,
        speculative_config=args.speculative_config,
        enable_prefix_caching=args.enable_prefix_caching,
        host_cache_gb=args.host_cache_gb,
        progress=True,
    )
    if llm.device.type == "cpu" and llm.config.hidden_size <= 1024:
        torch.set_num_threads(1)  # small matrices gain nothing from more threads
    server = make_server(
        llm, args.served_model_name or default_model_name(args.model), args.chat_template, args.api_key
    )
    template = server.chat_template.origin if server.chat_template is not None else "none (chat requests refused)"
    console.print(
        f"serving {server.model_name} (backend {llm.backend}, context {llm.max_model_len}, chat template: "
        f"{template}) on http://{args.host}:{args.port}/v1",
        highlight=False,
        soft_wrap=True,
    )
    uvicorn.run(build_app(server), host=args.host, port=args.port, log_level=args.log_level)
    return 0
