"""``ModelRunner``: turns a scheduled batch into tensors, runs the model, samples, computes log-probabilities.

The paged cache of all layers is one tensor ``[layers, num_blocks, block_size, width]`` (``kv_caches[l]`` is layer
``l``'s cache as the ops take it); a sparse-attention model's indexer keys live in a second such tensor on the same
pages (``index_caches``). Decode rows come first in the packed batch (the decodes, then the tokens of chunks of
``decode_rows``, one row each), then the prefill chunks. A step of decode rows only replays a captured CUDA graph
when the backend supports them (``cuda_graphs.py``).

A step is launched (``launch``: inputs, forward, sampling and log-probabilities queued on the device, the tokens'
copy to the host started) and its result read later (``LaunchedStep.result``), so the engine can launch the next
step first. A decode token that is still being sampled (``PENDING`` in ``Sequence.token_ids``) is taken on the
device from the previous launch.

The forward and the sampling run without the ops' value checks (``deepinfer.value_checks(False)``): the page tables,
slots, positions and sequence lengths come from the allocator and the scheduler, the expert ids and offsets from the
backend's own ops, and the sampling parameters were checked by ``SamplingParams``. Each check would wait for the
device, several times per layer in an eager step. ``launch`` runs inside ``deepinfer.dispatch.cached_choices()``, and
the engine opens one block around a step's ``propose`` and ``launch``: the implementation of each op call signature is
chosen once per step, not at every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

import deepinfer
from deepinfer import dispatch, ops

from .block_manager import BlockAllocator
from .cuda_graphs import DecodeGraphs
from .deepseek_v3 import DeepseekV3
from .forward_batch import ForwardBatch, shift_decode_rows
from .greedy import greedy_tokens
from .sampling_params import step_seed, step_seeds
from .scheduler import PrefillChunk, ScheduledBatch
from .sequence import PENDING, Sequence
from .speculative import MTPDrafter, acceptance_rows, accepted_from, decode_metadata
from .structured_output import allowed_tokens

NUMPY_DTYPES = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32}


@dataclass
class SampledToken:
    token: int
    logprob: float | None = None
    top: dict[int, float] | None = None


@dataclass
class StepResult:
    """sampled: the new tokens of every sequence that produced some (one, or one per verification row under
    speculative decoding); prompt: per sequence, ``(position, logprob, top)`` of prompt tokens whose
    log-probability this step computed; drafts: under speculative decoding, per sequence and sampled token, the
    MTP layer's ``(row of LaunchedStep.draft_states, draft of the token after it, its probability)``, the
    probability None where no confidence threshold asks for it."""

    sampled: dict[int, list[SampledToken]] = field(default_factory=dict)
    prompt: dict[int, list[tuple[int, float, dict[int, float] | None]]] = field(default_factory=dict)
    drafts: dict[int, list[tuple[int, int, float | None]]] = field(default_factory=dict)
    accepted: dict[int, int] = field(default_factory=dict)


@dataclass
class LaunchedStep:
    """A step queued on the device. ``tokens``: the sampled tokens ``[len(samplers)]`` int64, on the device;
    ``result()`` waits for the step and reads them (and the log-probabilities) on the host."""

    samplers: list[Sequence] = field(default_factory=list)
    tokens: torch.Tensor | None = None
    _want: list[int] = field(default_factory=list)  # sampler indices that asked for log-probabilities
    _prompt_rows: list[tuple[Sequence, int, int]] = field(default_factory=list)
    draft_states: torch.Tensor | None = None  # speculative decoding: the MTP state of every sampler row
    draft_tokens: torch.Tensor | None = None  # ... its draft of the token after that row's token
    accepted: torch.Tensor | None = None  # ... per sampler row, the drafts its sequence accepts (accepted_from)
    first_row: dict[int, int] = field(default_factory=dict)  # id(seq) -> its first sampler row
    _host: dict[str, torch.Tensor] = field(default_factory=dict)  # device -> host copies in flight
    _ready: torch.Event | None = None  # recorded after those copies

    def result(self) -> StepResult:
        if self._ready is not None:
            self._ready.synchronize()
        out, host = StepResult(), self._host
        if self.samplers:
            tokens = host["tokens"].tolist()
            ks = [self.samplers[i].params.logprobs for i in self._want]
            by_row = dict(zip(self._want, _logprob_lists(host, "sample", ks)))
            for i, (seq, token) in enumerate(zip(self.samplers, tokens)):
                lp, top = by_row.get(i, (None, None))
                out.sampled.setdefault(id(seq), []).append(SampledToken(token, lp, top))
            if "draft_tokens" in host:
                draft_tokens = host["draft_tokens"].tolist()
                probs = host["draft_probs"].tolist() if "draft_probs" in host else [None] * len(draft_tokens)
                drafts = zip(range(len(tokens)), draft_tokens, probs)
                for seq, draft in zip(self.samplers, drafts):
                    out.drafts.setdefault(id(seq), []).append(draft)
            if "accepted" in host:
                accepted = host["accepted"].tolist()
                out.accepted = {key: accepted[row] for key, row in self.first_row.items()}
        ks = [seq.params.prompt_logprobs for seq, _, _ in self._prompt_rows]
        for (seq, _, p), (lp, top) in zip(self._prompt_rows, _logprob_lists(host, "prompt", ks)):
            out.prompt.setdefault(id(seq), []).append((p + 1, lp, top))
        return out


@dataclass
class InFlight:
    """The sequences of a step whose next tokens the step launched before it (``previous``, still running) samples,
    per sequence (``index``: ``id(seq)`` -> i): the first sampler row of ``previous`` of each (``first``, on the
    host), and where ``previous`` verified drafts, the drafts each accepts (``accepted [F]``, by how many positions
    it moves on) and the row its next input token, first draft and MTP state come from (``src [F]``: its first row
    plus those), on the device; without drafts (None) that row is its first.

    A sequence is named to the gathers below by ``key(i)``, packed into index tensors with others on the host: the
    row itself without drafts, else ``i`` (then ``src[i]`` is the row)."""

    previous: LaunchedStep
    index: dict[int, int]
    first: list[int]
    src: torch.Tensor | None = None
    accepted: torch.Tensor | None = None
    _last: tuple[torch.Tensor, torch.Tensor] | None = None  # (keys, their rows) of the last gather

    def key(self, i: int) -> int:
        return i if self.src is not None else self.first[i]

    def _rows(self, keys: torch.Tensor) -> torch.Tensor:
        if self.src is None:
            return keys
        if self._last is None or self._last[0] is not keys:  # the gathers of one key tensor share its rows
            self._last = (keys, self.src.index_select(0, keys))
        return self._last[1]

    def tokens(self, keys: torch.Tensor) -> torch.Tensor:
        return self.previous.tokens.index_select(0, self._rows(keys))

    def draft_tokens(self, keys: torch.Tensor) -> torch.Tensor:
        return self.previous.draft_tokens.index_select(0, self._rows(keys))

    def draft_states(self, keys: torch.Tensor) -> torch.Tensor:
        return self.previous.draft_states.index_select(0, self._rows(keys))

    def shifts(self, keys: torch.Tensor) -> torch.Tensor | None:
        return self.accepted.index_select(0, keys) if self.accepted is not None else None


@dataclass
class Drafts:
    """What speculative decoding hands a step's launch: ``flying`` (``InFlight``, or None) and the drafts the MTP
    chain made on the device (``MTPDrafter.propose``)."""

    flying: InFlight | None = None
    chained: list[tuple[list[int], torch.Tensor]] = field(default_factory=list)


class ModelRunner:
    """Runs one scheduled batch at a time on ``model`` over ``kv_cache [layers, blocks, block_size, width]``."""

    def __init__(
        self,
        model: DeepseekV3,
        kv_cache: torch.Tensor,
        allocator: BlockAllocator,
        *,
        graphs: DecodeGraphs | None = None,
        index_cache: torch.Tensor | None = None,
        drafter: MTPDrafter | None = None,
    ):
        self.model, self.kv_cache, self.allocator = model, kv_cache, allocator
        self.drafter = drafter  # speculative decoding: the MTP pass after every forward (speculative.py)
        self.kv_caches = list(kv_cache.unbind(0))
        self.index_cache = index_cache  # [layers, blocks, block_size, width] for sparse attention, on the same pages
        self.index_caches = list(index_cache.unbind(0)) if index_cache is not None else None
        self.device = kv_cache.device
        self.graphs = graphs

    def _paged(self) -> list[torch.Tensor]:
        return [self.kv_cache] if self.index_cache is None else [self.kv_cache, self.index_cache]

    # Cache pages to host memory and back (swap preemption).
    def swap_out(self, blocks: list[int]) -> list[torch.Tensor]:
        index = torch.tensor(blocks, device=self.device)
        return [cache[:, index].to("cpu") for cache in self._paged()]

    def swap_in(self, host: list[torch.Tensor], blocks: list[int]) -> None:
        index = torch.tensor(blocks, device=self.device)
        for cache, pages in zip(self._paged(), host):
            cache[:, index] = pages.to(self.device)

    def _tensor(self, values, dtype: torch.dtype) -> torch.Tensor:
        """``values`` (a list, a list of equal lists, or an array) as a device tensor, without waiting for the
        device."""
        # through numpy: 3x faster than torch.tensor on the long lists of a prefill chunk (ids, positions, slots)
        array = np.asarray(values, dtype=NUMPY_DTYPES[dtype])
        if self.device.type != "cuda":
            return torch.from_numpy(array).to(self.device, non_blocking=True)
        # From pinned memory: a copy from pageable memory may first wait for the work queued on the stream (CUDA's
        # API synchronisation rules), which would hold the host behind the step in flight. The host allocator keeps
        # the pinned block until the copy is done.
        host = torch.empty(array.shape, dtype=dtype, pin_memory=True)
        host.numpy()[...] = array
        return host.to(self.device, non_blocking=True)

    def prepare(
        self, batch: ScheduledBatch, drafts: Drafts | None = None
    ) -> tuple[torch.Tensor, ForwardBatch, torch.Tensor | None]:
        """Packed input ids and the forward metadata of ``batch``, and the shift of its decode rows (``carried``);
        decode tokens still being sampled, and drafts made on the device, are taken from ``drafts``, on the
        device."""
        bs, alloc = self.allocator.block_size, self.allocator
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        decode_rows = _decode_rows(batch)
        prefills = [ch for ch in _chunks(batch) if not ch.decode_rows]
        for seq, p in decode_rows:
            ids.append(_token(seq, p))
            pos.append(p)
            slots.append(alloc.slot(seq, p))
        fb = ForwardBatch(positions=None, slot_mapping=None, num_decode=len(decode_rows))
        if decode_rows:
            width = max(len(s.block_table) for s, _ in decode_rows)
            table = [s.block_table + [0] * (width - len(s.block_table)) for s, _ in decode_rows]
            fb.block_table = self._tensor(table, torch.int32)
            fb.seq_lens = self._tensor([p + 1 for _, p in decode_rows], torch.int32)
        if prefills:
            cu_q, cu_k, ctx = [0], [0], []
            if self.index_caches is not None:  # sparse attention's indexer reads the chunks' pages
                width = max(len(ch.seq.block_table) for ch in prefills)
                fb.prefill_block_table = self._tensor(
                    [ch.seq.block_table + [0] * (width - len(ch.seq.block_table)) for ch in prefills],
                    torch.int32,
                )
            for ch in prefills:
                seq = ch.seq
                ids.extend(seq.token_ids[ch.start : ch.end])
                pos.extend(range(ch.start, ch.end))
                table = torch.tensor(seq.block_table, dtype=torch.int64)
                p = torch.arange(ch.end)
                seq_slots = table[alloc.seq_pages + p // bs] * bs + p % bs
                slots.extend(seq_slots[ch.start :].tolist())
                ctx.append(seq_slots)
                cu_q.append(cu_q[-1] + ch.end - ch.start)
                cu_k.append(cu_k[-1] + ch.end)
            fb.cu_seqlens_q = self._tensor(cu_q, torch.int32)
            fb.cu_seqlens_k = self._tensor(cu_k, torch.int32)
            fb.context_slots = self._tensor(torch.cat(ctx).numpy(), torch.int64)
        fb.rows = _runs(decode_rows) + [(ch.seq, ch.start, ch.end - ch.start) for ch in prefills]
        fb.positions = self._tensor(pos, torch.int32)
        fb.slot_mapping = self._tensor(slots, torch.int64)
        input_ids = self._tensor(ids, torch.int64)
        carried, shift = self.carried(batch, decode_rows, drafts or Drafts())
        if carried is not None:
            input_ids.index_copy_(0, *carried)
        if shift is not None:
            shift_decode_rows(fb, shift, bs, alloc.seq_pages)
        return input_ids, fb, shift

    def _logit_rows(self, batch: ScheduledBatch) -> tuple[list[int], list[Sequence], list[tuple[Sequence, int, int]]]:
        """Rows whose logits are needed: ``sample_rows`` (one per sequence that samples, with ``samplers``; one per
        verification row of a sequence with drafts, the sequence repeated) and ``prompt_rows`` ``(seq, row,
        position)`` predicting prompt token ``position + 1``."""
        sample_rows, samplers, prompt_rows = [], [], []
        for seq in batch.decodes:
            for _ in range(1 + len(seq.drafts)):
                sample_rows.append(len(sample_rows))
                samplers.append(seq)
        row = len(sample_rows)
        for ch in _chunks(batch):
            seq = ch.seq
            if seq.wants_prompt_logprobs:
                first = max(ch.start, len(seq.prompt_logprobs) - 1)
                last = min(ch.end, seq.num_prompt_tokens - 1)
                prompt_rows.extend((seq, row + p - ch.start, p) for p in range(first, last))
            if ch.end == seq.num_tokens:
                sample_rows.append(row + ch.end - ch.start - 1)
                samplers.append(seq)
            row += ch.end - ch.start
        return sample_rows, samplers, prompt_rows

    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Runs the model on ``batch`` and waits for it; returns the sampled tokens and the log-probabilities asked
        for."""
        return self.launch(batch).result()

    def in_flight(self, batch: ScheduledBatch, previous: LaunchedStep | None) -> InFlight | None:
        """The sequences of ``batch`` whose last token ``previous`` (the step launched before, still running)
        samples; None when there are none."""
        if previous is None:
            return None
        seqs = [s for s in (*batch.decodes, *(c.seq for c in batch.prefills)) if s.token_ids[-1] == PENDING]
        seqs = [s for s in seqs if id(s) in previous.first_row]
        if not seqs:
            return None
        flying = InFlight(previous, {id(s): i for i, s in enumerate(seqs)}, [previous.first_row[id(s)] for s in seqs])
        if previous.accepted is not None:
            first = self._tensor(flying.first, torch.int64)
            flying.accepted = previous.accepted.index_select(0, first)
            flying.src = first + flying.accepted
        return flying

    def propose(self, batch: ScheduledBatch, previous: LaunchedStep | None = None) -> Drafts:
        """Speculative decoding: sets the drafts each decoding sequence of ``batch`` verifies
        (``MTPDrafter.propose``), from the host's state or from ``previous`` where that step is still running."""
        drafts = Drafts(self.in_flight(batch, previous))
        if self.drafter is not None:
            self.drafter.admit([*batch.decodes, *(c.seq for c in batch.prefills)])
            if self.drafter.any_speculates(batch.decodes):  # (a sequence that does not speculate never has drafts)
                drafts.chained = self.drafter.propose(batch.decodes, self._tensor, self.graphs, drafts.flying)
        return drafts

    def carried(
        self, batch: ScheduledBatch, rows: list[tuple[Sequence, int]], drafts: Drafts
    ) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor | None]:
        """For the decode ``rows`` of ``batch``: those whose input id is known on the device only, as ``(row
        indices, input ids)`` (the tokens and first drafts the step in flight samples, the drafts chained on the
        device), or None; and the shift ``[len(rows)]`` of every row's position by the drafts the step in flight
        accepts, or None when no sequence in flight verified drafts."""
        flying = drafts.flying
        index = flying.index if flying is not None else {}
        at, which, first_draft = [], [], []
        for i, (seq, p) in enumerate(rows):
            if _token(seq, p) != PENDING or p > seq.num_tokens:  # known, or a chained draft (below)
                continue
            if id(seq) not in index:
                raise RuntimeError(f"request {seq.request_id!r} decodes a token that the previous step did not sample")
            at.append(i)
            which.append(flying.key(index[id(seq)]))
            first_draft.append(int(p == seq.num_tokens))
        chain_at = []
        if drafts.chained:
            base, start = [], 0
            for seq in batch.decodes:
                base.append(start)
                start += 1 + len(seq.drafts)
            for j, (chain_rows, _) in enumerate(drafts.chained):  # chain step j makes draft j + 1
                chain_at.extend(base[i] + 2 + j for i in chain_rows)
        moved: list[tuple[int, int]] = []
        if flying is not None and flying.accepted is not None:
            moved = [(i, flying.key(index[id(seq)])) for i, (seq, _) in enumerate(rows) if id(seq) in index]
        parts = [at + chain_at, which, first_draft, [i for i, _ in moved], [f for _, f in moved]]
        if not any(parts):
            return None, None
        # one copy to the device for every index list (the rows of `at` and `chain_at` side by side: one index)
        packed = self._tensor([v for part in parts for v in part], torch.int64)
        rows_t, which_t, first_t, moved_t, moved_which_t = packed.split([len(part) for part in parts])
        tokens = []
        if at:
            taken = flying.tokens(which_t)
            if any(first_draft):
                taken = torch.where(first_t.bool(), flying.draft_tokens(which_t), taken)
            tokens.append(taken)
        tokens += [chain_tokens for _, chain_tokens in drafts.chained]
        carried = None
        if at or chain_at:
            carried = (rows_t, tokens[0] if len(tokens) == 1 else torch.cat(tokens))
        shift = None
        if moved:
            shift = flying.shifts(moved_which_t)
            if len(moved) < len(rows):
                shift = torch.zeros(len(rows), dtype=shift.dtype, device=self.device).index_copy_(0, moved_t, shift)
        return carried, shift

    def launch(
        self, batch: ScheduledBatch, previous: LaunchedStep | None = None, drafts: Drafts | None = None
    ) -> LaunchedStep:
        """Queues ``batch``'s forward, sampling and log-probabilities on the device and starts copying what the host
        needs, without waiting for the device. ``previous``: the step launched before, whose tokens are still
        pending; ``drafts``: what ``propose`` made for this step (speculative decoding)."""
        with dispatch.cached_choices():  # a step's many calls of equal signatures choose their implementation once
            return self._launch(batch, previous, drafts)

    def _launch(self, batch: ScheduledBatch, previous: LaunchedStep | None, drafts: Drafts | None) -> LaunchedStep:
        if drafts is None:
            drafts = Drafts(self.in_flight(batch, previous))
        sample_rows, samplers, prompt_rows = self._logit_rows(batch)
        rows = sample_rows + [r for _, r, _ in prompt_rows]
        decode_rows = _decode_rows(batch)
        use_graph = (
            self.graphs is not None
            # chunks of decode rows put several rows of one sequence in a step: not in a state-page model's graphs
            and (not batch.prefills or (all(ch.decode_rows for ch in batch.prefills) and self.graphs.pad_page is None))
            and self.graphs.fits(len(decode_rows))
            and self.graphs.invariant == deepinfer.batch_invariant_enabled()
        )
        greedy = None  # the graph's greedy tokens, taken inside it
        carried, shift = self.carried(batch, decode_rows, drafts) if use_graph else (None, None)
        if use_graph:
            logits, greedy = self.graphs.run(
                input_ids=[_token(s, p) for s, p in decode_rows],
                pending=carried,
                shift=shift,
                **decode_metadata(decode_rows, self.allocator),
            )
            hidden, fb = self.graphs.replayed()
            input_ids = self.graphs.wide
            if batch.prefills and rows != list(range(len(decode_rows))):  # a chunk's last row samples, others may score
                index = self._tensor(rows, torch.int64)
                logits, greedy = logits.index_select(0, index), greedy.index_select(0, index[: len(sample_rows)])
        else:
            input_ids, fb, shift = self.prepare(batch, drafts)
            with deepinfer.value_checks(False):
                hidden = self.model.forward(input_ids, fb, self.kv_caches, self.index_caches)
            logits = self.model.compute_logits(hidden[self._tensor(rows, torch.int64)]) if rows else None
        step = LaunchedStep(samplers=samplers, _prompt_rows=prompt_rows)
        # the MTP layer's cache of prompt rows is always written (a prefix-cache hit may speculate); decode rows'
        # only where a sequence speculates
        mtp = self.drafter is not None and (bool(batch.prefills) or self.drafter.any_speculates(batch.decodes))
        if not rows:
            if mtp:  # the MTP layer's cache entries of these prompt rows
                self._draft(step, batch, hidden, fb, [], use_graph and self.graphs.replays_mtp(hidden.shape[0]))
            return step
        host = {}
        if samplers:
            sample_logits = logits[: len(sample_rows)]
            allowed = self._apply_grammars(sample_logits, samplers)
            verify = sum(1 + len(s.drafts) for s in batch.decodes)  # sampler rows that are decode rows
            if shift is not None:  # the sampler rows' shifts (they count their positions in the seeds)
                shift = shift[:verify]
                if len(samplers) > verify:  # prompt rows do not move
                    shift = torch.cat([shift, shift.new_zeros(len(samplers) - verify)])
            with deepinfer.value_checks(False):
                tokens = self._sample(allowed, samplers, None if allowed is not sample_logits else greedy, shift)
            # the graph's greedy tokens are its output, which the next replay of any graph (one memory pool) may
            # overwrite: a step launched after this one reads this step's own copy
            step.tokens = tokens.to(torch.int64, copy=tokens is greedy)
            host["tokens"] = step.tokens
            for r, seq in enumerate(samplers):
                step.first_row.setdefault(id(seq), r)
            if verify > len(batch.decodes):
                host["accepted"] = step.accepted = self._accepted(step, input_ids, verify)
            step._want = [i for i, s in enumerate(samplers) if s.params.logprobs is not None]
            if step._want:
                want = self._tensor(step._want, torch.int64)
                kmax = max(samplers[i].params.logprobs for i in step._want)
                _logprob_tensors(host, "sample", sample_logits[want], step.tokens[want], kmax)
        if mtp:
            graphed = use_graph and self.graphs.replays_mtp(hidden.shape[0])
            host.update(self._draft(step, batch, hidden, fb, sample_rows, graphed))
        if prompt_rows:
            targets = self._tensor([seq.token_ids[p + 1] for seq, _, p in prompt_rows], torch.int64)
            kmax = max(seq.params.prompt_logprobs for seq, _, _ in prompt_rows)
            _logprob_tensors(host, "prompt", logits[len(sample_rows) :], targets, kmax)
        if self.device.type == "cpu":
            step._host = host
        else:  # pinned copies, waited for by the event: the host does not wait for work queued after this step
            step._host = {k: v.to("cpu", non_blocking=True) for k, v in host.items()}
            step._ready = torch.Event(device=self.device)
            step._ready.record()
        return step

    def _accepted(self, step: LaunchedStep, input_ids: torch.Tensor, verify: int) -> torch.Tensor:
        """Per sampler row, the drafts its sequence accepts (``accepted_from``), on the device: the first
        ``verify`` rows are the decode rows, where each sequence's rows after its first take its drafts as input."""
        samplers = step.samplers
        first = [step.first_row[id(seq)] for seq in samplers]
        follow = [r + 1 if r + 1 < verify and samplers[r + 1] is seq else -1 for r, seq in enumerate(samplers)]
        return accepted_from(step.tokens, input_ids, self._tensor(acceptance_rows(first, follow), torch.int64))

    def _draft(
        self,
        step: LaunchedStep,
        batch: ScheduledBatch,
        hidden: torch.Tensor,
        fb: ForwardBatch,
        sample_rows: list,
        graphed: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Speculative decoding: the MTP pass over the forward's rows (``hidden``, padded rows included), each row
        with the token after it (its sampled token where it samples), from the MTP graph of the decode graph just
        replayed when ``graphed``; keeps the sampler rows' MTP states in ``step.draft_states`` and returns their
        drafts and probabilities, on the device."""
        rows = _decode_rows(batch)
        rows += [(ch.seq, p) for ch in _chunks(batch) if not ch.decode_rows for p in range(ch.start, ch.end)]
        after = [_token(seq, p + 1) if p + 1 < seq.num_tokens else 0 for seq, p in rows]
        after += [0] * (hidden.shape[0] - len(after))  # CUDA-graph padding
        both = self._tensor([max(t, 0) for t in after] + sample_rows, torch.int64)
        next_ids, index = both[: len(after)], both[len(after) :]
        if sample_rows:  # each sampler row's sampled token
            next_ids.index_copy_(0, index, step.tokens)
        if graphed:  # the rows of the decode graph just replayed
            outs = self.graphs.run_mtp(hidden, next_ids)
            step.draft_states, tokens, probs = (None if t is None else t.index_select(0, index) for t in outs)
        else:
            with deepinfer.value_checks(False):
                step.draft_states, tokens, probs = self.drafter.run(hidden, next_ids, fb, index)
        step.draft_tokens = tokens
        if not sample_rows:
            return {}
        return {"draft_tokens": tokens} if probs is None else {"draft_tokens": tokens, "draft_probs": probs}

    def _apply_grammars(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """``logits`` (one row per sampler row of ``seqs``: a sequence with drafts has one per verification row)
        with each structured-output row's disallowed tokens at ``-inf``; ``logits`` itself when no sequence has a
        grammar."""
        rows, matchers = [], []
        for i, (seq, offset) in enumerate(_row_offsets(seqs)):
            if seq.matcher is not None:
                rows.append(i)
                if offset == 0:
                    matchers.append((seq.matcher, seq.drafts))
        if not rows:
            return logits
        pin = self.device.type != "cpu"
        mask = allowed_tokens(matchers, logits.shape[1], pin=pin).to(self.device, non_blocking=pin)
        index = self._tensor(rows, torch.int64)
        return logits.index_copy(0, index, ops.apply_token_bitmask(logits.index_select(0, index), mask))

    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence], greedy: torch.Tensor | None, shift: torch.Tensor | None
    ) -> torch.Tensor:
        """The next token of each of ``seqs`` (one row of ``logits`` each; a sequence with drafts has one row per
        verification row, each drawn with the seed of the generated position it samples); ``greedy``: their greedy
        tokens, already taken (by a decode graph), or None; ``shift``: per row, the positions its sequence moves on
        by the drafts the step in flight accepts (on the device), or None."""
        params = [s.params for s in seqs]
        if all(p.temperature == 0 for p in params):  # greedy rows need no filtering, seeds or value checks
            return greedy if greedy is not None else greedy_tokens(logits)
        if shift is None:
            seeds = self._tensor([step_seed(s.seed, s.num_generated + i) for s, i in _row_offsets(seqs)], torch.int64)
        else:
            rows = self._tensor(
                [[s.seed for s in seqs], [s.num_generated + i for s, i in _row_offsets(seqs)]], torch.int64
            )
            seeds = step_seeds(rows[0], rows[1] + shift)
        vocab = logits.shape[1]  # a top_k of the vocabulary or more keeps every token: it is off (and fits int32)
        return ops.sample(
            logits,
            self._tensor([float(p.temperature) for p in params], torch.float32),
            self._tensor([float(p.top_p) for p in params], torch.float32),
            self._tensor([0 if p.top_k >= vocab else p.top_k for p in params], torch.int32),
            seeds,
        )


def _runs(rows: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int, int]]:
    """``(seq, first position, count)`` of each run of consecutive positions of one sequence in ``rows``."""
    out: list[tuple[Sequence, int, int]] = []
    for seq, p in rows:
        if out and out[-1][0] is seq and out[-1][1] + out[-1][2] == p:
            out[-1] = (seq, out[-1][1], out[-1][2] + 1)
        else:
            out.append((seq, p, 1))
    return out


def _row_offsets(seqs: list[Sequence]) -> list[tuple[Sequence, int]]:
    """``(seq, i)`` per sampler row: the row samples ``seq``'s ``i``-th token from now (``i > 0``: after drafts)."""
    seen: dict[int, int] = {}
    out = []
    for s in seqs:
        i = seen[id(s)] = seen.get(id(s), -1) + 1
        out.append((s, i))
    return out


def _decode_rows(batch: ScheduledBatch) -> list[tuple[Sequence, int]]:
    """The decode rows ``(seq, position)`` of ``batch``, in packing order: each decoding sequence's pending token
    and its drafts, then the tokens of the chunks of ``decode_rows``."""
    rows = [(seq, seq.num_computed + i) for seq in batch.decodes for i in range(1 + len(seq.drafts))]
    return rows + [(ch.seq, p) for ch in _chunks(batch) if ch.decode_rows for p in range(ch.start, ch.end)]


def _token(seq: Sequence, position: int) -> int:
    """The token of ``seq`` at ``position``: one of its tokens, or one of its drafts past them."""
    n = seq.num_tokens
    return seq.token_ids[position] if position < n else seq.drafts[position - n]


def _chunks(batch: ScheduledBatch) -> list[PrefillChunk]:
    """``batch.prefills`` in the order their rows are packed: the chunks of ``decode_rows`` first."""
    return [ch for ch in batch.prefills if ch.decode_rows] + [ch for ch in batch.prefills if not ch.decode_rows]


def _logprob_tensors(out: dict[str, torch.Tensor], name: str, logits: torch.Tensor, targets: torch.Tensor, kmax: int):
    """Puts into ``out``, on the device: ``{name}_chosen``, the log-probability of ``targets[i]`` under
    ``log_softmax(logits[i])``, and for ``kmax > 0`` the ``kmax`` most likely tokens of each row (``{name}_top``)
    with theirs (``{name}_top_lp``)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    out[f"{name}_chosen"] = lp.gather(1, targets[:, None])[:, 0]
    if kmax > 0:
        out[f"{name}_top_lp"], out[f"{name}_top"] = lp.topk(min(kmax, lp.shape[1]), dim=-1)


def _logprob_lists(host: dict[str, torch.Tensor], name: str, ks: list[int]) -> list[tuple[float, dict | None]]:
    """Per row of ``_logprob_tensors``' output (now on the host): the chosen token's log-probability and, for
    ``ks[i] > 0``, a dict of the ``ks[i]`` most likely tokens with theirs."""
    if not ks:
        return []
    chosen = host[f"{name}_chosen"].tolist()
    tops: list[dict[int, float] | None] = [None] * len(ks)
    if f"{name}_top" in host:
        vals, idx = host[f"{name}_top_lp"].tolist(), host[f"{name}_top"].tolist()
        tops = [dict(zip(idx[i][:k], vals[i][:k])) if k > 0 else None for i, k in enumerate(ks)]
    return list(zip(chosen, tops))
