"""Speculative decoding with the checkpoint's multi-token-prediction (MTP) layer.

Each step a decoding sequence verifies ``n`` draft tokens: the target model runs its last token and the drafts as
``n + 1`` decode rows (positions ``p .. p + n``, each attending to the cache up to itself, as a plain decode row
does), and samples a token ``y_i`` from every row exactly as it samples without speculation (the same seed per
generated position, ``sampling_params.step_seed``). Draft ``d_{i+1}`` is accepted while it equals ``y_i``; the
sequence then takes ``y_0 .. y_a``, where ``a`` drafts were accepted: ``y_a`` is the correction (or, when every
draft was accepted, the bonus) token.

Drafts are the MTP layer's greedy tokens, so the draft distribution ``q`` is a point mass: the standard rejection
rule accepts ``d`` with probability ``min(1, p(d) / q(d)) = p(d)`` and on rejection samples the residual
``max(0, p - q)`` normalised, which is ``p`` without ``d``. Comparing ``d`` with a sample ``y ~ p`` realises exactly
that rule (``P(y = d) = p(d)``; given ``y != d``, ``y`` follows the residual) with the draw the sequence makes
without speculation. So every token is the one the sequence takes without speculation: greedy and seeded sampling
alike, with or without speculation, of this request or of its neighbours. With batch-invariant ops
(``DEEPINFER_BATCH_INVARIANT=1``) that holds bitwise, since a decode row's logits do not depend on its batch; in
the default mode the logits' rounding depends on the rows a step runs, as it does between any two schedules.

Drafting. The MTP layer runs over every row of every forward pass (prefill chunks, decode and verification rows)
on the main model's final hidden states and the token after each row (the row's sampled token where it samples),
writing its own cache layer; on a sampling row it also drafts the token after that sampled token. So after a step a
sequence holds its first draft and the MTP state that produced it; the next step chains the MTP layer from there
for drafts ``2 .. k`` (the layer's output state and the previous draft in, one decode row per sequence) before the
target verifies them. Chained rows write provisional MTP cache entries past the sequence's end; the verification
step's MTP pass rewrites them, in row order, before any later row reads them. A prefix-cache hit reuses the MTP
layer's entries of the cached pages too; the entry at a page's last position was made with the token that followed it
in the request that computed it, which can change how often drafts are accepted, never a token.

Ahead of the host (``launch_ahead``; otherwise each speculative step waits for the one before). With asynchronous
scheduling (``engine.py``) a step is then launched before the host reads the one in flight, so the host does not
know how many drafts that step accepts, only how many it verifies. Everything that
depends on it is computed on the device: per sequence the accepted count (``accepted_from``), then the next step's
input token (the correction or bonus token), first draft and MTP state (taken from the accepted row), its positions,
cache slots and sequence lengths (the host's, moved on by the count: ``forward_batch.shift_decode_rows``, inside
the decode graphs ``moved_decode_rows``) and its sampling seeds (``sampling_params.step_seeds``); the chained
drafts stay on the device as the verification rows' input ids. The scheduler gives each such sequence pages for
every draft in flight being accepted (``Sequence.drafts_in_flight``), and a sequence that could end by length in
the step in flight waits for it. The host learns what was accepted one step later, when it reads the step's
tokens.

Confidence scheduling (``confidence_threshold``): a sequence verifies its drafts up to the first one the MTP layer
gives a probability below the threshold, at most ``num_speculative_tokens``; 0 (the default) is fixed-``k``
speculation. ``disable_by_batch_size`` turns drafting off in steps that decode that many sequences or more, and, as
vLLM's option of that name does, turns speculation off for the whole life of a request first scheduled in a step of
that many sequences: a decode step of only such requests skips the MTP layer, so a batch that large runs at plain
decoding's cost (their MTP cache entries past the prompt are not kept, which is why they never draft later; a
prompt's are, since a later request may reuse its pages from the prefix cache). Neither changes a token, only how
many a step verifies. Drafts past ``max_tokens`` or the context are never verified. A
request with a structured-output constraint masks each verification row with what its grammar allows after the
drafts before it (the matcher rolls the drafts back), so a draft the grammar refuses is never accepted. Both read
the drafts on the host (their probabilities, their tokens), so their steps are not launched ahead.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

import deepinfer
from deepinfer.validation import Check

from .forward_batch import ForwardBatch, shift_decode_rows
from .greedy import greedy_tokens
from .sequence import PENDING

METHODS = ("mtp", "deepseek_mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates. method: ``mtp`` (``deepseek_mtp`` is the same); num_speculative_tokens: drafts per
    step at most (``k``; one MTP layer is chained for ``k > 1``); confidence_threshold in ``[0, 1)``: verify drafts
    only while the MTP layer's probability of each is at least this (0: always ``k``); disable_by_batch_size: no
    drafts in a step that decodes at least this many sequences, and none ever for a request first scheduled in a
    step of that many (None: never), where verifying more rows costs more than the accepted drafts save;
    launch_ahead: launch each step before the host has read what the one before accepted (asynchronous scheduling
    of speculative steps, module docstring). Off by default: its bookkeeping on the device costs host time, and
    where a step's device time is short (the embedded model: a third of a millisecond) it costs more than the
    overlap hides (``benchmarks/NOTES.md``)."""

    method: str = "mtp"
    num_speculative_tokens: int = 1
    confidence_threshold: float = 0.0
    disable_by_batch_size: int | None = None
    launch_ahead: bool = False

    @classmethod
    def from_value(cls, value: Any) -> SpeculativeConfig | None:
        """A config from a ``SpeculativeConfig``, a dict of its fields (vLLM's ``speculative_config``) or None;
        ``InputError`` naming the field otherwise."""
        if value is None or isinstance(value, SpeculativeConfig):
            cfg = value
        elif isinstance(value, dict):
            fields = [f.name for f in dataclasses.fields(cls)]
            unknown = sorted(set(value) - set(fields))
            if unknown:
                raise Check("speculative_config").fail("speculative_config", f"keys among {fields}", str(unknown))
            cfg = cls(**value)
        else:
            raise Check("LLM").fail("speculative_config", "a dict, a SpeculativeConfig or None", repr(value))
        if cfg is not None:
            cfg.check()
        return cfg

    def check(self) -> None:
        c = Check("speculative_config")
        c.choice("method", self.method, METHODS)
        c.positive_int("num_speculative_tokens", self.num_speculative_tokens)
        t = self.confidence_threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0 <= t < 1 and math.isfinite(t)):
            raise c.fail("confidence_threshold", "a number in [0, 1)", repr(t))
        if self.disable_by_batch_size is not None:
            c.positive_int("disable_by_batch_size", self.disable_by_batch_size)
        if not isinstance(self.launch_ahead, bool):
            raise c.fail("launch_ahead", "a bool", repr(self.launch_ahead))


