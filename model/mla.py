"""Multi-head latent attention (DeepSeek-V2/V3) on deepinfer ops.

Per token the paged cache holds the latent ``c = RMSNorm(x W_DKV)`` (``kv_lora_rank`` values) and the shared
rotary key ``k_pe`` (``qk_rope_head_dim`` values). Two paths read it:

- prefill (decompressed): the latents of every cached position of the sequence are expanded through ``kv_b_proj``
  into per-head keys and values, then ``attention_varlen`` runs causal attention (``D_qk = nope + rope``,
  ``D_v = v_head_dim``). The keys are read back from the cache, so a chunked prefill sees exactly the values a
  single prefill would, and the values decode sees.
- decode (absorbed): ``q_nope`` is multiplied into the latent space by ``W_UK`` (per head), ``mla_decode`` attends
  over the latent cache directly, and ``W_UV`` maps the latent output back to per-head values. The per-head
  products run as ``grouped_gemm`` in the masked layout (one "expert" per head), which needs no host
  synchronisation.
"""

from __future__ import annotations

import torch

from deepinfer import QTensor, ops
from deepinfer.kv_cache import read_tokens

from .config import ModelConfig
from .forward_batch import ForwardBatch

# The epsilon of the low-rank query's and the latent's norms (q_a_layernorm, kv_a_layernorm): DeepSeek's inference
# code and transformers build them with the RMSNorm default whatever rms_norm_eps says (that one is the layer norms').
LATENT_NORM_EPS = 1e-6


