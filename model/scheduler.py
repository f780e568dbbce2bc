"""``Scheduler``: continuous batching with chunked prefill and preemption.

Every step it builds one batch under a token budget (``max_num_batched_tokens``) and a seat limit
(``max_num_seqs``), oldest request first:

1. swapped-out sequences come back when their pages fit again beside what the running sequences need for their own
   next step (else a sequence swapped back in could take the pages an older one's prefill waits for, be preempted
   for it as the newest, and come back again, for ever);
2. every running sequence whose only pending token is a generated one decodes it; if the cache has no page for it, the
   newest running sequence not yet scheduled is preempted (possibly the one asking);
3. running sequences in the middle of their prefill get their next chunk, then waiting requests are admitted
   (none while a preempted sequence waits to come back).

A prompt is prefilled in chunks that end at multiples of ``chunk_size`` (the last one shorter), so how a request is
split never depends on what else runs with it: with batch-invariant ops its tokens are bitwise the same alone or in
any batch. Preemption copies the victim's pages to host memory (``swap``) and copies them back when it resumes:
nothing is recomputed and the resumed request continues exactly where it stopped. ``recompute`` drops the pages
instead and computes them again as they were first computed: the prompt in the same chunks, then the generated
tokens in chunks of decode rows (``PrefillChunk.decode_rows``), so that with batch-invariant ops the cache and every
later token are bitwise those of a run without preemption. A sequence that outgrows the whole cache while running
alone finishes with ``finish_reason="length"``.

Under speculative decoding (``lookahead`` > 0) a decoding sequence also gets token budget and free pages for up to
``lookahead`` draft tokens (``Sequence.max_drafts``), verified in the same step (``speculative.py``).

Prefix caching (``_reuse_prefix``, ``block_manager.py``): a request is admitted with the longest cached prefix of its
prompt already in place, in whole chunks, and prefills only the rest.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import deepinfer

from .block_manager import BlockAllocator
from .sequence import Sequence, Status

PREEMPTION_MODES = ("swap", "recompute")


@dataclass
class PrefillChunk:
    """Tokens ``[start, end)`` of ``seq`` to compute this step: prompt tokens (prefill), or tokens the sequence
    generated before it was preempted by recomputation (``recomputed``). ``short``: a prompt chunk that ends within
    the scheduler's ``decode_row_tokens``."""

    seq: Sequence
    start: int
    end: int
    short: bool = False

    @property
    def recomputed(self) -> bool:
        """Generated tokens computed again after preemption by recomputation."""
        return self.start >= self.seq.num_prompt_tokens

    @property
    def decode_rows(self) -> bool:
        """Whether the chunk goes through the decode path, one row per token (each attending to the cache up to
        itself, which this step's earlier rows write first). Recomputed tokens do, as they did when they were
        decoded: the prefill path rounds differently, and its cache entries and logits would differ from those the
        request had before it was preempted. Short chunks do so that they run inside the decode step's CUDA graphs,
        one replay instead of an eager forward's launches."""
        return self.short or self.recomputed


@dataclass
class ScheduledBatch:
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(c.end - c.start for c in self.prefills)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)


