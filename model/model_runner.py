"""``ModelRunner``: turns a scheduled batch into tensors, runs the model, samples, computes log-probabilities.

The paged cache of all layers is one tensor ``[layers, num_blocks, block_size, width]`` (``kv_caches[l]`` is layer
``l``'s cache as the ops take it). Decode rows come first in the packed batch, then the prefill chunks. A
decode-only step replays a captured CUDA graph when the backend supports them (``cuda_graphs.py``).

The forward runs without the ops' value checks (``deepinfer.value_checks(False)``): the page tables, slots,
positions and sequence lengths come from the allocator and the scheduler, and the expert ids and offsets from the
backend's own ops. Each check would wait for the device, several times per layer in an eager step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import deepinfer
from deepinfer import ops

from .block_manager import BlockAllocator
from .cuda_graphs import DecodeGraphs
from .deepseek_v3 import DeepseekV3
from .forward_batch import ForwardBatch
from .greedy import greedy_tokens
from .sampling_params import step_seed
from .scheduler import ScheduledBatch
from .sequence import Sequence


@dataclass
class SampledToken:
    token: int
    logprob: float | None = None
    top: dict[int, float] | None = None


@dataclass
class StepResult:
    """sampled: the new token of every sequence that produced one; prompt: per sequence, ``(position, logprob,
    top)`` of prompt tokens whose log-probability this step computed."""

    sampled: dict[int, SampledToken] = field(default_factory=dict)
    prompt: dict[int, list[tuple[int, float, dict[int, float] | None]]] = field(default_factory=dict)


class ModelRunner:
    """Runs one scheduled batch at a time on ``model`` over ``kv_cache [layers, blocks, block_size, width]``."""

    def __init__(
        self,
        model: DeepseekV3,
        kv_cache: torch.Tensor,
        allocator: BlockAllocator,
        *,
        graphs: DecodeGraphs | None = None,
    ):
        self.model, self.kv_cache, self.allocator = model, kv_cache, allocator
        self.kv_caches = list(kv_cache.unbind(0))
        self.device = kv_cache.device
        self.graphs = graphs

    # Cache pages to host memory and back (swap preemption).
    def swap_out(self, blocks: list[int]) -> torch.Tensor:
        return self.kv_cache[:, torch.tensor(blocks, device=self.device)].to("cpu")

    def swap_in(self, host: torch.Tensor, blocks: list[int]) -> None:
        self.kv_cache[:, torch.tensor(blocks, device=self.device)] = host.to(self.device)

    def _tensor(self, values, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, ForwardBatch]:
        """Packed input ids and the forward metadata of ``batch``."""
        bs, alloc = self.allocator.block_size, self.allocator
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for seq in batch.decodes:
            p = seq.num_computed
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(alloc.slot(seq, p))
        fb = ForwardBatch(positions=None, slot_mapping=None, num_decode=len(batch.decodes))
        if batch.decodes:
            width = max(len(s.block_table) for s in batch.decodes)
            table = [s.block_table + [0] * (width - len(s.block_table)) for s in batch.decodes]
            fb.block_table = self._tensor(table, torch.int32)
            fb.seq_lens = self._tensor([s.num_computed + 1 for s in batch.decodes], torch.int32)
        if batch.prefills:
            cu_q, cu_k, ctx = [0], [0], []
            for ch in batch.prefills:
                seq = ch.seq
                ids.extend(seq.token_ids[ch.start : ch.end])
                pos.extend(range(ch.start, ch.end))
                table = torch.tensor(seq.block_table, dtype=torch.int64)
                p = torch.arange(ch.end)
                seq_slots = table[p // bs] * bs + p % bs
                slots.extend(seq_slots[ch.start :].tolist())
                ctx.append(seq_slots)
                cu_q.append(cu_q[-1] + ch.end - ch.start)
                cu_k.append(cu_k[-1] + ch.end)
            fb.cu_seqlens_q = self._tensor(cu_q, torch.int32)
            fb.cu_seqlens_k = self._tensor(cu_k, torch.int32)
            fb.context_slots = torch.cat(ctx).to(self.device, non_blocking=True)
        fb.positions = self._tensor(pos, torch.int32)
        fb.slot_mapping = self._tensor(slots, torch.int64)
        return self._tensor(ids, torch.int64), fb

    def _logit_rows(self, batch: ScheduledBatch) -> tuple[list[int], list[Sequence], list[tuple[Sequence, int, int]]]:
        """Rows whose logits are needed: ``sample_rows`` (one per sequence that samples, with ``samplers``) and
        ``prompt_rows`` ``(seq, row, position)`` predicting prompt token ``position + 1``."""
        sample_rows, samplers, prompt_rows = [], [], []
        for i, seq in enumerate(batch.decodes):
            sample_rows.append(i)
            samplers.append(seq)
        row = len(batch.decodes)
        for ch in batch.prefills:
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
        """Runs the model on ``batch``; returns the sampled tokens and the log-probabilities asked for."""
        sample_rows, samplers, prompt_rows = self._logit_rows(batch)
        rows = sample_rows + [r for _, r, _ in prompt_rows]
        use_graph = (
            self.graphs is not None
            and not batch.prefills
            and self.graphs.fits(len(batch.decodes))
            and self.graphs.invariant == deepinfer.batch_invariant_enabled()
        )
        greedy = None  # the graph's greedy tokens, taken inside it
        if use_graph:
            logits, greedy = self._graph_logits(batch)
        else:
            input_ids, fb = self.prepare(batch)
            with deepinfer.value_checks(False):
                hidden = self.model.forward(input_ids, fb, self.kv_caches)
            logits = self.model.compute_logits(hidden[self._tensor(rows, torch.int64)]) if rows else None
        result = StepResult()
        if not rows:
            return result
        sample_logits = logits[: len(sample_rows)]
        if samplers:
            tokens = self._sample(sample_logits, samplers, greedy).tolist()
            want = [i for i, s in enumerate(samplers) if s.params.logprobs is not None]
            lps = _logprobs(sample_logits[want], [tokens[i] for i in want], [samplers[i].params.logprobs for i in want])
            by_row = dict(zip(want, lps))
            for i, (seq, token) in enumerate(zip(samplers, tokens)):
                lp, top = by_row.get(i, (None, None))
                result.sampled[id(seq)] = SampledToken(token, lp, top)
        if prompt_rows:
            targets = [seq.token_ids[p + 1] for seq, _, p in prompt_rows]
            ks = [seq.params.prompt_logprobs for seq, _, _ in prompt_rows]
            lps = _logprobs(logits[len(sample_rows) :], targets, ks)
            for (seq, _, p), (lp, top) in zip(prompt_rows, lps):
                result.prompt.setdefault(id(seq), []).append((p + 1, lp, top))
        return result

    def _graph_logits(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor]:
        seqs = batch.decodes
        alloc = self.allocator
        return self.graphs.run(
            input_ids=[s.token_ids[s.num_computed] for s in seqs],
            positions=[s.num_computed for s in seqs],
            slot_mapping=[alloc.slot(s, s.num_computed) for s in seqs],
            block_tables=[s.block_table for s in seqs],
            seq_lens=[s.num_computed + 1 for s in seqs],
        )

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], greedy: torch.Tensor | None) -> torch.Tensor:
        """The next token of each of ``seqs`` (one row of ``logits`` each); ``greedy``: their greedy tokens, already
        taken (by a decode graph), or None."""
        params = [s.params for s in seqs]
        if all(p.temperature == 0 for p in params):  # greedy rows need no filtering, seeds or value checks
            return greedy if greedy is not None else greedy_tokens(logits)
        return ops.sample(
            logits,
            self._tensor([float(p.temperature) for p in params], torch.float32),
            self._tensor([float(p.top_p) for p in params], torch.float32),
            self._tensor([p.top_k for p in params], torch.int32),
            self._tensor([step_seed(s.seed, s.num_generated) for s in seqs], torch.int64),
        )


def _logprobs(logits: torch.Tensor, targets: list[int], ks: list[int]) -> list[tuple[float, dict[int, float] | None]]:
    """Per row: the log-probability of ``targets[i]`` under ``log_softmax(logits[i])`` and, for ``ks[i] > 0``, the
    ``ks[i]`` most likely tokens with theirs."""
    if not targets:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None])[:, 0].tolist()
    kmax = max(ks)
    tops: list[dict[int, float] | None] = [None] * len(targets)
    if kmax > 0:
        vals, idx = lp.topk(min(kmax, lp.shape[1]), dim=-1)
        vals, idx = vals.tolist(), idx.tolist()
        tops = [dict(zip(idx[i][:k], vals[i][:k])) if k > 0 else None for i, k in enumerate(ks)]
    return list(zip(chosen, tops))
