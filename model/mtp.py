"""DeepSeek's multi-token-prediction (MTP) layer on deepinfer ops: from the main model's state at position ``i`` and
the token at ``i + 1``, the logits of the token at ``i + 2``.

MTP layer ``k`` has its weights under ``model.layers.{num_hidden_layers + k}.`` (``Checkpoint.mtp_layout``)::

    x  = eh_proj([enorm(embed(t[i + 1])); hnorm(h[i])])        the two halves concatenated in this order
    x' = one decoder block on x at position i                   (MLA with its own latent cache, then MLP or MoE)
    logits(t[i + 2]) = lm_head(shared_head.norm(x'))

``h[i]`` is the main model's final normed hidden state (what ``DeepseekV3.forward`` returns and ``lm_head`` reads);
``embed`` and ``lm_head`` are the main model's (copies a checkpoint keeps under the layer are not read). The block
is built like the main model's blocks (its MLP is MoE or dense by the same index rule) and reads and writes its own
cache layer at the main model's slots: position ``i`` of the MTP layer lives where position ``i`` of the sequence
does. ``forward`` returns ``x'`` before the head's norm, which is also the state a further draft step chains on.
"""

from __future__ import annotations

import torch

from deepinfer import ops

from .forward_batch import ForwardBatch
from .mla import linear


class MTPLayer:
    """One multi-token-prediction layer; ``block`` is the ``(in_norm, attention, post_norm, ffn)`` of a decoder
    layer, as ``DeepseekV3`` builds them."""

    def __init__(self, weights: dict, block: tuple, embed: torch.Tensor, lm_head, eps: float):
        self.enorm, self.hnorm = weights["enorm.weight"], weights["hnorm.weight"]
        self.eh_proj, self.head_norm = weights["eh_proj.weight"], weights["shared_head.norm.weight"]
        self.block, self.embed, self.lm_head, self.eps = block, embed, lm_head, eps

    def forward(
        self,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: torch.Tensor,
        index_cache: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``hidden [T, H]`` (the main model's final normed states, or this layer's output to chain a further draft)
        and ``next_ids [T]`` (the token after each position) -> the layer's state ``[T, H]`` at ``batch.positions``;
        writes the block's latents into ``kv_cache`` (and, for sparse attention, its indexer keys into
        ``index_cache``) at ``batch.slot_mapping``."""
        e = ops.rms_norm(self.embed[next_ids], self.enorm, self.eps)[0]
        h = ops.rms_norm(hidden, self.hnorm, self.eps)[0]
        x = linear(torch.cat([e, h], dim=-1), self.eh_proj)
        in_norm, attn, post_norm, ffn = self.block
        y, residual = ops.rms_norm(x, in_norm, self.eps)
        y, residual = ops.rms_norm(attn.forward(y, batch, kv_cache, index_cache), post_norm, self.eps, residual)
        return residual + ffn.forward(y, batch)

    def compute_logits(self, state: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]`` of the token after next, from ``forward``'s states ``[N, H]``."""
        normed = ops.rms_norm(state, self.head_norm, self.eps)[0]
        return ops.gemm(normed, self.lm_head, out_dtype=torch.float32)