class Scheduler:
    """Decides what runs each step. ``swap_out(blocks) -> handle`` and ``swap_in(handle, blocks)`` move a
    sequence's pages to host memory and back (used by the ``swap`` preemption mode)."""

    def __init__(
        self,
        allocator: BlockAllocator,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        chunk_size: int,
        preemption_mode: str = "swap",
        swap_out: Callable[[list[int]], Any] | None = None,
        swap_in: Callable[[Any, list[int]], None] | None = None,
        lookahead: int = 0,
        max_model_len: int | None = None,
        decode_row_tokens: int = 0,
    ):
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
        if preemption_mode == "swap" and (swap_out is None or swap_in is None):
            raise ValueError("swap preemption needs swap_out and swap_in")
        if chunk_size < 1 or max_num_batched_tokens < chunk_size or max_num_seqs < 1:
            raise ValueError(
                f"need chunk_size >= 1, max_num_batched_tokens >= chunk_size and max_num_seqs >= 1; got "
                f"{chunk_size}, {max_num_batched_tokens}, {max_num_seqs}"
            )
        self.allocator = allocator
        self.max_num_seqs, self.max_num_batched_tokens, self.chunk_size = (
            max_num_seqs,
            max_num_batched_tokens,
            chunk_size,
        )
        self.preemption_mode, self._swap_out, self._swap_in = preemption_mode, swap_out, swap_in
        self.lookahead, self.max_model_len = lookahead, max_model_len
        self.decode_row_tokens = decode_row_tokens
        self.waiting: list[Sequence] = []  # each list is kept in arrival order
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.num_preemptions = 0
        self.truncated: list[Sequence] = []  # finished because the whole cache could not hold them (engine drains)

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        _insert(self.waiting, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def chunk_end(self, seq: Sequence) -> int:
        """End of the next chunk of ``seq``: the next multiple of ``chunk_size``, or the end of the prompt while the
        prompt is prefilled (a chunk never holds both prompt and generated tokens), or the last token."""
        last = seq.num_prompt_tokens if seq.num_computed < seq.num_prompt_tokens else seq.num_tokens
        return min((seq.num_computed // self.chunk_size + 1) * self.chunk_size, last)

    def _chunk(self, seq: Sequence, end: int) -> PrefillChunk:
        """The chunk of ``seq`` from what it has computed to ``end``: short (``PrefillChunk.short``) where it ends
        within ``decode_row_tokens`` (its positions alone decide, never what runs beside it), except in
        batch-invariant mode, which keeps the prefill path: a request's bits then do not depend on whether the engine
        captured decode graphs."""
        short = end <= min(self.decode_row_tokens, seq.num_prompt_tokens) and not deepinfer.batch_invariant_enabled()
        return PrefillChunk(seq, seq.num_computed, end, short)

    def finish(self, seq: Sequence) -> None:
        """Takes a finished sequence out and frees its pages."""
        if seq in self.running:
            self.running.remove(seq)
        self.allocator.release(seq)
        seq.status = Status.FINISHED

    def abort(self, seq: Sequence) -> None:
        """Takes ``seq`` out of whichever queue holds it (or of the sequences set aside) and frees its pages and
        its swapped-out copy; it is then ``FINISHED`` (the engine sets the reason)."""
        for queue in (self.waiting, self.running, self.swapped):
            if seq in queue:
                queue.remove(seq)
        if seq.block_table:
            self.allocator.release(seq)
        seq.swapped, seq.swapped_pages = None, 0
        seq.status = Status.FINISHED

    def set_aside(self, seq: Sequence) -> None:
        """Takes a running sequence out of the next batches; it keeps its pages until ``finish`` or ``resume``."""
        self.running.remove(seq)

    def resume(self, seq: Sequence) -> None:
        """Puts a sequence set aside back among the running ones."""
        _insert(self.running, seq)

    def schedule(self) -> ScheduledBatch:
        """The next batch (empty only when nothing is left to run)."""
        batch = self._schedule()
        if not batch and not self.running and (self.swapped or self.waiting):
            queue = self.swapped or self.waiting
            seq = queue[0]
            if self._pages_for_next_step(seq) <= self.allocator.num_blocks:
                return self.schedule()  # pages were freed after it was considered this round: it fits now
            # Even the whole cache cannot hold its next step: it has reached the cache's capacity.
            queue.pop(0)
            seq.swapped, seq.swapped_pages = None, 0
            seq.status, seq.finish_reason = Status.FINISHED, "length"
            self.truncated.append(seq)
            return self.schedule()
        if not batch and self.running:
            # Every running sequence waits for pages that only another running one can free.
            if len(self.running) > 1:
                self._preempt(self.running[-1])
                return self.schedule()
            seq = self.running[0]
            need = self.allocator.blocks_for(seq.num_tokens)
            raise RuntimeError(
                f"request {seq.request_id!r} needs {need} cache pages for {seq.num_tokens} tokens; the cache has "
                f"{self.allocator.num_blocks}"
            )
        return batch

    def _schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()

        reserved = self._pages_for_running()
        while self.swapped and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            if self._pages_for_next_step(seq) > self.allocator.num_free - reserved:
                break
            self.swapped.pop(0)
            seq.block_table = self.allocator.allocate(seq.swapped_pages)
            self._swap_in(seq.swapped, seq.block_table)
            seq.swapped, seq.swapped_pages = None, 0
            seq.status = Status.RUNNING
            _insert(self.running, seq)

        decoding = [s for s in self.running if s.status is Status.RUNNING and s.is_decode]
        # pages the decoding sequences not scheduled yet need for their own step: drafts never take them
        drafting = self.lookahead and any(s.speculates is not False for s in decoding)
        needs = [self.allocator.missing(s, self._next_end(s)) if drafting else 0 for s in decoding]
        later = sum(needs)
        for seq, need in zip(decoding, needs):
            later -= need
            if seq.status is not Status.RUNNING or budget == 0:  # (preempted for a sequence before it)
                continue
            if not self._make_room(seq, self._next_end(seq), scheduled):
                continue
            seq.max_drafts = self._lookahead(seq, budget, later)
            self.allocator.grow(seq, self._next_end(seq) + seq.max_drafts)
            batch.decodes.append(seq)
            scheduled.add(id(seq))
            budget -= 1 + seq.max_drafts

        for seq in self.running:
            if seq.is_decode or id(seq) in scheduled:
                continue
            end = self.chunk_end(seq)
            if end - seq.num_computed > budget or not self.allocator.can_grow(seq, end):
                break
            self.allocator.grow(seq, end)
            batch.prefills.append(self._chunk(seq, end))
            scheduled.add(id(seq))
            budget -= end - seq.num_computed

        while self.waiting and not self.swapped and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            self._reuse_prefix(seq)
            end = self.chunk_end(seq)
            if end - seq.num_computed > budget or not self.allocator.can_grow(seq, end) or self._waits_for_prefix(seq):
                if seq.num_computed:  # not admitted: give the cached pages back until it is
                    self.allocator.release(seq)
                    seq.num_computed = 0
                break
            self.waiting.pop(0)
            seq.status = Status.RUNNING
            _insert(self.running, seq)
            self.allocator.grow(seq, end)
            batch.prefills.append(self._chunk(seq, end))
            scheduled.add(id(seq))
            budget -= end - seq.num_computed
        return batch

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Prefix caching: a request about to be admitted with nothing computed starts after the longest cached
        prefix of its prompt (``BlockAllocator.match``), in whole chunks (a multiple of ``chunk_size`` and of the
        page size): its remaining chunks are then exactly those a run without the cache computes, over the same
        cache entries, so a hit gives the same bits as a miss. At least the last prompt token is computed (its
        logits give the first token); a request that asks for prompt log-probabilities computes its whole prompt."""
        if seq.num_computed or seq.block_table or seq.params.prompt_logprobs is not None:
            return
        align = math.lcm(self.chunk_size, self.allocator.reuse_tokens)
        seq.num_computed = self.allocator.match(seq, seq.num_prompt_tokens - 1, align)
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed

    def _waits_for_prefix(self, seq: Sequence) -> bool:
        """Prefix caching: whether the next whole chunk of ``seq``'s prompt is being prefilled by a running sequence
        with the same tokens from the start (its pages not registered yet). ``seq`` then waits for them (and the
        requests behind it with it) instead of computing the same prefix a second time: requests that arrive
        together with a shared prefix prefill it once."""
        alloc = self.allocator
        if not alloc.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return False
        align = math.lcm(self.chunk_size, alloc.reuse_tokens)
        if seq.num_computed + align > seq.num_prompt_tokens - 1:
            return False  # no further whole chunk to gain
        i = seq.num_computed // alloc.block_size
        (key,) = alloc.page_keys(seq, i + 1)[i:]
        for owner in self.running:
            if owner.num_computed >= owner.num_prompt_tokens or i < owner.num_registered_pages:
                continue
            if (i + 1) * alloc.block_size <= owner.num_prompt_tokens and alloc.page_keys(owner, i + 1)[i] == key:
                return True
        return False

    def _lookahead(self, seq: Sequence, budget: int, reserved: int) -> int:
        """Draft tokens a decoding ``seq`` may verify this step (speculative decoding): ``lookahead``, fewer where
        the token budget, the context or the free pages end first. Drafts take only free pages beyond the
        ``reserved`` ones (those the decoding sequences after it need for their own step), so they never preempt
        another sequence: a step scheduled ahead of the one in flight preempts nobody (``next_step_fits``). 0 for a
        sequence that does not speculate (``Sequence.speculates``)."""
        if seq.speculates is False:
            return 0
        extra = min(self.lookahead, budget - 1)
        end = self._next_end(seq)
        if self.max_model_len is not None:
            extra = min(extra, self.max_model_len - end)
        while extra > 0 and self.allocator.missing(seq, end + extra) > self.allocator.num_free - reserved:
            extra -= 1
        return max(extra, 0)

    def next_step_fits(self) -> bool:
        """Whether every running sequence has the pages for its next step: the next ``schedule`` then preempts
        nobody."""
        return self._pages_for_running() <= self.allocator.num_free

    def _pages_for_running(self) -> int:
        """Pages the running sequences still need for their next steps."""
        return sum(self.allocator.missing(s, self._next_end(s)) for s in self.running)

    def _next_end(self, seq: Sequence) -> int:
        """Tokens ``seq`` holds after its next step: one more in decode, the next chunk's end in prefill. Under
        speculative decoding ahead of the host, the drafts of the step in flight count as accepted
        (``Sequence.drafts_in_flight``): where the sequence stands is known on the device only."""
        return seq.num_computed + 1 + seq.drafts_in_flight if seq.is_decode else self.chunk_end(seq)

    def _pages_for_next_step(self, seq: Sequence) -> int:
        """Pages ``seq`` holds after its next step (for a swapped sequence, at least the pages it comes back to)."""
        return max(seq.swapped_pages, self.allocator.blocks_for(self._next_end(seq)))

    def _make_room(self, seq: Sequence, num_tokens: int, scheduled: set[int]) -> bool:
        """Preempts the newest unscheduled running sequences until ``seq`` can hold ``num_tokens``; False when
        ``seq`` itself had to go."""
        while not self.allocator.can_grow(seq, num_tokens):
            victims = [s for s in self.running if id(s) not in scheduled and s is not seq]
            if not victims and self.running == [seq]:
                # Alone and still out of pages: the cache can never hold this sequence any longer.
                self.running.remove(seq)
                self.allocator.release(seq)
                seq.status, seq.finish_reason = Status.FINISHED, "length"
                self.truncated.append(seq)
                return False
            victim = victims[-1] if victims else seq
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.num_preemptions += 1
        seq.num_preemptions += 1
        seq.drafts = []  # it verifies none until it decodes again (a recomputed sequence resumes as a prefill)
        if self.preemption_mode == "swap":
            seq.swapped = self._swap_out(seq.block_table)
            seq.swapped_pages = len(seq.block_table)
            self.allocator.release(seq)
            seq.status = Status.SWAPPED
            _insert(self.swapped, seq)
        else:
            self.allocator.release(seq)
            seq.num_computed = 0
            seq.status = Status.WAITING
            _insert(self.waiting, seq)


def _insert(queue: list[Sequence], seq: Sequence) -> None:
    bisect.insort(queue, seq, key=lambda s: s.arrival)