def accepted_counts(tokens: torch.Tensor, next_inputs: torch.Tensor, first_rows: torch.Tensor) -> torch.Tensor:
    """How many leading drafts the target's tokens confirm, per sequence, on the device. Per sampler row ``r`` of a
    step (``[S]`` each): ``tokens[r]``, the token the target sampled there; ``next_inputs[r]``, the draft the next
    row verifies (the input id of the sequence's next row) or -1 after its last; ``first_rows[r]``, its sequence's
    first row. A draft is accepted while every earlier one was and it equals the token sampled at the row before
    it. Returns ``[S]`` int64: each row's sequence's count. The rule's plain statement; the engine computes it by
    ``accepted_from``, which the tests hold to it."""
    n = tokens.shape[0]
    within = torch.arange(n, device=tokens.device) - first_rows
    breaks = torch.where(tokens == next_inputs, n, within)  # the last row always breaks: -1 is no token
    counts = torch.full((n,), n, dtype=torch.int64, device=tokens.device)
    counts.scatter_reduce_(0, first_rows, breaks, "amin")
    return counts.index_select(0, first_rows)


def acceptance_rows(first: list[int], follow: list[int]) -> list[list[int]]:
    """The host half of ``accepted_from``: per sampler row ``r`` of a step, from its sequence's first row
    ``first[r]`` and the row whose input id is the draft it verifies (``follow[r]``, -1 after its sequence's last),
    five rows of ints: ``first``, the row to read the draft from (0 where none), the row's offset in its sequence,
    the break value where the draft matches (the row count ``S``: no break; the offset where there is no draft) and
    ``S`` (the counts' initial value)."""
    n = len(first)
    within = [r - f for r, f in enumerate(first)]
    return [
        first,
        [max(f, 0) for f in follow],
        within,
        [n if f >= 0 else w for f, w in zip(follow, within)],
        [n] * n,
    ]


