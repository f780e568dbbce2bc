"""DeepSeekMoE on deepinfer ops: a dense SwiGLU MLP, and routed experts plus shared experts.

Routed path: router logits in fp32 (``router_logits``) -> ``moe_route`` (group-limited, bias for selection
only) -> ``ep_dispatch`` (rows grouped by expert; with FP8 experts the tokens are quantised once, before they
are copied per expert) -> ``grouped_gemm`` (gate and up fused) -> ``silu_and_mul`` ->
``grouped_gemm`` (down) -> ``ep_combine`` (weighted sum back to the tokens); the shared experts are a dense
SwiGLU MLP added on top.

Which experts this process holds is data (``ExpertParallel``: the core's ``ExpertPlacement``, a rank, a process
group): the layer keeps the weights of its local experts in placement order and passes placement and group to
``ep_dispatch``, so sharding the experts over ranks changes the data, not the layer. Over several ranks (each
running the same batch, see ``parallel.py``) each rank runs the layer on its share of the tokens, rows
``[rank * c, (rank + 1) * c)`` with ``c = ceil(T / world)``, and the ranks all-gather the outputs; a low-latency
dispatch then uses capacity ``c``, the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer import QTensor, ops
from deepinfer.ops.moe import ExpertPlacement

from .config import ModelConfig
from .forward_batch import ForwardBatch
from .mla import linear


def router_weight(gate: torch.Tensor) -> torch.Tensor:
    """The fp32 router weight ``[E, H]`` as bf16 where each of its values is a bf16 value (DeepSeek's checkpoints
    store it in bf16), else as it is. The product of two bf16 values is exact in fp32, so ``router_logits`` then sums
    the fp32 product's own terms, on tensor cores and from half the bytes."""
    half = gate.bfloat16()
    return half if torch.equal(half.float(), gate) else gate


def router_logits(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``[T, E]`` fp32 logits ``x @ gate.T`` for ``x [T, H]``, its terms each exact in fp32: from bf16 operands
    where both are bf16 (``router_weight``), else against the fp32 weight (``gemm`` takes a bf16 ``x`` as it is)."""
    if x.dtype == gate.dtype == torch.bfloat16 or gate.dtype == torch.float32:
        return ops.gemm(x, gate, out_dtype=torch.float32)
    return ops.gemm(x.float(), gate.float(), out_dtype=torch.float32)


@dataclass(frozen=True)
class ExpertParallel:
    """This process's place in expert parallelism: the core ``ExpertPlacement`` (which rank holds which experts),
    this process's ``rank`` and the ``torch.distributed`` ``group`` (None: one process holding every expert).
    The layer keeps the weights of ``local`` experts, in that order."""

    placement: ExpertPlacement
    rank: int = 0
    group: Any = None

    @classmethod
    def single(cls, num_experts: int) -> ExpertParallel:
        """One process holding every expert in id order."""
        return cls(ExpertPlacement.contiguous(num_experts, 1))

    @property
    def local(self) -> tuple[int, ...]:
        return self.placement.local_experts[self.rank]

    @property
    def world_size(self) -> int:
        return self.placement.world_size

    def token_share(self, num_tokens: int) -> tuple[int, int, int]:
        """``(start, end, c)``: this rank's rows ``[start, end)`` of a batch of ``num_tokens`` tokens in an MoE
        layer, ``c = ceil(num_tokens / world_size)`` rows per rank (the last ranks may get fewer, or none)."""
        c = -(-num_tokens // self.world_size)
        return min(self.rank * c, num_tokens), min((self.rank + 1) * c, num_tokens), c

    def run_share(
        self, x: torch.Tensor, mode: str, layer: Callable[[int, int, int | None], torch.Tensor]
    ) -> torch.Tensor:
        """An MoE layer over the ranks, a collective: ``layer(start, end, capacity)`` routes this rank's rows
        ``[start, end)`` of ``x [T, H]`` (``token_share``; every row on one rank) through the experts of all ranks,
        with the low-latency dispatch's ``capacity`` (the share, the same on every rank; None in ``normal`` mode or
        on one rank), and every rank gets the whole batch's output ``[T, H]``."""
        num_tokens = x.shape[0]
        if self.world_size == 1:
            return layer(0, num_tokens, None)
        start, end, share = self.token_share(num_tokens)
        if share == 0:
            return torch.empty_like(x)
        capacity = share if mode == "low_latency" else None
        return all_gather_rows(layer(start, end, capacity), share, num_tokens, self.group)


def quantised_for(w) -> dict:
    """``silu_and_mul``'s arguments for the input of ``w``: for an FP8 weight the activation quantised from the fp32
    product in the weight's scale format, for a float one none."""
    return {"quantize": True, "scale_format": w.scale_format} if isinstance(w, QTensor) else {}


