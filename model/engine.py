"""``LLMEngine``: requests in, one scheduled step at a time, finished sequences out.

It owns the paged latent cache (``deepinfer.allocate_kv_cache``, ``block_size`` tokens per page, ``bf16`` or
``fp8_ds_mla``; for DeepSeek-V3.2 also the indexer-key cache on the same pages, ``fp8_ds_index`` beside an FP8
latent cache, else ``bf16``, counted in the same memory budget; for DeepSeek-V4 pages of bytes the model lays out,
each sequence's state pages first in its block table), the page allocator, the scheduler and the model runner, and
applies each step's results: appends sampled tokens, records log-probabilities, stops a sequence on a stop token,
``max_tokens`` or the context limit, and frees its pages.

Asynchronous scheduling (on by default): a step's tokens are read back only after the next step has been scheduled
and queued behind it, so the host's work (scheduling, packing inputs, launching) overlaps the device's. The next
step takes the tokens still being sampled (``PENDING``) from the device. A sequence whose pending token is its last
by length sits that step out. Under speculative decoding the step in flight may accept drafts: the next step takes
where each sequence stands from the device too (``speculative.py``), and a sequence that would end by length if
it accepted them all sits out the step and rejoins when it did not. The engine schedules ahead only when no running
sequence has to be preempted for it, and no structured-output request or confidence scheduling needs the tokens
on the host; otherwise it reads the tokens first. What the early schedule cannot know is a sampled stop token:
that sequence takes one more step, whose token is dropped, and its pages and seat are freed a step later. Batches
can therefore differ from a synchronous run's. In batch-invariant mode the outputs do not; in the default mode a
row's rounding depends on its batch, as it does between any two schedules.

With the experts sharded over the ranks of a process group (``model.ep``, see ``parallel.py``) every rank runs the
same engine on the same requests: the engine agrees with the other ranks on the cache size, the CUDA graphs and the
seed generator of unseeded requests when it starts, checks that their settings match, and before each step's
forward checks that they scheduled the same batch and sampled the same tokens so far (``RankDivergenceError``
otherwise). These checks run on the host (over NCCL, through a Gloo group on the same ranks: ``parallel.host_group``),
so they do not wait for the step in flight.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from itertools import count
from typing import Any

import torch

import deepinfer
from deepinfer import dispatch
from deepinfer.errors import InputError
from deepinfer.index_cache import allocate_index_cache
from deepinfer.validation import Check

from . import cuda_graphs as graph_capture
from .block_manager import BlockAllocator
from .cuda_graphs import DecodeGraphs
from .deepseek_v3 import DeepseekV3
from .errors import RequestError
from .host_cache import HostPageCache
from .model_runner import LaunchedStep, ModelRunner, StepResult
from .parallel import RankSync, fingerprint
from .sampling_params import SamplingParams, seed_int64
from .scheduler import ScheduledBatch, Scheduler
from .sequence import PENDING, Sequence, Status
from .speculative import MTPDrafter, SpeculativeConfig, SpeculativeStats
from .structured_output import matcher_error

DEFAULT_CACHE_BYTES = 1 << 30
# With decode graphs, prompt chunks that end within this many tokens run as decode rows (PrefillChunk.short), inside
# the graphs: a short prompt's prefill is one replay instead of an eager forward's launches (thousands for a deep
# model, each costing the host more than the device). The graphs cover at least this many rows.
SHORT_PROMPT_TOKENS = 128


def index_format_for(cfg, kv_format: str) -> str | None:
    """The indexer-key cache format of a sparse-attention model (None for dense MLA): FP8 (``fp8_ds_index``) beside
    an ``fp8_ds_mla`` latent cache where ``index_head_dim`` is a multiple of 128, else ``bf16``."""
    if not cfg.sparse_attention:
        return None
    return "fp8_ds_index" if kv_format == "fp8_ds_mla" and cfg.index_head_dim % 128 == 0 else "bf16"


def check_kv_format(cfg, kv_format: str, who: str, where: str = "") -> None:
    """An ``InputError`` from ``who`` unless ``kv_format`` fits ``cfg``: ``fp8_ds_mla`` scales the latent in groups of
    128, so it needs a ``kv_lora_rank`` that is a multiple of 128 (a model that lays out its own pages, DeepSeek-V4,
    checks its own). ``where``: the config's place, for the message."""
    rank = getattr(cfg, "kv_lora_rank", None)
    if kv_format == "fp8_ds_mla" and not getattr(cfg, "owns_cache", False) and rank % 128:
        expected = f"bf16 for a model whose kv_lora_rank is not a multiple of 128 ({rank}{where}); fp8_ds_mla needs one"
        raise InputError(who, "kv_format", expected, repr(kv_format))


