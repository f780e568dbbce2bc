"""``ForwardBatch``: what one forward pass needs to know about the packed tokens it runs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch


@dataclass
class ForwardBatch:
    """Metadata of one forward pass over ``T`` packed tokens: the ``num_decode`` decode rows first (one new token
    per sequence, absorbed MLA over the paged cache), then the prefill chunks (decompressed MLA).

    positions: ``[T]`` int32 position of each token; slot_mapping: ``[T]`` int64 cache slot each token's latent is
        written to (-1: not written, e.g. CUDA-graph padding).
    block_table: ``[num_decode, max_blocks]`` int32 pages of each decode sequence; seq_lens: ``[num_decode]`` int32
        tokens in the cache including the new one (0 for padding rows).
    cu_seqlens_q: ``[P+1]`` int32 offsets of the P prefill chunks within the prefill rows; cu_seqlens_k: ``[P+1]``
        int32 offsets of their keys (every cached position of the sequence up to the chunk's end);
        context_slots: ``[cu_seqlens_k[-1]]`` int64 cache slots of those keys, in order; prefill_block_table:
        ``[P, max_blocks]`` int32 pages of each chunk's sequence.
    moe_mode: ``ep_dispatch`` mode, ``normal`` or ``low_latency`` (no host synchronisation: CUDA graphs).
    rows: ``(sequence, first position, count)`` of each run of consecutive rows of one sequence, in packing order,
        for a model that keeps caches per sequence (DeepSeek-V4); None in CUDA-graph replays.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    num_decode: int = 0
    block_table: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    context_slots: torch.Tensor | None = None
    prefill_block_table: torch.Tensor | None = None
    moe_mode: str = "normal"
    rows: list | None = None
    _made: dict = field(default_factory=dict, repr=False)  # tensors derived once per forward, shared by the layers

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    def rows_per_head(self, heads: int, rows: int) -> torch.Tensor:
        """``[heads]`` int32, every entry ``rows``: the ``masked_m`` of the absorbed per-head GEMMs."""
        key = ("rows_per_head", heads, rows)
        if key not in self._made:
            self._made[key] = torch.full((heads,), rows, dtype=torch.int32, device=self.positions.device)
        return self._made[key]

    def decode_cu_seqlens(self) -> torch.Tensor:
        """``[num_decode + 1]`` int32 ``0, 1, ..., num_decode``: each decode row is a sequence of one query."""
        if "decode_cu" not in self._made:
            self._made["decode_cu"] = torch.arange(self.num_decode + 1, dtype=torch.int32, device=self.positions.device)
        return self._made["decode_cu"]


def shift_decode_rows(fb: ForwardBatch, shift: torch.Tensor, block_size: int, seq_pages: int = 0) -> None:
    """Moves the first ``len(shift)`` decode rows of ``fb`` on by ``shift [n]`` positions, in place, on the device:
    their positions, sequence lengths and cache slots (from the block table: page ``seq_pages + position //
    block_size``). Speculative decoding ahead of the host: a sequence stands as many positions further as the step
    still running accepts drafts."""
    n = shift.shape[0]
    positions = fb.positions[:n]
    positions += shift  # (in-place adds cast to the buffer's dtype in the same launch)
    fb.seq_lens[:n] += shift
    offset, pages = _slot_parts(fb.block_table[:n], positions, block_size, seq_pages)
    torch.add(offset, pages, alpha=block_size, out=fb.slot_mapping[:n])  # (in place: each op is a launch)


def moved_decode_rows(fb: ForwardBatch, shift: torch.Tensor, block_size: int) -> ForwardBatch:
    """``fb``, whose rows are all decode rows, with every row moved on by ``shift [num_decode]`` positions, out of
    place: ``shift_decode_rows``' arithmetic on new tensors, where a CUDA graph replays it over its static inputs
    (replayed again, it moves nothing twice). Rows that do not move (``shift`` 0, padding rows among them) keep
    their slots."""
    positions, seq_lens = fb.positions + shift, fb.seq_lens + shift
    offset, pages = _slot_parts(fb.block_table, positions, block_size, 0)
    slots = torch.where(shift != 0, torch.add(offset, pages, alpha=block_size), fb.slot_mapping)
    return dataclasses.replace(fb, positions=positions, seq_lens=seq_lens, slot_mapping=slots, _made={})


def _slot_parts(block_table: torch.Tensor, positions: torch.Tensor, block_size: int, seq_pages: int):
    """The cache slot of each row at ``positions``, ``offset + block_size * page``, as ``(offset, page)`` in int64:
    the page is entry ``seq_pages + position // block_size`` of the row's block table."""
    p = positions.long()
    page = p // block_size
    if seq_pages:
        page += seq_pages
    pages = block_table.gather(1, page[:, None])[:, 0]
    return p % block_size, pages
