"""``greedy_tokens``: the first index of each row's largest logit, reduced in pieces so a long row spreads over the
device. Used after an eager forward and inside the captured decode graphs."""

from __future__ import annotations

import torch


def greedy_tokens(logits: torch.Tensor, pieces: int = 64) -> torch.Tensor:
    """The first index of each row's largest value in ``logits [B, V]``. Each row is reduced in ``pieces`` parts
    first, then across them: a single long row (a vocabulary of 129k) reduced at once runs on one multiprocessor."""
    rows, vocab = logits.shape
    width = -(-vocab // pieces)
    padded = torch.nn.functional.pad(logits, (0, width * pieces - vocab), value=float("-inf"))
    best, index = padded.view(rows, pieces, width).max(dim=-1)  # first index of the max within each piece
    piece = best.argmax(dim=-1, keepdim=True)  # the first piece holding the row's max
    return (piece * width + index.gather(1, piece))[:, 0]
