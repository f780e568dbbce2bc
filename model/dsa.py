"""DeepSeek Sparse Attention (DeepSeek-V3.2) on deepinfer ops: the lightning indexer and sparse absorbed MLA.

Each layer has its own indexer. Per token it projects

- queries ``q_I = rope(wq_b(q_resid))`` (``index_n_heads`` heads of ``index_head_dim``; ``q_resid`` is the
  attention's normed ``q_a_proj`` output),
- one key ``k_I = rope(LayerNorm(wk(x)))``, written to the paged indexer-key cache beside the latent,
- per-head weights ``w = weights_proj(x) * index_n_heads^-0.5 * index_head_dim^-0.5`` (fp32, as transformers keeps
  ``weights_proj``),

where rope rotates the first ``qk_rope_head_dim`` values in the half-split (non-interleaved) layout, as
transformers' ``DeepseekV32Indexer`` does (the main attention's rope stays interleaved). ``indexer_topk`` keeps the
``index_topk`` cached tokens of highest ``sum_h w[h] relu(q_I[h] . k_I)`` per query (causal), and every query,
prefill and decode alike, attends in the absorbed form over those tokens only (``sparse_mla``): prefill too reads
the latent cache, so a chunked prefill, a single prefill and decode see the same values.

With an FP8 indexer-key cache (``fp8_ds_index``) the indexer rotates ``q_I`` and ``k_I`` by a Hadamard matrix
before the keys are quantised, as DeepSeek's own inference code does: the rotation spreads outliers over the 128
values that share one scale, and leaves every score unchanged in exact arithmetic (the matrix of +-1 entries is
orthogonal up to a factor ``index_head_dim``, folded into ``w``). transformers' bf16 implementation has no rotation;
a ``bf16`` indexer-key cache matches it.
"""

from __future__ import annotations

import torch

from deepinfer import ops

from .config import ModelConfig
from .forward_batch import ForwardBatch
from .mla import MLAttention, linear

K_NORM_EPS = 1e-6  # the indexer's LayerNorm (transformers' DeepseekV32Indexer)


def hadamard(n: int) -> torch.Tensor:
    """The ``n x n`` Sylvester Hadamard matrix (+-1 entries, ``H @ H.T = n I``); ``n`` a power of two."""
    if n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two size, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


class Indexer:
    """One layer's lightning indexer. ``weights``: its prepared weights by checkpoint name below ``indexer.``
    (``wq_b.weight``, ``wk.weight``, ``k_norm.weight``, ``k_norm.bias``, ``weights_proj.weight`` in fp32)."""

    def __init__(self, cfg: ModelConfig, weights: dict, cos_sin_cache: torch.Tensor):
        self.heads, self.dim, self.rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
        self.w = weights
        self.cos_sin_cache = cos_sin_cache
        self.weight_scale = (self.heads * self.dim) ** -0.5
        self.rotation: torch.Tensor | None = None  # set for an FP8 key cache (``use_rotation``)

    def use_rotation(self, dtype: torch.dtype, device: torch.device) -> None:
        """Rotate queries and keys by the Hadamard matrix (for an FP8 indexer-key cache)."""
        self.rotation = hadamard(self.dim).to(dtype=dtype, device=device)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Half-split rope on the first ``rope_dim`` values of ``x [T, H, dim]``."""
        rotated = ops.rope(x[..., : self.rope_dim], positions, self.cos_sin_cache, False)
        return torch.cat([rotated, x[..., self.rope_dim :]], dim=-1)

    def forward(self, x, q_resid, batch: ForwardBatch, index_cache: torch.Tensor) -> torch.Tensor:
        """Writes the tokens' keys into ``index_cache``; returns each token's kept cache slots ``[T, index_topk]``
        int32 (-1 padded): the decode rows first, then the prefill chunks, as the batch packs them."""
        t, w = x.shape[0], self.w
        q = self._rope(linear(q_resid, w["wq_b.weight"]).view(t, self.heads, self.dim), batch.positions)
        k = ops.layer_norm(linear(x, w["wk.weight"]), w["k_norm.weight"], w["k_norm.bias"], K_NORM_EPS)
        k = self._rope(k.view(t, 1, self.dim), batch.positions)[:, 0]
        scale = self.weight_scale
        if self.rotation is not None:
            q = linear(q.reshape(t * self.heads, self.dim), self.rotation).view(t, self.heads, self.dim)
            k = linear(k, self.rotation)
            scale /= self.dim  # (H q) . (H k) = dim (q . k)
        ops.write_index_cache(k, index_cache, batch.slot_mapping)
        weights = ops.gemm(x.float(), w["weights_proj.weight"], out_dtype=torch.float32) * scale
        nd, parts = batch.num_decode, []
        if nd:
            parts.append(
                ops.indexer_topk(
                    q[:nd],
                    weights[:nd],
                    index_cache,
                    batch.block_table,
                    batch.decode_cu_seqlens(),
                    batch.seq_lens,
                    topk=self.topk,
                )
            )
        if t > nd:
            prefill_lens = batch.cu_seqlens_k[1:] - batch.cu_seqlens_k[:-1]  # each chunk's context, itself included
            parts.append(
                ops.indexer_topk(
                    q[nd:],
                    weights[nd:],
                    index_cache,
                    batch.prefill_block_table,
                    batch.cu_seqlens_q,
                    prefill_lens,
                    topk=self.topk,
                )
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class SparseMLAttention(MLAttention):
    """One DeepSeek-V3.2 layer's attention: MLA whose every query attends, absorbed, to the cached tokens its
    indexer keeps. ``weights`` as ``MLAttention``'s, plus the indexer's below ``indexer.``."""

    def __init__(self, cfg: ModelConfig, weights: dict, cos_sin_cache: torch.Tensor, softmax_scale: float):
        super().__init__(cfg, weights, cos_sin_cache, softmax_scale)
        below = {k.removeprefix("indexer."): v for k, v in weights.items() if k.startswith("indexer.")}
        self.indexer = Indexer(cfg, below, cos_sin_cache)

    def forward(self, x, batch: ForwardBatch, kv_cache, index_cache=None) -> torch.Tensor:
        t, w = x.shape[0], self.w
        qa, kv = self._down(x)
        q, q_resid = self._query(x, qa)
        q_pe = ops.rope(q[..., self.nope :], batch.positions, self.cos_sin_cache, self.interleaved)
        self._write_latent(kv, batch, kv_cache)
        indices = self.indexer.forward(x, q_resid, batch, index_cache)

        per_head, dtype = batch.rows_per_head(self.heads, t), x.dtype
        q_abs = self._absorbed_query(q[..., : self.nope], q_pe, per_head)
        o_lat, _ = ops.sparse_mla(q_abs, kv_cache, indices, softmax_scale=self.softmax_scale, kv_lora_rank=self.rank)
        o = self._values(o_lat, per_head, dtype)
        return linear(o.reshape(t, self.heads * self.v_dim), w["o_proj.weight"], w.get("o_proj.bias"))
