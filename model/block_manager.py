"""``BlockAllocator``: the pages of the paged latent cache.

The cache is ``num_blocks`` pages of ``block_size`` token slots; a sequence owns the pages in its block table, and
token ``i`` of the sequence lives in slot ``block_table[i // block_size] * block_size + i % block_size``.
"""

from __future__ import annotations

import math
from collections import deque

from .sequence import Sequence


class BlockAllocator:
    """Hands out and takes back cache pages; pages are reused lowest-freed-first (FIFO)."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Pages that ``num_tokens`` slots need."""
        return math.ceil(num_tokens / self.block_size)

    def missing(self, seq: Sequence, num_tokens: int) -> int:
        """Pages ``seq`` still needs to hold ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.missing(seq, num_tokens) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extends ``seq.block_table`` to hold ``num_tokens`` tokens; raises if there are not enough free pages."""
        need = self.missing(seq, num_tokens)
        if need > self.num_free:
            raise RuntimeError(f"{need} cache pages needed, {self.num_free} free")
        seq.block_table.extend(self.allocate(need))

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"{n} cache pages needed, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if b not in self._used:
                raise RuntimeError(f"page {b} freed twice or never allocated")
            self._used.remove(b)
            self._free.append(b)

    def reset(self) -> None:
        """Takes back every page, in the order of a new allocator (for when no sequence holds any)."""
        self._free = deque(range(self.num_blocks))
        self._used = set()

    def release(self, seq: Sequence) -> None:
        """Takes back every page of ``seq``."""
        self.free(seq.block_table)
        seq.block_table = []

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