def linear(x: torch.Tensor, w: torch.Tensor | QTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` through ``deepinfer.ops.gemm``, returned in x's dtype."""
    return ops.gemm(x, w, out_dtype=x.dtype, bias=bias)


def gather_latent(kv_cache: torch.Tensor, slots: torch.Tensor, kv_lora_rank: int, dtype: torch.dtype) -> torch.Tensor:
    """The cached ``[c | k_pe]`` of ``slots`` as ``dtype`` ``[len(slots), kv_lora_rank + rope_dim]``."""
    if kv_cache.dtype == torch.uint8:  # fp8_ds_mla: unpack the records
        return read_tokens(kv_cache, slots, kv_lora_rank).to(dtype)
    return kv_cache.view(-1, kv_cache.shape[-1])[slots].to(dtype)


class MLAttention:
    """One layer's attention. ``weights``: the layer's prepared op weights by checkpoint name below
    ``self_attn.`` (``q_proj.weight`` or ``q_a_proj.weight`` / ``q_a_layernorm.weight`` / ``q_b_proj.weight``,
    ``kv_a_proj_with_mqa.weight``, ``kv_a_layernorm.weight``, ``kv_b_proj.weight``, ``o_proj.weight``, optional
    ``*.bias``), plus ``w_uk [H, r, nope]`` and ``w_uv [H, v, r]``; ``qkv_a_proj.weight`` (``q_a_proj`` and
    ``kv_a_proj_with_mqa`` stacked, as the loader fuses them where neither has a bias) stands for the two."""

    def __init__(self, cfg: ModelConfig, weights: dict, cos_sin_cache: torch.Tensor, softmax_scale: float):
        self.heads = cfg.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        self.eps = LATENT_NORM_EPS
        self.interleaved = cfg.rope_interleave
        self.cos_sin_cache = cos_sin_cache
        self.softmax_scale = softmax_scale
        self.w = weights

    def _down(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The hidden states' low-rank query ``[T, q_lora_rank]`` (None without ``q_lora_rank``) and latent
        ``[T, kv_lora_rank + rope]``, not yet normed: one product where the loader fused the two weights."""
        w = self.w
        if "qkv_a_proj.weight" in w:
            both = linear(x, w["qkv_a_proj.weight"])
            split = both.shape[1] - self.rank - self.rope_dim
            return both[:, :split], both[:, split:]
        kv = linear(x, w["kv_a_proj_with_mqa.weight"], w.get("kv_a_proj_with_mqa.bias"))
        if "q_proj.weight" in w:
            return None, kv
        return linear(x, w["q_a_proj.weight"], w.get("q_a_proj.bias")), kv

    def _query(self, x: torch.Tensor, qa: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The per-head queries ``[T, H, nope + rope]`` (rope not yet applied) from the hidden states ``x`` or, with
        ``q_lora_rank``, their low-rank query ``qa`` (``_down``), and the normed low-rank query ``q_resid`` they
        come from (None without ``q_lora_rank``)."""
        w = self.w
        q_resid = None
        if qa is None:
            q = linear(x, w["q_proj.weight"])
        else:
            q_resid = ops.rms_norm(qa, w["q_a_layernorm.weight"], self.eps)[0]
            q = linear(q_resid, w["q_b_proj.weight"])
        return q.view(x.shape[0], self.heads, self.nope + self.rope_dim), q_resid

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor, index_cache=None) -> torch.Tensor:
        """The layer's attention output ``[T, hidden]``; writes the tokens' latents into ``kv_cache``
        (``index_cache``: unused, for the signature of sparse attention layers)."""
        t, w = x.shape[0], self.w
        qa, kv = self._down(x)
        q, _ = self._query(x, qa)
        q_nope = q[..., : self.nope]
        q_pe = ops.rope(q[..., self.nope :], batch.positions, self.cos_sin_cache, self.interleaved)

        self._write_latent(kv, batch, kv_cache)

        nd = batch.num_decode
        parts = []
        if nd:
            parts.append(self._decode(q_nope[:nd], q_pe[:nd], batch, kv_cache))
        if t > nd:
            q[nd:, :, self.nope :] = q_pe[nd:]  # rope applied in place: no copy of the no-rope part
            parts.append(self._prefill(q[nd:], batch, kv_cache))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return linear(out.reshape(t, self.heads * self.v_dim), w["o_proj.weight"], w.get("o_proj.bias"))

    def _write_latent(self, kv: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor) -> None:
        """The tokens' latent ``[c | k_pe]`` into the paged cache at ``batch.slot_mapping``, from ``_down``'s
        un-normed latent ``kv``."""
        w = self.w
        c = ops.rms_norm(kv[:, : self.rank], w["kv_a_layernorm.weight"], self.eps)[0]
        k_pe = ops.rope(kv[:, None, self.rank :], batch.positions, self.cos_sin_cache, self.interleaved)
        latent = torch.cat([c, k_pe[:, 0]], dim=-1)
        ops.write_kv_cache(latent, kv_cache, batch.slot_mapping, kv_lora_rank=self.rank)

    def _absorbed_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor, per_head: torch.Tensor) -> torch.Tensor:
        """The absorbed queries ``[T, H, r + rope]``: ``w_uk``'s product of ``q_nope [T, H, nope]`` written straight
        into the latent columns (a ``torch.cat`` of the parts read the product transposed, at a fraction of the copy
        bandwidth), ``q_pe [T, H, rope]`` copied beside it."""
        q = torch.empty(*q_nope.shape[:2], self.rank + self.rope_dim, dtype=q_nope.dtype, device=q_nope.device)
        latent = q[..., : self.rank].transpose(0, 1)
        ops.grouped_gemm(q_nope.transpose(0, 1), self.w["w_uk"], masked_m=per_head, out_dtype=q.dtype, out=latent)
        q[..., self.rank :] = q_pe
        return q

    def _decode(self, q_nope, q_pe, batch: ForwardBatch, kv_cache) -> torch.Tensor:
        per_head, dtype = batch.rows_per_head(self.heads, batch.num_decode), q_nope.dtype
        q = self._absorbed_query(q_nope, q_pe, per_head).unsqueeze(1)  # [b, 1, H, r + rope]
        o_lat, _ = ops.mla_decode(
            q, kv_cache, batch.block_table, batch.seq_lens, softmax_scale=self.softmax_scale, kv_lora_rank=self.rank
        )
        return self._values(o_lat[:, 0], per_head, dtype)

    def _values(self, o_lat: torch.Tensor, per_head: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The heads' values ``[T, H, v]`` from their latent outputs ``o_lat [T, H, r]`` (``w_uv`` per head), in
        the row-major layout ``o_proj`` reads: written there by ``grouped_gemm`` rather than transposed after."""
        t, heads_first, w_uv = o_lat.shape[0], o_lat.transpose(0, 1), self.w["w_uv"]
        if t == 1:  # [H, 1, v] is already that layout
            return ops.grouped_gemm(heads_first, w_uv, masked_m=per_head, out_dtype=dtype).transpose(0, 1)
        o = torch.empty(t, self.heads, self.v_dim, dtype=dtype, device=o_lat.device)
        ops.grouped_gemm(heads_first, w_uv, masked_m=per_head, out_dtype=dtype, out=o.transpose(0, 1))
        return o

    def _prefill(self, q, batch: ForwardBatch, kv_cache) -> torch.Tensor:
        ctx = gather_latent(kv_cache, batch.context_slots, self.rank, q.dtype)
        n = ctx.shape[0]
        kv = linear(ctx[:, : self.rank].contiguous(), self.w["kv_b_proj.weight"]).view(
            n, self.heads, self.nope + self.v_dim
        )
        # two copies into the per-head keys: torch.cat of these parts ran at about a third of the copy bandwidth
        k = torch.empty(n, self.heads, self.nope + self.rope_dim, dtype=kv.dtype, device=kv.device)
        k[..., : self.nope] = kv[..., : self.nope]
        k[..., self.nope :] = ctx[:, None, self.rank :]
        v = kv[..., self.nope :]
        return ops.attention_varlen(
            q, k, v, batch.cu_seqlens_q, batch.cu_seqlens_k, softmax_scale=self.softmax_scale, causal=True
        )
