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

DeepSeek-V4's MTP layer ``k`` (``V4MTPLayer``, weights under ``mtp.{k}.``: ``config_v4.mtp_layout``) works on the
``hc_mult`` residual streams the main model ends with (``DeepseekV4.forward``'s output, before ``hc_head``), with
separate projections of the two inputs, the second added to every stream::

    s  = h_proj(hnorm(S[i])) + e_proj(enorm(embed(t[i + 1])))      per stream; S[i]: the model's streams
    s' = one V4 decoder block on s at position i                    (layer num_hidden_layers + k: its attention
                                                                     type, its caches in the sequence's pages)
    logits(t[i + 2]) = head(norm(hc_head(s')))                      the layer's own norm and hc_head; the model's head

``forward`` returns ``s'`` flattened, the state a further draft step chains on. The layer's caches live in the
sequence's pages as a layer of the model's (``V4CacheLayout``, ``mtp_layers``).
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


class V4MTPLayer:
    """DeepSeek-V4's multi-token-prediction layer (module docstring) under ``prefix`` of ``weights``, decoder block
    ``layer`` of ``model`` (a ``DeepseekV4``, whose embedding, head and block code it shares)."""

    def __init__(self, weights: dict, prefix: str, model, layer: int):
        w = {k.removeprefix(prefix): v for k, v in weights.items() if k.startswith(prefix)}
        self.model, self.layer, self.eps = model, layer, model.cfg.rms_norm_eps
        self.enorm, self.hnorm, self.head_norm = w["enorm.weight"], w["hnorm.weight"], w["norm.weight"]
        self.e_proj, self.h_proj = w["e_proj.weight"], w["h_proj.weight"]
        self.hc_head = (w["hc_head_fn"], w["hc_head_base"], w["hc_head_scale"])
        self.block = model.build_block(layer, weights, prefix)

    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, batch, kv_cache: torch.Tensor, index_cache=None):
        """``hidden [T, hc_mult * H]`` (the model's final streams, or this layer's output to chain a further draft)
        and ``next_ids [T]`` (the token after each position) -> the layer's streams ``[T, hc_mult * H]`` at the
        batch's positions; writes the block's caches into the engine's pages ``kv_cache`` (``batch``: the engine's
        ``ForwardBatch``, or a ``V4Batch``, whose states it does not advance)."""
        model = self.model
        if isinstance(batch, ForwardBatch):
            batch = model.engine_batch(next_ids, batch, kv_cache)
        t, n, h = hidden.shape[0], model.cfg.hc_mult, model.cfg.hidden_size
        streams = ops.rms_norm(hidden.reshape(t * n, h), self.hnorm, self.eps)[0]
        e = linear(ops.rms_norm(model.embed[next_ids], self.enorm, self.eps)[0], self.e_proj)
        x = (linear(streams, self.h_proj).view(t, n, -1) + e[:, None]).contiguous()
        return model.block_forward(x, self.block, batch, next_ids).flatten(1)

    def compute_logits(self, state: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]`` of the token after next, from ``forward``'s states."""
        return self.model.head_logits(state, self.hc_head, self.head_norm)