def cache_page_bytes(cfg, kv_format: str, block_size: int, mtp_layers: int = 0, elem_bytes: int = 2) -> int:
    """Bytes of one cache page (``block_size`` tokens) over all layers (and ``mtp_layers`` multi-token-prediction
    layers): the latent cache's, plus the indexer keys' for sparse attention. A model that lays out its own pages
    (``cfg.owns_cache``: DeepSeek-V4, in its dtype of ``elem_bytes``) says how large they are."""
    if getattr(cfg, "owns_cache", False):
        return cfg.cache_page_bytes(kv_format, block_size, elem_bytes, mtp_layers)
    layers = cfg.num_hidden_layers + mtp_layers
    probe = deepinfer.allocate_kv_cache(
        1, block_size, kv_lora_rank=cfg.kv_lora_rank, rope_dim=cfg.qk_rope_head_dim, kv_format=kv_format
    )
    page_bytes = probe.numel() * probe.element_size() * layers
    index_format = index_format_for(cfg, kv_format)
    if index_format is not None:  # the indexer keys are paged beside the latents, on the same pages
        probe = allocate_index_cache(1, block_size, head_dim=cfg.index_head_dim, index_format=index_format)
        page_bytes += probe.numel() * probe.element_size() * layers
    return page_bytes


@dataclass
class _Launched:
    """A launched step: its batch, what the device computes for it, where each sampled token goes (``id(seq) ->
    index`` of its ``PENDING`` entry in ``token_ids``) and how many drafts each sequence verifies."""

    batch: ScheduledBatch
    step: LaunchedStep
    index: dict[int, int]
    drafts: dict[int, int]


