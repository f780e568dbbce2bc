"""CUDA graphs of the decode step, for backends whose ``BackendSpec.capabilities`` contain ``cuda_graphs``.

One graph per batch bucket (1, 2, 4, 8, then multiples of 16 up to ``max_batch``) is captured over static input
buffers; a decode step of ``n`` sequences copies its inputs into the smallest bucket ``>= n`` and replays it.
Padding rows have ``seq_len`` 0 (``mla_decode`` returns zeros for them), slot -1 (``write_kv_cache`` skips them)
and token 0; their logits are dropped. The captured forward dispatches experts in ``low_latency`` mode (fixed
capacity, no host synchronisation) and computes the logits of every row, so sampling stays outside the graph.

Capture needs every op on the decode path to be free of host synchronisation on the chosen backend; if capture
fails (for example an op falls back to the reference), the graphs are dropped with a warning and decode runs
eagerly.
"""

from __future__ import annotations

import warnings

import torch

from .deepseek_v3 import DeepseekV3
from .forward_batch import ForwardBatch

CAPABILITY = "cuda_graphs"


def buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, 16, 32, 48, ... up to ``max_batch`` (which is always one)."""
    out = [b for b in (1, 2, 4, 8) if b < max_batch]
    out += list(range(16, max_batch, 16))
    return sorted({*out, max_batch})


class DecodeGraphs:
    """Captured decode steps of ``model`` over ``kv_caches`` for batches up to ``max_batch`` sequences of up to
    ``max_blocks`` pages each."""

    def __init__(self, model: DeepseekV3, kv_caches: list[torch.Tensor], *, max_batch: int, max_blocks: int):
        self.model, self.kv_caches = model, kv_caches
        self.sizes = buckets(max_batch)
        dev = kv_caches[0].device
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=dev)
        self.block_table = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def _forward(self, b: int) -> torch.Tensor:
        batch = ForwardBatch(
            positions=self.positions[:b],
            slot_mapping=self.slot_mapping[:b],
            num_decode=b,
            block_table=self.block_table[:b],
            seq_lens=self.seq_lens[:b],
            moe_mode="low_latency",
        )
        return self.model.compute_logits(self.model.forward(self.input_ids[:b], batch, self.kv_caches))

    def capture(self) -> bool:
        """Captures every bucket, largest first (they share one memory pool). Returns False, with a warning and
        no graphs kept, if any capture fails."""
        pool = None
        try:
            for b in reversed(self.sizes):
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm-up: lazy initialisation and autotuning happen outside the graph
                        self._forward(b)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[b] = self._forward(b)
                pool = graph.pool()
                self.graphs[b] = graph
            torch.cuda.synchronize()
        except Exception as e:  # capture errors come from any op or from torch itself
            self.graphs.clear()
            self.logits.clear()
            warnings.warn(f"CUDA graph capture of the decode step failed, decoding eagerly: {e}", stacklevel=2)
            return False
        return True

    def fits(self, n: int) -> bool:
        return bool(self.graphs) and 0 < n <= self.sizes[-1]

    def run(
        self,
        *,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Replays the smallest bucket that holds ``n = len(input_ids)`` rows; returns their logits ``[n, V]``."""
        n = input_ids.shape[0]
        b = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:b].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:b].zero_()
        self.slot_mapping[:n].copy_(slot_mapping)
        self.slot_mapping[n:b].fill_(-1)
        self.seq_lens[:n].copy_(seq_lens)
        self.seq_lens[n:b].zero_()
        self.block_table[:b].zero_()
        self.block_table[:n, : block_table.shape[1]].copy_(block_table)
        self.graphs[b].replay()
        return self.logits[b][:n]