def accepted_from(tokens: torch.Tensor, inputs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``accepted_counts`` with its index arithmetic done on the host (``acceptance_rows``, ``[5, S]`` int64 on the
    device, consumed: its last row becomes the counts): the drafts are ``inputs[rows[1]]``; a row breaks the run of
    accepted drafts at its offset unless its draft equals its token. Five device operations. Returns ``[S]`` int64."""
    first, src, within, hit, counts = rows.unbind(0)
    breaks = torch.where(tokens == inputs.index_select(0, src), hit, within)
    counts.scatter_reduce_(0, first, breaks, "amin")
    return counts.index_select(0, first)


def confident_drafts(probs: list[float], threshold: float) -> int:
    """How many leading drafts to verify: those before the first whose probability is below ``threshold``."""
    n = 0
    while n < len(probs) and probs[n] >= threshold:
        n += 1
    return n


@dataclass
class SpeculativeStats:
    """Counts over an engine's life. drafted: draft tokens verified; accepted: of those, accepted; verifications:
    sequence-steps that verified at least one draft. ``mean_accepted_length``: tokens a verification yields on
    average, the bonus or correction token included (``1 + accepted / verifications``)."""

    drafted: int = 0
    accepted: int = 0
    verifications: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1 + self.accepted / self.verifications if self.verifications else 0.0

    def since(self, earlier: SpeculativeStats) -> SpeculativeStats:
        """The counts added after ``earlier`` (a copy of these counts, taken before)."""
        return SpeculativeStats(
            self.drafted - earlier.drafted, self.accepted - earlier.accepted, self.verifications - earlier.verifications
        )

    def as_dict(self) -> dict[str, float]:
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "verifications": self.verifications,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
        }


class MTPDrafter:
    """Runs the MTP layer ``mtp`` over its own cache layers (``kv_cache``, and ``index_cache`` for sparse attention:
    ``[blocks, block_size, width]`` on the engine's pages) for an engine with ``config``.

    ``run`` is the pass over a forward's rows; ``propose`` chains further drafts before a step and sets each
    sequence's ``drafts``. A sequence's first draft and the MTP state behind it (``Sequence.next_draft``,
    ``Sequence.draft_state``) come from the step that sampled its last token."""

    def __init__(
        self,
        mtp,
        kv_cache,
        index_cache,
        allocator,
        config: SpeculativeConfig,
        max_model_len: int,
        host_positions: bool = False,
    ):
        self.mtp, self.caches = mtp, (kv_cache, index_cache)
        self.allocator, self.config, self.max_model_len = allocator, config, max_model_len
        self.host_positions = host_positions  # the model finds a sequence's caches from its length on the host

    def run(self, hidden, next_ids, batch, sample_rows):
        """The MTP pass over every row of a forward (``hidden [T, H]``: the main model's final states; ``next_ids
        [T]``: the token after each row) -> for the rows ``sample_rows``: the MTP states ``[S, H]``, their draft
        tokens ``[S]`` int64 and the drafts' probabilities (``draft``), on the device."""
        state = self.mtp.forward(hidden, next_ids, batch, *self.caches)
        state = state.index_select(0, sample_rows)
        return (state, *self.draft(state))

    def draft(self, state):
        """The MTP layer's greedy drafts ``[N]`` from its states ``[N, H]``, and their probabilities ``[N]`` fp32
        where confidence scheduling reads them (None without a threshold: two launches a draft saved)."""
        logits = self.mtp.compute_logits(state)
        tokens = greedy_tokens(logits)
        if not self.config.confidence_threshold:
            return tokens, None
        return tokens, torch.softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]

    def limit(self, seq) -> int:
        """Drafts ``seq`` may verify this step: ``num_speculative_tokens``, fewer where the scheduler gave it less
        room (``Sequence.max_drafts``) or ``max_tokens`` or the context would end the sequence first, counting the
        drafts of the step in flight as accepted (``Sequence.drafts_in_flight``)."""
        ahead = seq.drafts_in_flight
        room = min(seq.params.max_tokens - seq.num_generated, self.max_model_len - seq.num_tokens) - ahead - 1
        return max(0, min(self.config.num_speculative_tokens, seq.max_drafts, room))

    def admit(self, seqs: list) -> None:
        """Decides, for each of ``seqs`` (the sequences of one step) scheduled for the first time, whether it
        speculates: not where the step holds at least ``disable_by_batch_size`` sequences."""
        cap = self.config.disable_by_batch_size
        for seq in seqs:
            if seq.speculates is None:
                seq.speculates = cap is None or len(seqs) < cap

    @staticmethod
    def any_speculates(seqs: list) -> bool:
        """Whether any of ``seqs`` speculates (a decode step of only ``seqs`` runs the MTP pass then only)."""
        return any(seq.speculates is not False for seq in seqs)

    def reads_drafts(self, seqs: list) -> bool:
        """Whether ``propose`` reads the drafts back to the host (a synchronisation): for confidence scheduling,
        which needs their probabilities; for structured output, whose grammars see the tokens; and for a model
        that finds a sequence's caches from its length on the host (DeepSeek-V4), which must know what the step
        before accepted. Sequences that do not speculate (``admit``) count for nothing."""
        seqs = [s for s in seqs if s.speculates is not False]
        threshold = self.config.confidence_threshold
        return bool(seqs) and (self.host_positions or threshold > 0 or any(s.matcher is not None for s in seqs))

    def waits(self, seqs: list) -> bool:
        """Whether the engine waits for each step before launching the next: where any of ``seqs`` speculates,
        unless ``launch_ahead``, and always where ``reads_drafts``."""
        return self.any_speculates(seqs) and (not self.config.launch_ahead or self.reads_drafts(seqs))

    def propose(self, seqs: list, tensor, graphs=None, flying=None) -> list[tuple[list[int], torch.Tensor]]:
        """Sets ``seq.drafts`` for each decoding sequence of ``seqs``: its first draft, chained on by the MTP layer
        (one decode row per sequence and draft, at positions ``num_computed .. num_computed + n - 2``), cut by
        ``limit``, ``disable_by_batch_size`` and the confidence threshold. ``tensor(values, dtype)`` makes a device
        tensor; ``graphs``: the engine's ``DecodeGraphs``, whose MTP graphs run the chain steps they fit;
        ``flying``: the ``model_runner.InFlight`` of the sequences whose first draft the step still running makes
        (their positions shift by the drafts it accepts, known on the device only).

        Drafts stay on the device unless ``reads_drafts``: ``seq.drafts`` then holds ``PENDING`` for each one the
        host does not know, and the chained ones are returned, per chain step, as ``(indices into seqs, tokens)``
        (step ``j`` makes each listed sequence's draft ``j + 1``). Otherwise they are read back once (a host
        synchronisation) and nothing is returned."""
        threshold, cap = self.config.confidence_threshold, self.config.disable_by_batch_size
        read = self.reads_drafts(seqs)
        flies = flying.index if flying is not None else {}
        if read and flies:  # the engine waits for the step before a step whose drafts are read
            raise RuntimeError("drafts read on the host for a step launched ahead of the one before")
        limits = []
        for seq in seqs:
            seq.drafts = []
            has = seq.speculates is not False and (id(seq) in flies or seq.next_draft is not None)
            ok = has and (cap is None or len(seqs) < cap) and (not threshold or seq.next_draft[1] >= threshold)
            limits.append(self.limit(seq) if ok else 0)
        first = [PENDING if id(s) in flies else s.next_draft[0] if n else None for s, n in zip(seqs, limits)]
        rows = [i for i, n in enumerate(limits) if n > 1]
        chained = []  # per chain step: (rows, draft tokens, draft probabilities), on the device
        if rows:
            state, ids, shift = self._chain_inputs([seqs[i] for i in rows], tensor, flying)
        m = 1  # drafts each row in `rows` has
        while rows:
            meta = decode_metadata([(seqs[i], seqs[i].num_computed - 1 + m) for i in rows], self.allocator)
            if graphs is not None and graphs.replays_mtp(len(rows)):
                state, tokens, probs = graphs.run_mtp(state, ids, meta, shift)
                # the graph's outputs, overwritten by later replays (the probabilities are read only with `read`)
                tokens, probs = tokens.clone(), probs.clone() if probs is not None and read else None
            else:
                fb = decode_batch(meta, tensor)
                fb.rows = [(seqs[i], p, 1) for i, p in zip(rows, meta["positions"])]
                if shift is not None:
                    shift_decode_rows(fb, shift, self.allocator.block_size, self.allocator.seq_pages)
                with deepinfer.value_checks(False):
                    state = self.mtp.forward(state, ids, fb, *self.caches)
                    tokens, probs = self.draft(state)
            chained.append((rows, tokens, probs))
            m += 1
            keep = [j for j, i in enumerate(rows) if limits[i] > m]
            if not keep:  # the chain ends: nothing to carry to a next step
                break
            if len(keep) == len(rows):  # (a graph's states: its next replay copies them in before it overwrites them)
                ids = tokens
                continue
            index = tensor(keep, torch.int64)
            rows, state, ids = [rows[j] for j in keep], state[index], tokens[index]
            shift = shift[index] if shift is not None else None
        if not read:
            for seq, n, d in zip(seqs, limits, first):
                seq.drafts = [d] + [PENDING] * (n - 1) if n else []
            return [(rows, tokens) for rows, tokens, _ in chained]
        drafts = [[s.next_draft] if n else [] for s, n in zip(seqs, limits)]
        for step_rows, tokens, probs in chained:
            probs = [None] * len(step_rows) if probs is None else probs.tolist()
            for i, t, p in zip(step_rows, tokens.tolist(), probs):
                drafts[i].append((t, p))
        for seq, n, d in zip(seqs, limits, drafts):
            if threshold:
                n = min(n, confident_drafts([p for _, p in d], threshold))
            seq.drafts = [t for t, _ in d[:n]]
        return []

    def _chain_inputs(self, seqs: list, tensor, flying) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The MTP states ``[N, H]`` and first drafts ``[N]`` the chain starts from, and the position shift ``[N]``
        of each row (None when no sequence in flight moves on): from the host where known, else from the step in
        flight."""
        flies = flying.index if flying is not None else {}
        host = [j for j, s in enumerate(seqs) if id(s) not in flies]
        if not flies.keys() & {id(s) for s in seqs}:
            state = torch.stack([s.draft_state for s in seqs])
            return state, tensor([s.next_draft[0] for s in seqs], torch.int64), None
        fly = [j for j, s in enumerate(seqs) if id(s) in flies]
        which, into = tensor([[flying.key(flies[id(seqs[j])]) for j in fly], fly], torch.int64)
        state_f, ids_f, shift_f = flying.draft_states(which), flying.draft_tokens(which), flying.shifts(which)
        if not host:  # every row in flight, in order
            return state_f, ids_f, shift_f
        state = state_f.new_empty(len(seqs), state_f.shape[1])
        ids = ids_f.new_empty(len(seqs))
        state.index_copy_(0, into, state_f)
        ids.index_copy_(0, into, ids_f)
        shift = None
        if shift_f is not None:
            shift = torch.zeros(len(seqs), dtype=shift_f.dtype, device=shift_f.device).index_copy_(0, into, shift_f)
        at = tensor(host, torch.int64)
        state.index_copy_(0, at, torch.stack([seqs[j].draft_state for j in host]))
        ids.index_copy_(0, at, tensor([seqs[j].next_draft[0] for j in host], torch.int64))
        return state, ids, shift


def decode_metadata(rows: list, allocator) -> dict[str, list]:
    """The host metadata of decode rows ``(seq, position)``, each attending to its sequence's cache up to and
    including ``position``: ``positions``, ``slot_mapping``, ``block_tables`` and ``seq_lens``, as
    ``DecodeGraphs.run`` takes them."""
    return dict(
        positions=[p for _, p in rows],
        slot_mapping=[allocator.slot(s, p) for s, p in rows],
        block_tables=[s.block_table for s, _ in rows],
        seq_lens=[p + 1 for _, p in rows],
    )


def decode_batch(meta: dict[str, list], tensor) -> ForwardBatch:
    """The eager ``ForwardBatch`` of ``decode_metadata``'s rows."""
    width = max(len(t) for t in meta["block_tables"])
    return ForwardBatch(
        positions=tensor(meta["positions"], torch.int32),
        slot_mapping=tensor(meta["slot_mapping"], torch.int64),
        num_decode=len(meta["positions"]),
        block_table=tensor([t + [0] * (width - len(t)) for t in meta["block_tables"]], torch.int32),
        seq_lens=tensor(meta["seq_lens"], torch.int32),
    )
