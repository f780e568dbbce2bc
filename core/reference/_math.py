"""Shared fp32 building blocks of the reference implementations."""

from __future__ import annotations

import torch

from ..dispatch import batch_invariant_enabled


def matmul_nt(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``a [M, K] @ w [N, K].T`` in fp32.

    In batch-invariant mode each row is its own product, so a row's result cannot depend on how many rows the
    library blocks together.
    """
    a, w = a.float(), w.float()
    if batch_invariant_enabled() and a.shape[0] > 1:
        out = torch.empty(a.shape[0], w.shape[0], dtype=torch.float32, device=a.device)
        for i in range(a.shape[0]):
            out[i] = w @ a[i]
        return out
    return a @ w.T