class LLMEngine:
    """Continuous-batching engine over one model.

    kv_format: ``bf16`` or ``fp8_ds_mla`` (needs ``kv_lora_rank % 128 == 0``). num_blocks: cache pages (default:
    enough for ``max_num_seqs`` sequences of ``max_model_len`` tokens, within ``kv_cache_bytes``; on a device whose
    backend reports its free memory (``BackendSpec.free_memory``) ``kv_cache_bytes`` defaults to 90% of it less a
    reserve for activations, elsewhere to 1 GiB). chunk_size: prefill chunk length (chunks end at its multiples).
    enable_prefix_caching: a request reuses the cache pages of the longest prefix of its prompt that an earlier
    request computed, in whole chunks, and prefills only the rest (``block_manager.py``,
    ``Scheduler._reuse_prefix``); each sequence's ``num_cached_tokens`` says how many prompt tokens it found,
    ``stats`` counts the prompt tokens prefilled and found. host_cache_bytes: with prefix caching, pages evicted
    from the device cache are kept in that much host memory (pinned on an accelerator) and copied back when a prompt
    continues a cached prefix with them, on a stream that overlaps the step in flight (``host_cache.py``;
    ``host_cache_stats``); DeepSeek-V4's state snapshots too (``block_manager.py``). cuda_graphs: capture decode
    graphs when the backend declares ``cuda_graphs``, in the batch-invariant mode or the default mode that is on now;
    they are replayed only in that mode.
    async_scheduling: schedule and launch each step before reading back the previous one's tokens (above); ``step``
    then returns what finished in the previous step. The attribute can be changed between steps.

    A bad argument (a size that is not a positive int, ``kv_cache_bytes`` below one cache page, ``max_model_len``
    outside ``[2, max_position_embeddings]``) is an ``InputError`` naming it, before anything is allocated.

    Expert parallelism (``model.ep`` over several ranks): every rank constructs the engine with the same arguments
    and then adds the same requests in the same order and steps alike; ``step`` and ``run_until_done`` are then
    collectives. ``check_ranks_done`` ends a run driven by ``step``.
    """

    def __init__(
        self,
        model: DeepseekV3,
        *,
        kv_format: str = "bf16",
        block_size: int = 64,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 4096,
        chunk_size: int = 1024,
        max_model_len: int | None = None,
        preemption_mode: str = "swap",
        cuda_graphs: bool = True,
        async_scheduling: bool = True,
        enable_prefix_caching: bool = True,
        speculative_config: SpeculativeConfig | dict | None = None,
        host_cache_bytes: int = 0,
    ):
        cfg = model.cfg
        self.model, self.cfg = model, cfg
        c = Check("LLMEngine")
        spec = SpeculativeConfig.from_value(speculative_config)
        if spec is not None and not model.mtp:
            raise c.fail(
                "speculative_config",
                "a model loaded with its MTP layers (load(..., mtp=True) on a checkpoint that has them)",
                "a model without MTP layers",
            )
        mtp_layers = 1 if spec is not None else 0  # the drafts chain the first MTP layer
        for name, value in (
            ("block_size", block_size),
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("chunk_size", chunk_size),
        ):
            c.positive_int(name, value)
        if num_blocks is not None:
            c.positive_int("num_blocks", num_blocks)
        if isinstance(host_cache_bytes, bool) or not isinstance(host_cache_bytes, int) or host_cache_bytes < 0:
            raise c.fail("host_cache_bytes", "an int >= 0", repr(host_cache_bytes))
        if max_model_len is not None and (
            isinstance(max_model_len, bool)
            or not isinstance(max_model_len, int)
            or not 2 <= max_model_len <= cfg.max_position_embeddings
        ):
            raise c.fail(
                "max_model_len",
                f"an int in [2, {cfg.max_position_embeddings}] (the model's max_position_embeddings) or None",
                repr(max_model_len),
            )
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        owns_cache = getattr(cfg, "owns_cache", False)
        check_kv_format(cfg, kv_format, "LLMEngine")
        page_bytes = cache_page_bytes(cfg, kv_format, block_size, mtp_layers, model.dtype.itemsize)
        lookahead = spec.num_speculative_tokens if spec is not None else 0
        # DeepSeek-V4: each sequence also holds state pages (its windows), first in its block table
        seq_pages = model.cache_layout(block_size, kv_format, mtp_layers, lookahead).state_pages if owns_cache else 0
        least = "one cache page" if not seq_pages else f"one sequence's {seq_pages} state pages and one cache page"
        if kv_cache_bytes is not None and (
            isinstance(kv_cache_bytes, bool)
            or not isinstance(kv_cache_bytes, int)
            or kv_cache_bytes < (seq_pages + 1) * page_bytes
        ):
            raise c.fail(
                "kv_cache_bytes",
                f"an int of at least {least} ({(seq_pages + 1) * page_bytes}) or None",
                repr(kv_cache_bytes),
            )
        if num_blocks is not None and num_blocks <= seq_pages:
            raise c.fail("num_blocks", f"at least {least} ({seq_pages + 1})", repr(num_blocks))
        device = model.device
        self.sync = RankSync(model.ep.group, device) if model.ep.world_size > 1 else None
        self.index_format = None if owns_cache else index_format_for(cfg, kv_format)
        max_blocks = seq_pages + math.ceil(self.max_model_len / block_size)
        if num_blocks is None:
            if kv_cache_bytes is None:
                free_memory = deepinfer.current_backend().free_memory
                if device.type != "cpu" and free_memory is not None:
                    kv_cache_bytes = max(int(free_memory(device) * 0.9) - (4 << 30), page_bytes)
                else:
                    kv_cache_bytes = DEFAULT_CACHE_BYTES
            num_blocks = max(1, min(max_blocks * max_num_seqs, kv_cache_bytes // page_bytes))
            if self.sync is not None:  # free memory may differ per rank; the schedule must not
                num_blocks = self.sync.min_int(num_blocks)
        layers = cfg.num_hidden_layers + mtp_layers  # the MTP layer's cache follows the model's layers
        backend = deepinfer.current_backend()
        want_graphs = cuda_graphs and graph_capture.can_capture(backend, device)
        if owns_cache:  # graphs of state pages: not with speculation (cuda_graphs.py)
            want_graphs = want_graphs and spec is None
        pad_page = num_blocks if owns_cache and want_graphs else None  # a scratch page past the allocator's
        if owns_cache:  # pages of bytes the model lays out itself (swapped as any pages are)
            pages = num_blocks + (pad_page is not None)
            self.kv_cache = torch.zeros(1, pages, page_bytes, dtype=torch.uint8, device=device)
            model.use_pages(block_size, kv_format, mtp_layers, lookahead)
        else:
            cache = deepinfer.allocate_kv_cache(
                num_blocks * layers,
                block_size,
                kv_lora_rank=cfg.kv_lora_rank,
                rope_dim=cfg.qk_rope_head_dim,
                kv_format=kv_format,
                device=device,
            )
            self.kv_cache = cache.view(layers, num_blocks, block_size, -1)
        self.index_cache = None
        if self.index_format is not None:
            self.index_cache = allocate_index_cache(
                num_blocks * layers,
                block_size,
                head_dim=cfg.index_head_dim,
                index_format=self.index_format,
                device=device,
            ).view(layers, num_blocks, block_size, -1)
            model.use_index_format(self.index_format)
        # a sequence's state pages (DeepSeek-V4) depend on its whole prefix: a prefix is reused where its state was
        # kept, at multiples of the page size and of every compression rate (block_manager.py)
        reuse_tokens = math.lcm(block_size, *cfg.compress_rates.values()) if owns_cache else block_size
        host = None
        if host_cache_bytes:
            paged = [self.kv_cache] if self.index_cache is None else [self.kv_cache, self.index_cache]
            host_pages = host_cache_bytes // HostPageCache.page_bytes(paged)
            if not enable_prefix_caching or host_pages < 1:
                raise c.fail(
                    "host_cache_bytes",
                    f"0, or with prefix caching on at least one page of host memory ({HostPageCache.page_bytes(paged)}"
                    " bytes)",
                    f"{host_cache_bytes!r}" + ("" if enable_prefix_caching else " with prefix caching off"),
                )
            host = HostPageCache(paged, host_pages)
        self.allocator = BlockAllocator(
            num_blocks,
            block_size,
            enable_prefix_caching=enable_prefix_caching,
            seq_pages=seq_pages,
            host=host,
            reuse_tokens=reuse_tokens,
            copy_pages=self._copy_pages,
        )
        self.speculative_config = spec
        self.spec_stats = SpeculativeStats()
        drafter = None
        if spec is not None:
            index_layer = self.index_cache[-1] if self.index_cache is not None else None
            drafter = MTPDrafter(
                model.mtp[0],
                self.kv_cache[-1],
                index_layer,
                self.allocator,
                spec,
                self.max_model_len,
                host_positions=owns_cache,
            )
        graphs = None
        # short prompts as decode rows: not for a state-page model (its graphs hold one row per sequence), nor for
        # graphs captured in batch-invariant mode (which keeps the prefill path)
        short = 0 if owns_cache or deepinfer.batch_invariant_enabled() else SHORT_PROMPT_TOKENS
        if want_graphs:
            graphs = DecodeGraphs(
                model,
                self.kv_cache,
                self.index_cache,
                max_batch=max_num_seqs * (1 + lookahead),  # a verification step runs 1 + drafts rows per sequence
                prompt_rows=short,  # a short prompt, one row per token
                max_blocks=max_blocks,
                block_size=block_size,
                drafter=drafter,
                pad_page=pad_page,
                widths=graph_capture.width_buckets(
                    seq_pages, max_blocks - seq_pages, math.ceil(graph_capture.NARROWEST_TOKENS / block_size)
                )
                if owns_cache
                else None,
            )
        self.runner = ModelRunner(
            model, self.kv_cache, self.allocator, graphs=graphs, index_cache=self.index_cache, drafter=drafter
        )
        if graphs is not None:
            captured = graphs.capture()
            if self.sync is not None:  # a step's MoE mode depends on the graphs: all ranks use them or none does
                captured = self.sync.min_int(int(captured)) == 1
            if not captured:
                self.runner.graphs = None
        self.scheduler = Scheduler(
            self.allocator,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            chunk_size=chunk_size,
            preemption_mode=preemption_mode,
            swap_out=self.runner.swap_out,
            swap_in=self.runner.swap_in,
            lookahead=lookahead,
            max_model_len=self.max_model_len,
            decode_row_tokens=short if self.runner.graphs is not None else 0,
        )
        self.eos_ids = frozenset(cfg.eos_token_ids)
        self._ids = count()
        self._unfinished: dict[int, Sequence] = {}  # every request added and not finished, by arrival
        self._seed_rng = random.Random()
        if self.sync is not None:  # unseeded requests: random per run, the same seeds on every rank
            self._seed_rng = random.Random(self.sync.broadcast_int(random.getrandbits(63)))
            settings = (
                deepinfer.current_backend().name,
                repr(cfg),
                str(model.dtype),
                repr(model.ep.placement),
                kv_format,
                self.index_format,
                block_size,
                num_blocks,
                max_num_seqs,
                max_num_batched_tokens,
                chunk_size,
                self.max_model_len,
                preemption_mode,
                self.runner.graphs is not None,
                deepinfer.batch_invariant_enabled(),
                async_scheduling,
                enable_prefix_caching,
                repr(spec),
            )
            self.sync.check("engine start", {"engine settings": settings})
        self._sampled: list = []  # tokens read back and finishes since the last check across ranks (next launch)
        self.async_scheduling = async_scheduling
        self._inflight: _Launched | None = None  # launched, results not yet applied
        self._aside: list[Sequence] = []  # running sequences left out of the step launched ahead
        self.eplb: Any = None  # an eplb.ExpertLoadBalancer, told after each launched step (LLM(enable_eplb=True))
        # prefilled_tokens: prompt tokens computed (a prompt found in the prefix cache is not); cached_prompt_tokens:
        # prompt tokens found there when their requests were admitted; steps_ahead: steps launched before the results
        # of the one before were read (asynchronous scheduling)
        self.stats = {
            "prompt_tokens": 0,
            "generated_tokens": 0,
            "steps": 0,
            "steps_ahead": 0,
            "prefilled_tokens": 0,
            "cached_prompt_tokens": 0,
        }

    def _copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copies cache pages ``src`` onto ``dst`` in every layer, on the device's stream."""
        device = self.kv_cache.device
        self.kv_cache[:, torch.tensor(dst, device=device)] = self.kv_cache[:, torch.tensor(src, device=device)]

    @property
    def host_cache_stats(self) -> dict[str, int] | None:
        """The host tier's pages copied out (evicted from the device) and back (prefix hits) so far, its capacity in
        pages and the pages it holds; None without one."""
        host = self.allocator.host
        if host is None:
            return None
        return {
            "saved_pages": host.saved,
            "loaded_pages": host.loaded,
            "capacity_pages": host.capacity,
            "held_pages": len(host),
        }

    def drop_cuda_graphs(self) -> None:
        """Frees the captured decode graphs; decode runs eagerly from then on. Under expert parallelism over NCCL
        the graphs hold captured collectives, and destroying the process group waits for them: drop them (or the
        whole engine) first."""
        self.runner.graphs = None

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        prompt: str | None = None,
        matcher: Any = None,
    ) -> Sequence:
        """Queues a request; checks the prompt fits the model and the cache. ``matcher``: the grammar matcher that
        constrains its tokens (structured output), fed every token it samples."""
        if params.n != 1:
            raise RequestError(
                f"the engine runs one completion per request, got n={params.n}: add one request for each of "
                "params.children() (LLM.generate and the server do)"
            )
        n = len(prompt_ids)
        if n == 0:
            raise RequestError("a prompt needs at least one token")
        bad = [
            t for t in prompt_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.cfg.vocab_size
        ]
        if bad:
            raise RequestError(f"prompt token ids must be ints in [0, {self.cfg.vocab_size}), got {bad[:5]}")
        if n >= self.max_model_len:
            raise RequestError(f"the prompt has {n} tokens; the model's context is {self.max_model_len}")
        if self.allocator.blocks_for(n + 1) > self.allocator.num_blocks:
            raise RequestError(
                f"the prompt has {n} tokens; the cache holds "
                f"{(self.allocator.num_blocks - self.allocator.seq_pages) * self.allocator.block_size}"
            )
        arrival = next(self._ids)
        seed = seed_int64(params.seed) if params.seed is not None else self._seed_rng.getrandbits(63)
        seq = Sequence(str(arrival) if request_id is None else request_id, arrival, prompt_ids, params, seed, prompt)
        seq.matcher = matcher
        self.scheduler.add(seq)
        self._unfinished[arrival] = seq
        self.stats["prompt_tokens"] += n
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def step(self) -> list[Sequence]:
        """Schedules and launches one batch and applies the results of the one before (with ``async_scheduling``)
        or of this one; returns the sequences that finished in the results applied."""
        finished: list[Sequence] = []
        inflight, self._inflight = self._inflight, None
        if inflight is not None and self._ready_to_run_ahead(inflight):
            launched = self._launch(finished, inflight)  # scheduled while `inflight` runs, over its pending tokens
            self.stats["steps_ahead"] += launched is not None
            self._apply(inflight, finished, launched)
            for seq in self._aside:  # under speculative decoding: set aside, and did not end after all
                if seq.status is Status.RUNNING:
                    self.scheduler.resume(seq)
            self._aside = []
        else:
            if inflight is not None:
                self._apply(inflight, finished)
            launched = self._launch(finished)
        if launched is not None and self.eplb is not None:
            self.eplb.end_step()  # moves a few layers' experts at most; their tables change in place, graphs stay
        if launched is not None:
            if self.async_scheduling:
                self._inflight = launched
            else:
                self._apply(launched, finished)
        for seq in finished:
            self._unfinished.pop(seq.arrival, None)
        return finished

    def abort_all(self) -> list[Sequence]:
        """Ends every unfinished request (``finish_reason`` ``"abort"``, tokens still being sampled dropped) and
        takes back every cache page and every swapped-out copy; returns the requests ended. The engine is then as
        after ``run_until_done``, whatever step was interrupted: ``LLM.generate`` calls it when it is interrupted
        (Ctrl-C) or fails, so that the next call starts clean. A step still running on the device finishes there,
        in order before any later step, and its results are dropped."""
        self._inflight, self._aside = None, []
        aborted = []
        for seq in self._unfinished.values():
            if seq.status is Status.FINISHED:
                continue
            while seq.token_ids and seq.token_ids[-1] == PENDING:
                seq.token_ids.pop()
            seq.block_table, seq.swapped, seq.swapped_pages = [], None, 0
            seq.status, seq.finish_reason = Status.FINISHED, "abort"
            aborted.append(seq)
        self._unfinished.clear()
        sched = self.scheduler
        sched.waiting, sched.running, sched.swapped, sched.truncated = [], [], [], []
        # No request holds a page now. Rebuilding the free list (rather than releasing page by page) is also right
        # when the interruption came in the middle of handing pages out.
        self.allocator.reset()
        self._sampled = []
        return aborted

    def abort(self, seq: Sequence, finish_reason: str = "abort", stop_reason: Any = None) -> bool:
        """Ends one unfinished request now (``finish_reason`` ``"abort"`` by default; a server that finds a stop
        string passes ``"stop"`` and the string) and takes back its cache pages or its swapped-out copy at once; its
        tokens still being sampled are dropped. Returns False, changing nothing, when it had already finished. Call it
        between steps (not from another thread while ``step`` runs). A step still running on the device that
        includes it finishes there and its results for it are dropped; pages it wrote are handed out again only to
        steps queued after it. Under expert parallelism every rank must abort the same request between the same
        steps."""
        if seq.status is Status.FINISHED:
            return False
        self.scheduler.abort(seq)
        while seq.token_ids and seq.token_ids[-1] == PENDING:
            seq.token_ids.pop()
        seq.finish_reason, seq.stop_reason = finish_reason, stop_reason
        self._unfinished.pop(seq.arrival, None)
        if not self._unfinished:  # the step in flight has no request left to apply its results to
            self._inflight = None
        return True

    def _ready_to_run_ahead(self, inflight: _Launched) -> bool:
        """Whether the next batch can be scheduled before ``inflight``'s tokens are read: with asynchronous
        scheduling, when no running sequence has to be preempted and some running sequence does not end with its
        pending token. Those that may (by length; under speculative decoding, if it accepts every draft) are then
        set aside."""
        if not self.async_scheduling or not self.scheduler.next_step_fits():
            return False
        running = self.scheduler.running
        if any(s.matcher is not None for s in running):  # their masks need the pending tokens
            return False
        drafter = self.runner.drafter
        if drafter is not None and drafter.waits(running):  # speculative steps are synchronous unless launch_ahead
            return False
        ending = [
            s
            for s in dict.fromkeys(inflight.step.samplers)  # (a sequence with drafts samples several rows)
            if s.status is Status.RUNNING and self._ends_by_length(s, s.num_tokens + s.drafts_in_flight)
        ]
        if len(ending) == len(self.scheduler.running):
            return False
        for seq in ending:
            self.scheduler.set_aside(seq)
        self._aside = ending
        return True

    def _ends_by_length(self, seq: Sequence, num_tokens: int) -> bool:
        return num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens or num_tokens >= self.max_model_len

    def _launch(self, finished: list[Sequence], previous: _Launched | None = None) -> _Launched | None:
        """Schedules the next batch and queues it on the device, after ``previous`` when its tokens are still
        pending; each sequence that samples gets a ``PENDING`` token. Sequences the scheduler ends for lack of cache
        go to ``finished``."""
        batch = self.scheduler.schedule()
        truncated, self.scheduler.truncated = self.scheduler.truncated, []
        finished.extend(truncated)
        before = previous.step if previous is not None else None
        with dispatch.cached_choices():  # the draft chain and the step share their choices of implementation
            drafts = self.runner.propose(batch, before) if batch else None
            if self.sync is not None:
                self._check_step(batch, truncated)
            if not batch:
                return None
            step = self.runner.launch(batch, before, drafts)
        if self.allocator.host is not None:
            self.allocator.host.launched()
        self.stats["steps"] += 1
        for seq in batch.decodes:
            seq.num_computed += 1
        for chunk in batch.prefills:
            seq = chunk.seq
            if chunk.start == seq.num_cached_tokens and seq.num_preemptions == 0 and not chunk.recomputed:
                self.stats["cached_prompt_tokens"] += seq.num_cached_tokens  # its first chunk: admitted now
            seq.num_computed = chunk.end
            if not chunk.recomputed:
                self.stats["prefilled_tokens"] += chunk.end - chunk.start
            # prefix caching: its full prompt pages are registered once queued (later steps read them after)
            self.allocator.register(seq, min(chunk.end, seq.num_prompt_tokens), state_tokens=chunk.end)
        index, drafts = {}, {}
        for seq in step.samplers:
            if id(seq) not in index:  # (a sequence with drafts samples several rows)
                index[id(seq)] = seq.num_tokens
                seq.token_ids.append(PENDING)
        for seq in batch.decodes:
            drafts[id(seq)] = len(seq.drafts)
            seq.drafts_in_flight += len(seq.drafts)
        return _Launched(batch, step, index, drafts)

    def _apply(self, launched: _Launched, finished: list[Sequence], ahead: _Launched | None = None) -> None:
        """Waits for ``launched`` and records its results; sequences that end go to ``finished``. Sequences that
        ended while it ran (it was launched ahead) are skipped. ``ahead``: the step launched after it, whose pending
        tokens move on by the drafts this one accepted."""
        result = launched.step.result()
        batch = launched.batch
        for seq in [*batch.decodes, *(c.seq for c in batch.prefills)]:
            if seq.status is Status.FINISHED:
                continue
            for pos, lp, top in result.prompt.get(id(seq), []):
                if pos == len(seq.prompt_logprobs):
                    seq.prompt_logprobs.append(lp)
                    if seq.params.prompt_logprobs:
                        seq.prompt_top_logprobs.append(top)
            sampled = result.sampled.get(id(seq))
            if sampled is not None:
                done = self._take(seq, sampled, result, launched, ahead)
                if self.sync is not None:
                    self._sampled.append((seq.arrival, [s.token for s in sampled], seq.finish_reason))
                if done:
                    self.scheduler.finish(seq)
                    finished.append(seq)

    def _check_step(self, batch: ScheduledBatch, truncated: list[Sequence]) -> None:
        """Checks across ranks, before this step's forward, the batch every rank scheduled and the tokens read back
        since the last check."""
        decodes = [(s.arrival, s.num_computed, s.token_ids[s.num_computed], s.seed, s.drafts) for s in batch.decodes]
        prefills = [
            (c.seq.arrival, c.start, c.end, c.seq.seed, fingerprint(c.seq.token_ids[c.start : c.end]))
            + ((repr(c.seq.params),) if c.start == 0 else ())
            for c in batch.prefills
        ]
        schedule = (
            decodes,
            prefills,
            [s.arrival for s in truncated],
            self.allocator.num_free,
            self.runner.graphs is not None,
            deepinfer.batch_invariant_enabled(),
        )
        sampled, self._sampled = self._sampled, []
        self.sync.check(f"step {self.stats['steps']}", {"scheduled batch": schedule, "sampled tokens": sampled})

    def _take(
        self, seq: Sequence, sampled: list, result: StepResult, launched: _Launched, ahead: _Launched | None
    ) -> bool:
        """Records what a step sampled for ``seq``: its token, or under speculative decoding the target's tokens up
        to the first rejected draft (``speculative.py``), and the MTP layer's next draft; returns whether the
        sequence is finished."""
        n = launched.drafts.get(id(seq), 0)
        a = result.accepted.get(id(seq), 0)
        seq.drafts_in_flight -= n
        if n:
            self.spec_stats.drafted += n
            self.spec_stats.accepted += a
            self.spec_stats.verifications += 1
            seq.num_drafted += n
            seq.num_accepted += a
        index = launched.index[id(seq)]
        if a:  # the accepted drafts' tokens go before the pending token of the step launched after this one
            seq.token_ids[index + 1 : index + 1] = [PENDING] * a
            if ahead is not None and id(seq) in ahead.index:
                ahead.index[id(seq)] += a
        for i in range(a + 1):
            if self._append(seq, sampled[i], index + i):
                return True
        seq.num_computed += a  # the accepted drafts' rows hold their cache entries
        drafts = result.drafts.get(id(seq))
        if drafts is not None:
            row, token, prob = drafts[a]
            seq.next_draft, seq.draft_state = (token, prob), launched.step.draft_states[row]
        return False

    def _append(self, seq: Sequence, sampled, index: int) -> bool:
        """Puts a sampled token in place of ``seq``'s pending token ``index``; returns whether the sequence is
        finished. A finished sequence drops the pending token of a step launched after this one."""
        seq.token_ids[index] = sampled.token
        self.stats["generated_tokens"] += 1
        if seq.params.logprobs is not None:
            seq.logprobs.append(sampled.logprob)
            if seq.params.logprobs:
                seq.top_logprobs.append(sampled.top)
        params = seq.params
        if seq.matcher is not None and not seq.matcher.consume_token(sampled.token):
            # the grammar refused the token (its matcher is in error, e.g. past a parser limit): nothing can follow
            seq.finish_reason, seq.stop_reason = "error", f"structured output: {matcher_error(seq.matcher)}"
        elif sampled.token in params.stop_token_ids or (not params.ignore_eos and sampled.token in self.eos_ids):
            seq.finish_reason, seq.stop_reason = "stop", sampled.token
        elif self._ends_by_length(seq, index + 1):
            seq.finish_reason = "length"
        if seq.finish_reason is None:
            return False
        del seq.token_ids[index + 1 :]
        return True

    def run_until_done(self) -> list[Sequence]:
        """Steps until every queued request has finished; returns them in the order they finished."""
        done = []
        while self.has_unfinished():
            done.extend(self.step())
        self.check_ranks_done()
        return done

    def check_ranks_done(self) -> None:
        """With experts over several ranks: checks that every rank has run out of work and sampled the same last
        tokens (``RankDivergenceError`` otherwise; a rank still stepping fails alike). Nothing in one process."""
        if self.sync is not None:
            sampled, self._sampled = self._sampled, []
            self.sync.check("end of the requests", {"scheduled batch": None, "sampled tokens": sampled})