def routed_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13,
    w2,
    ep: ExpertParallel,
    *,
    num_experts: int,
    mode: str,
    capacity: int | None,
    limit: float | None = None,
) -> torch.Tensor:
    """``[T, H]``: each token of ``x [T, H]`` through the SwiGLU experts ``ids [T, k]`` picked, weighted by
    ``weights [T, k]`` and summed: dispatched to the ranks holding them (``ep``), the stacked experts ``w13`` / ``w2``
    applied by ``grouped_gemm``, combined back. ``limit``: the SwiGLU clamp (DeepSeek-V4's ``swiglu_limit``)."""
    routed = x
    if isinstance(w13, QTensor):  # quantised once per token, not once per (token, expert) row received
        routed = ops.quantize_fp8(x, block=w13.block[1], scale_format=w13.scale_format)
    recv, _, _, layout, handle = ops.ep_dispatch(
        routed,
        ids,
        weights,
        num_experts=num_experts,
        group=ep.group,
        mode=mode,
        capacity=capacity,
        placement=ep.placement,
    )
    groups = {"expert_offsets": layout.expert_offsets, "masked_m": layout.masked_m}
    h = ops.grouped_gemm(recv, w13, out_dtype=x.dtype, **groups)
    a = ops.silu_and_mul(h, masked_m=layout.masked_m, limit=limit, **quantised_for(w2))
    return ops.ep_combine(ops.grouped_gemm(a, w2, out_dtype=x.dtype, **groups), handle)


def _swiglu(x: torch.Tensor, w13, w2) -> torch.Tensor:
    h = linear(x, w13)
    if isinstance(w2, QTensor):
        return ops.gemm(ops.silu_and_mul(h, quantize=True, scale_format=w2.scale_format), w2, out_dtype=x.dtype)
    return linear(ops.silu_and_mul(h), w2)


class DenseMLP:
    """SwiGLU MLP: ``gate_up_proj.weight`` (gate and up stacked, ``[2I, H]``) and ``down_proj.weight`` ``[H, I]``."""

    def __init__(self, weights: dict):
        self.w13, self.w2 = weights["gate_up_proj.weight"], weights["down_proj.weight"]

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return _swiglu(x, self.w13, self.w2)


class MoE:
    """Weights by name below ``mlp.``: routed experts ``experts.gate_up_proj [E_local, 2I, H]`` and
    ``experts.down_proj [E_local, H, I]``, the fp32 router ``gate.weight [E, H]`` (kept as ``router_weight``) and
    ``gate.e_score_correction_bias [E]`` (sigmoid scoring), and the shared experts (a ``DenseMLP`` under
    ``shared_experts.``, optional)."""

    def __init__(self, cfg: ModelConfig, weights: dict, ep: ExpertParallel):
        self.cfg, self.ep = cfg, ep
        self.gate, self.bias = router_weight(weights["gate.weight"]), weights.get("gate.e_score_correction_bias")
        self.w13, self.w2 = weights["experts.gate_up_proj"], weights["experts.down_proj"]
        shared = {k.removeprefix("shared_experts."): v for k, v in weights.items() if k.startswith("shared_experts.")}
        self.shared = DenseMLP(shared) if shared else None
        self.load: torch.Tensor | None = None  # [E] int64: when set, each forward adds its tokens per expert (eplb.py)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """``x [T, H]`` -> ``[T, H]``. Over several ranks a collective: every rank calls it with the same ``T`` and
        ``batch.moe_mode``, and gets the whole batch's output."""
        mode = batch.moe_mode
        return self.ep.run_share(
            x, mode, lambda start, end, cap: self._forward(x[start:end], mode, cap, self._counted(batch, start, end))
        )

    def _counted(self, batch: ForwardBatch, start: int, end: int) -> torch.Tensor | None:
        """``[end - start]`` int64: 1 for each of the rows that count towards the expert load, 0 for padding rows of
        a CUDA-graph batch (decode rows with ``seq_len`` 0); None when the load is not measured. Made once per
        forward and shared by the layers."""
        if self.load is None:
            return None
        key = ("counted", start, end)
        if key not in batch._made:
            rows = torch.ones(end - start, dtype=torch.int64, device=self.load.device)
            decode = min(end, batch.num_decode)
            if batch.seq_lens is not None and decode > start:
                rows[: decode - start] = (batch.seq_lens[start:decode] > 0).to(torch.int64)
            batch._made[key] = rows
        return batch._made[key]

    def _forward(
        self, x: torch.Tensor, mode: str, capacity: int | None, counted: torch.Tensor | None = None
    ) -> torch.Tensor:
        cfg = self.cfg
        logits = router_logits(x, self.gate)
        weights, ids = ops.moe_route(
            logits,
            self.bias,
            top_k=cfg.num_experts_per_tok,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            renormalize=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor,
            scoring=cfg.scoring_func,
        )
        if counted is not None and ids.numel():  # on the device, no host synchronisation
            self.load.index_add_(0, ids.reshape(-1).long(), counted.repeat_interleave(ids.shape[1]))
        out = routed_experts(
            x, ids, weights, self.w13, self.w2, self.ep, num_experts=cfg.n_routed_experts, mode=mode, capacity=capacity
        )
        if self.shared is not None:
            out = out + _swiglu(x, self.shared.w13, self.shared.w2)
        return out


def all_gather_rows(y: torch.Tensor, share: int, num_tokens: int, group: Any) -> torch.Tensor:
    """Every rank's ``y`` (at most ``share`` rows, padded to ``share``) stacked in rank order: ``[num_tokens, H]``.
    Rows travel as bytes, so the collective needs no support for y's dtype."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if y.shape[0] == share and y.is_contiguous():
        send = y
    else:
        send = torch.zeros(share, *y.shape[1:], dtype=y.dtype, device=y.device)
        send[: y.shape[0]] = y
    out = torch.empty(world * share, *y.shape[1:], dtype=y.dtype, device=y.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out.view(torch.uint8), send.view(torch.uint8), group=group)
    return out[:num_tokens]
