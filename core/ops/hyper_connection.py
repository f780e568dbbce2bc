"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): ``hc_pre``, ``hc_post``, ``hc_head``.

The residual of a V4 layer is ``N`` parallel streams ``[T, N, D]``. ``hc_pre`` computes, from the streams, the
weights that collapse them into one block input (``pre``), expand the block output back (``post``) and mix the
streams (``comb``, doubly stochastic through Sinkhorn-Knopp), and returns the collapsed input with ``post`` and
``comb``; ``hc_post`` forms the next streams; ``hc_head`` collapses the streams once more before the final norm.
The semantics are those of transformers' ``DeepseekV4HyperConnection``, ``DeepseekV4DecoderLayer`` and
``DeepseekV4HyperHead``. The parameters (``fn``, ``base``, ``scale``) are fp32, as V4 keeps them.
"""

from __future__ import annotations

import torch

from ..dispatch import call
from ..validation import FLOAT_DTYPES, Check

F32 = (torch.float32,)


def _streams(c: Check, streams) -> tuple[int, int, int]:
    c.tensor("streams", streams, dtypes=FLOAT_DTYPES, ndim=3)
    tokens, n, d = streams.shape
    if n < 1 or d < 1:
        raise c.fail("streams", "at least one stream of at least one channel", f"shape {list(streams.shape)}")
    return tokens, n, d


def _eps(c: Check, name: str, value, *, positive: bool) -> float:
    c.number(name, value, low=0.0)
    if value == float("inf") or (positive and value == 0):
        raise c.fail(name, "a finite number " + ("> 0" if positive else ">= 0"), repr(value))
    return float(value)


def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    sinkhorn_iters: int = 20,
    eps: float = 1e-6,
    norm_eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mHC weights of one block and its collapsed input (``DeepseekV4HyperConnection.forward``), in fp32.

    streams: ``[T, N, D]`` bf16 / fp16 / fp32; fn: ``[(2+N)*N, N*D]`` fp32; base: ``[(2+N)*N]`` fp32; scale: ``[3]``
    fp32 (pre, post, comb). With ``x`` the flattened streams ``[T, N*D]`` in fp32:

    - ``m = (x * rsqrt(mean(x^2) + norm_eps)) @ fn.T`` (an unweighted RMS norm, then the projection), split into
      ``[N | N | N*N]`` as is ``base``;
    - ``pre = sigmoid(m_pre * scale[0] + base_pre) + eps``; ``post = 2 * sigmoid(m_post * scale[1] + base_post)``;
    - ``comb = softmax(m_comb * scale[2] + base_comb, over the last dim) + eps`` as ``[N, N]`` (row-major), then
      Sinkhorn-Knopp: columns normalised once (``comb / (column sums + eps)``), then ``sinkhorn_iters - 1`` times
      rows (``comb / (row sums + eps)``) and then columns;
    - ``collapsed[t] = sum_j pre[t, j] * streams[t, j]`` (fp32 sum, returned in the streams' dtype).

    Returns ``(collapsed [T, D], post [T, N] fp32, comb [T, N, N] fp32)``. sinkhorn_iters: an int >= 1; eps: a
    finite number >= 0; norm_eps: a finite number > 0.
    """
    c = Check("hc_pre")
    _, n, d = _streams(c, streams)
    mixes = (2 + n) * n
    c.tensor("fn", fn, dtypes=F32, shape=(mixes, n * d))
    c.tensor("base", base, dtypes=F32, shape=(mixes,))
    c.tensor("scale", scale, dtypes=F32, shape=(3,))
    c.same_device(streams=streams, fn=fn, base=base, scale=scale)
    c.positive_int("sinkhorn_iters", sinkhorn_iters)
    eps, norm_eps = _eps(c, "eps", eps, positive=False), _eps(c, "norm_eps", norm_eps, positive=True)
    return call(
        "hc_pre",
        streams=streams,
        fn=fn,
        base=base,
        scale=scale,
        sinkhorn_iters=sinkhorn_iters,
        eps=eps,
        norm_eps=norm_eps,
    )


def hc_post(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The streams after a block (``DeepseekV4DecoderLayer.forward``): ``new[t, i] = post[t, i] * block_out[t] +
    sum_j comb[t, j, i] * streams[t, j]``, i.e. ``post[..., None] * block_out[:, None] + comb^T @ streams`` (comb is
    applied transposed: its first index is the source stream).

    block_out: ``[T, D]`` and streams ``[T, N, D]``, one float dtype; post: ``[T, N]`` fp32 and comb: ``[T, N, N]``
    fp32, as ``hc_pre`` returns them. Computed in fp32 and returned ``[T, N, D]`` in the streams' dtype once rounded
    (transformers rounds post and comb to the streams' dtype first and computes in it).
    """
    c = Check("hc_post")
    tokens, n, d = _streams(c, streams)
    c.tensor("block_out", block_out, dtypes=(streams.dtype,), shape=(tokens, d))
    c.tensor("post", post, dtypes=F32, shape=(tokens, n))
    c.tensor("comb", comb, dtypes=F32, shape=(tokens, n, n))
    c.same_device(streams=streams, block_out=block_out, post=post, comb=comb)
    return call("hc_post", block_out=block_out, streams=streams, post=post, comb=comb)


def hc_head(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    eps: float = 1e-6,
    norm_eps: float = 1e-6,
) -> torch.Tensor:
    """The final collapse of the streams (``DeepseekV4HyperHead``), in fp32: ``m = (x * rsqrt(mean(x^2) +
    norm_eps)) @ fn.T`` over the flattened streams ``x [T, N*D]``, ``pre = sigmoid(m * scale[0] + base) + eps``, and
    ``out[t] = sum_j pre[t, j] * streams[t, j]``.

    streams: ``[T, N, D]`` bf16 / fp16 / fp32; fn: ``[N, N*D]``, base: ``[N]``, scale: ``[1]``, all fp32. Returns
    ``[T, D]`` in the streams' dtype. eps: a finite number >= 0; norm_eps: a finite number > 0.
    """
    c = Check("hc_head")
    _, n, d = _streams(c, streams)
    c.tensor("fn", fn, dtypes=F32, shape=(n, n * d))
    c.tensor("base", base, dtypes=F32, shape=(n,))
    c.tensor("scale", scale, dtypes=F32, shape=(1,))
    c.same_device(streams=streams, fn=fn, base=base, scale=scale)
    eps, norm_eps = _eps(c, "eps", eps, positive=False), _eps(c, "norm_eps", norm_eps, positive=True)
    return call("hc_head", streams=streams, fn=fn, base=base, scale=scale, eps=eps, norm_eps=norm_eps)
