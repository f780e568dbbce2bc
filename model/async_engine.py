"""``AsyncEngine``: one ``LLM``'s engine stepped by a thread of its own, fed by asyncio coroutines.

Requests arrive from any number of coroutines (a server's handlers) while the engine runs: each ``submit`` queues an
``add`` for the engine thread, which adds it between two steps, so a new request joins the running batch at the next
step. A structured-output constraint is compiled before that, on a small pool of threads of its own (llguidance
releases the GIL while it compiles), so a large JSON schema never stalls the steps of the requests already running.
After every step the thread computes each request's ``StreamDelta`` (``streaming.py``: new tokens and text, stop
strings applied) and hands it to the request's coroutine through its event loop. A request whose consumer goes away
(the stream is closed or cancelled, as when an HTTP client disconnects) is aborted between two steps: its cache pages
are free for the next step.

A step that raises (a bug, an out-of-memory on the device) ends every request in flight with that error, resets the
engine (``LLMEngine.abort_all``) and keeps serving: one bad step never stops the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import deepinfer

from .errors import RequestError
from .llm import LLM
from .sampling_params import SamplingParams
from .sequence import Sequence
from .streaming import RequestStream, StreamDelta

log = logging.getLogger("deepinfer.serve")

IDLE_WAIT_S = 0.5  # the idle thread wakes this often to notice a shutdown
COMPILE_THREADS = 2  # threads compiling structured-output constraints


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (``shutdown``); no request can be served."""


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    prompt: str | None
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    matcher: Any = None  # its structured-output matcher, compiled before it is queued
    arrival_s: float = field(default_factory=time.monotonic)
    seq: Sequence | None = None
    stream: RequestStream | None = None
    first_token_s: float | None = None
    cancelled: bool = False

    def send(self, item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the consumer's loop has closed: nobody is listening any more
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)


@dataclass
class FinishedRequest:
    """What the loop reports to ``on_finish`` when a request ends: its times (monotonic seconds) and its counts."""

    request_id: str
    finish_reason: str | None
    num_prompt_tokens: int
    num_generated: int
    num_cached_tokens: int
    arrival_s: float
    first_token_s: float | None
    finish_s: float


class AsyncEngine:
    """Serves ``llm`` from a background thread (started here, daemonic). ``on_finish``: called on the engine thread
    with a ``FinishedRequest`` for every request that ends (for metrics); ``on_first_token`` likewise with the time to
    first token in seconds."""

    def __init__(
        self,
        llm: LLM,
        on_finish: Callable[[FinishedRequest], None] | None = None,
        on_first_token: Callable[[float], None] | None = None,
    ):
        self.llm, self.engine = llm, llm.engine
        self.on_finish, self.on_first_token = on_finish, on_first_token
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, _Request] = {}  # by id(): requests added to the engine and not yet finished
        self._stopping = threading.Event()
        self.error: BaseException | None = None  # the last step's failure, if any
        self._compiler = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="deepinfer-grammar")
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self._thread.start()

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    @property
    def num_waiting(self) -> int:
        sched = self.engine.scheduler
        return len(sched.waiting) + len(sched.swapped)

    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    async def submit(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, prompt: str | None = None
    ) -> AsyncIterator[StreamDelta]:
        """Queues a request and waits until the engine has taken it; returns the iterator of its deltas (the last
        one has ``finished``). A request the engine refuses raises its ``RequestError`` here (a structured-output
        constraint is compiled first, off the engine thread). Closing the iterator before its end (or cancelling the
        task reading it) aborts the request."""
        if not self.is_alive():
            raise EngineDeadError("the engine loop has stopped")
        loop = asyncio.get_running_loop()
        matcher = None
        if params.structured_outputs is not None:
            matcher = await loop.run_in_executor(self._compiler, self.llm._matcher, params)
        req = _Request(prompt_ids, params, request_id, prompt, loop, asyncio.Queue(), matcher)
        self._commands.put(("add", req))
        try:
            first = await req.out.get()
        except BaseException:
            req.cancelled = True
            self._commands.put(("abort", req))
            raise
        if isinstance(first, BaseException):
            raise first
        return self._deltas(req)

    async def _deltas(self, req: _Request) -> AsyncIterator[StreamDelta]:
        finished = False
        try:
            while True:
                item = await req.out.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                req.cancelled = True
                self._commands.put(("abort", req))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the thread after its current step; requests still running end with ``EngineDeadError``."""
        self._stopping.set()
        self._commands.put(("wake", None))
        self._compiler.shutdown(wait=False, cancel_futures=True)
        self._thread.join(timeout)

    # --- the engine thread ---

    def _run(self) -> None:
        with deepinfer.use(self.llm.backend):
            while not self._stopping.is_set():
                try:
                    self._take_commands(block=not self.engine.has_unfinished())
                    if self._stopping.is_set() or not self.engine.has_unfinished():
                        continue
                    self.engine.step()
                    self._publish()
                except Exception as e:  # one failed step must not stop the server
                    log.exception("engine step failed; ending the requests in flight")
                    self.error = e
                    self._fail_all(e, drain=False)
            self._fail_all(EngineDeadError("the engine loop has stopped"), drain=True)

    def _take_commands(self, block: bool) -> None:
        try:
            cmd, req = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd == "add":
                self._add(req)
            elif cmd == "abort":
                self._abort(req)
            try:
                cmd, req = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, req: _Request) -> None:
        if req.cancelled:
            return
        try:
            req.seq = self.engine.add_request(
                req.prompt_ids, req.params, request_id=req.request_id, prompt=req.prompt, matcher=req.matcher
            )
        except RequestError as e:
            req.send(e)
            return
        except Exception as e:  # reported to its client, not fatal to the loop
            log.exception("request %s could not be added", req.request_id)
            req.send(e)
            return
        req.stream = RequestStream(req.seq, self.llm.tokenizer, req.params.stop, req.params.include_stop_str_in_output)
        self._live[id(req)] = req
        req.send("accepted")

    def _abort(self, req: _Request) -> None:
        if self._live.pop(id(req), None) is None or req.seq is None:
            return
        if self.engine.abort(req.seq):
            self._report_finish(req, time.monotonic())

    def _publish(self) -> None:
        now = time.monotonic()
        for key, req in list(self._live.items()):
            delta = req.stream.update(self.engine)
            if delta is None:
                continue
            if delta.token_ids and req.first_token_s is None:
                req.first_token_s = now
                if self.on_first_token is not None:
                    self.on_first_token(now - req.arrival_s)
            req.send(delta)
            if delta.finished:
                del self._live[key]
                self._report_finish(req, now)

    def _report_finish(self, req: _Request, now: float) -> None:
        if self.on_finish is None:
            return
        seq = req.seq
        self.on_finish(
            FinishedRequest(
                request_id=req.request_id,
                finish_reason=seq.finish_reason,
                num_prompt_tokens=seq.num_prompt_tokens,
                num_generated=len(seq.generated_ids),
                num_cached_tokens=seq.num_cached_tokens,
                arrival_s=req.arrival_s,
                first_token_s=req.first_token_s,
                finish_s=now,
            )
        )

    def _fail_all(self, error: BaseException, drain: bool) -> None:
        """Ends every request in the engine with ``error``; with ``drain`` also those still queued for it."""
        with contextlib.suppress(Exception):
            self.engine.abort_all()
        live, self._live = self._live, {}
        for req in live.values():
            req.send(error)
        while drain:
            try:
                cmd, req = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd == "add":
                req.send(error)
