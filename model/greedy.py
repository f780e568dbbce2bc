"""``greedy_tokens``: the first index of each row's largest logit, a long row reduced in pieces so that it spreads
over the device. Used after an eager forward and inside the captured decode graphs."""

from __future__ import annotations

import torch

# Rows up to this many values take one argmax (one launch; the pieces take six, which pays only where one
# multiprocessor per row would be slow: DeepSeek-V3's 129k vocabulary, not the embedded model's 4k).
ONE_PASS_VOCAB = 16384


def greedy_tokens(logits: torch.Tensor, pieces: int = 64) -> torch.Tensor:
    """The first index of each row's largest value in ``logits [B, V]``. A row longer than ``ONE_PASS_VOCAB`` is
    reduced in ``pieces`` parts first, then across them."""
    rows, vocab = logits.shape
    if vocab <= ONE_PASS_VOCAB:
        return logits.argmax(dim=-1)  # the first maximal index, as documented
    width = -(-vocab // pieces)
    padded = torch.nn.functional.pad(logits, (0, width * pieces - vocab), value=float("-inf"))
    best, index = padded.view(rows, pieces, width).max(dim=-1)  # first index of the max within each piece
    piece = best.argmax(dim=-1, keepdim=True)  # the first piece holding the row's max
    return (piece * width + index.gather(1, piece))[:, 0]
