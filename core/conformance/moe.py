"""Conformance cases for ``moe_route``, ``moe_route_hash``, ``ep_dispatch``, ``ep_combine`` (one process)."""

from __future__ import annotations

import torch

from ..ops import ep_combine, ep_dispatch
from ..qtensor import QTensor, quantize_rows
from .cases import BadInput, Case, Gen, rows_of, take_rows


def _sorted_pairs(out):
    """moe_route leaves the order within a row open: compare (id, weight) pairs sorted by id."""
    weights, ids = out
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


def _route_case(
    tokens: int,
    experts: int,
    top_k: int,
    n_group: int,
    topk_group: int,
    *,
    bias: bool = True,
    scoring: str = "sigmoid",
    scale: float = 2.5,
    renormalize: bool = True,
) -> Case:
    def make(g: Gen):
        return {
            "logits": g.randn(tokens, experts, dtype=torch.float32, scale=2.0),
            "bias": g.randn(experts, dtype=torch.float32, scale=0.3) if bias else None,
            "top_k": top_k,
            "n_group": n_group,
            "topk_group": topk_group,
            "renormalize": renormalize,
            "routed_scaling_factor": scale,
            "scoring": scoring,
        }

    name = (
        f"T={tokens} E={experts} k={top_k} groups={topk_group}/{n_group} {scoring}"
        + ("" if bias else " no-bias")
        + ("" if renormalize else " no-renorm")
    )
    return Case(
        "moe_route",
        name,
        "default",
        make,
        run=lambda op, kw: _sorted_pairs(op(**kw)),
        sub_batch=lambda kw, rows: (take_rows(kw, ("logits",), rows), lambda o: rows_of(o, rows)),
        batch=lambda kw: kw["logits"].shape[0],
    )


def _hash_route_case(
    tokens: int, experts: int, top_k: int, *, scoring: str = "sqrtsoftplus", distinct: bool = True, scale: float = 1.5
) -> Case:
    """Given experts per token (DeepSeek-V4's ``tid2eid[input_ids]``): distinct per row as a hash table gives them,
    or drawn with repeats. Logits of both signs and beyond softplus's linear range."""

    def make(g: Gen):
        if distinct:
            ids = torch.stack([g.perm(experts)[:top_k] for _ in range(tokens)]) if tokens else None
        else:
            ids = torch.randint(0, experts, (tokens, top_k), generator=g.cpu)
        if ids is None:
            ids = torch.zeros(0, top_k, dtype=torch.long)
        return {
            "logits": g.randn(tokens, experts, dtype=torch.float32, scale=8.0),
            "expert_ids": ids.to(dtype=torch.int32, device=g.device),
            "routed_scaling_factor": scale,
            "scoring": scoring,
        }

    name = f"T={tokens} E={experts} k={top_k} {scoring}" + ("" if distinct else " repeats")
    return Case(
        "moe_route_hash",
        name,
        "default",
        make,
        sub_batch=lambda kw, rows: (take_rows(kw, ("logits", "expert_ids"), rows), lambda o: rows_of(o, rows)),
        batch=lambda kw: kw["logits"].shape[0],
    )


def _routing(g: Gen, tokens: int, experts: int, top_k: int, skip_fraction: float = 0.1):
    """Distinct experts per token, one expert never chosen, some pairs -1."""
    chosen = (
        torch.stack([g.perm(experts - 1)[:top_k] + 1 for _ in range(tokens)])
        if tokens
        else torch.zeros(0, top_k, dtype=torch.long)
    )  # expert 0 gets nothing
    ids = chosen.to(torch.int32)
    drop = torch.rand(ids.shape, generator=g.cpu) < skip_fraction
    ids[drop] = -1
    weights = torch.rand(ids.shape, generator=g.cpu)
    return ids.to(g.device), weights.to(g.device)


def _ep_kwargs(g: Gen, tokens: int, hidden: int, experts: int, top_k: int, fp8: bool, mode: str):
    x = g.randn(tokens, hidden)
    ids, weights = _routing(g, tokens, experts, top_k)
    return {
        "x": quantize_rows(x, 128, "fp32") if fp8 else x,
        "ids": ids,
        "weights": weights,
        "num_experts": experts,
        "mode": mode,
    }


def _valid_rows(out):
    """Zeroes what ep_dispatch leaves unspecified: rows past masked_m in low-latency mode; in normal mode the data of
    the skipped pairs' rows (their ids and weights, -1 and 0, are compared as they are)."""
    recv_x, recv_ids, recv_w, layout, _ = out
    normal = layout.masked_m is None
    if normal:
        valid = recv_ids >= 0
    else:
        cap = recv_ids.shape[1]
        valid = torch.arange(cap, device=recv_ids.device)[None, :] < layout.masked_m[:, None].long()

    def keep(t):
        v = valid.reshape(*valid.shape, *([1] * (t.dim() - valid.dim())))
        return torch.where(v, t, torch.zeros((), dtype=t.dtype, device=t.device))

    if isinstance(recv_x, QTensor):
        data = keep(recv_x.data.view(torch.uint8)).view(recv_x.data.dtype)
        recv_x = QTensor(data, keep(recv_x.scale), recv_x.block, recv_x.scale_format)
    else:
        recv_x = keep(recv_x)
    return (recv_x, recv_ids, recv_w, layout) if normal else (recv_x, keep(recv_ids), keep(recv_w), layout)


def _expert_outputs(recv_x, recv_ids) -> torch.Tensor:
    """A stand-in expert: each expert scales its rows by its own factor."""
    x = recv_x.dequantize() if isinstance(recv_x, QTensor) else recv_x.float()
    factor = 1.0 + recv_ids.clamp_min(0).float() / 8.0
    return (x * factor.unsqueeze(-1)).to(torch.bfloat16)


def _dispatch_case(tokens: int, hidden: int, experts: int, top_k: int, fp8: bool, mode: str) -> Case:
    name = f"T={tokens} H={hidden} E={experts} k={top_k} {'fp8' if fp8 else 'bf16'} {mode}"
    return Case(
        "ep_dispatch",
        name,
        "default",
        lambda g: _ep_kwargs(g, tokens, hidden, experts, top_k, fp8, mode),
        run=lambda op, kw: _valid_rows(op(**kw)),
    )


def _combine_case(tokens: int, hidden: int, experts: int, top_k: int, fp8: bool, mode: str) -> Case:
    def run(op, kw):
        recv_x, recv_ids, _, _, handle = ep_dispatch(**kw)
        return ep_combine(_expert_outputs(recv_x, recv_ids), handle)

    name = f"T={tokens} H={hidden} E={experts} k={top_k} {'fp8' if fp8 else 'bf16'} {mode}"
    return Case(
        "ep_combine",
        name,
        "default",
        lambda g: _ep_kwargs(g, tokens, hidden, experts, top_k, fp8, mode),
        run=run,
        sub_batch=lambda kw, rows: (take_rows(kw, ("x", "ids", "weights"), rows), lambda o: rows_of(o, rows)),
        batch=lambda kw: kw["ids"].shape[0],
    )


def cases(shapes: str) -> list[Case]:
    if shapes == "small":
        out = [
            _route_case(1, 16, 4, 4, 2),
            _route_case(37, 16, 4, 4, 2),
            _route_case(64, 64, 6, 8, 3, scale=1.0),
            _route_case(20, 32, 2, 1, 1, bias=False),
            _route_case(9, 24, 3, 1, 1, scoring="softmax", bias=False, renormalize=False, scale=1.0),
            _route_case(11, 32, 4, 4, 2, scoring="softmax"),
            _route_case(0, 16, 4, 4, 2),
            _route_case(7, 8, 2, 1, 1, scale=1.0),  # E below the CPU vector width: rows must not share vectors
            _route_case(9, 24, 3, 3, 2),
            # DeepSeek-V4: sqrt(softplus) scores, no groups.
            _route_case(1, 16, 4, 1, 1, scoring="sqrtsoftplus", scale=1.5),
            _route_case(37, 64, 6, 1, 1, scoring="sqrtsoftplus", scale=1.5),
            _route_case(9, 24, 3, 1, 1, scoring="sqrtsoftplus", bias=False, renormalize=False),
            _hash_route_case(1, 16, 4),
            _hash_route_case(37, 64, 6),
            _hash_route_case(0, 16, 4),
            _hash_route_case(13, 8, 3, distinct=False),
            _hash_route_case(11, 32, 4, scoring="sigmoid"),
        ]
        for mode in ("normal", "low_latency"):
            for fp8 in (False, True):
                out += [_dispatch_case(13, 256, 8, 3, fp8, mode), _combine_case(13, 256, 8, 3, fp8, mode)]
            out += [
                _dispatch_case(0, 128, 4, 2, False, mode),
                _combine_case(0, 128, 4, 2, False, mode),
                _dispatch_case(1, 128, 16, 4, False, mode),
                _combine_case(40, 128, 16, 4, False, mode),
            ]
        return out
    out = [_route_case(t, 256, 8, 8, 4) for t in (1, 128, 4096)]
    out += [_route_case(t, 256, 6, 1, 1, scoring="sqrtsoftplus", scale=1.5) for t in (1, 128, 4096)]
    out += [_hash_route_case(t, 256, 6) for t in (1, 128, 4096)]
    for mode in ("normal", "low_latency"):
        for fp8 in (False, True):
            out += [_dispatch_case(t, 7168, 256, 8, fp8, mode) for t in (1, 128)]
            out += [_combine_case(t, 7168, 256, 8, fp8, mode) for t in (1, 128)]
    out += [_dispatch_case(4096, 7168, 256, 8, fp8, "normal") for fp8 in (False, True)]
    out += [_combine_case(4096, 7168, 256, 8, fp8, "normal") for fp8 in (False, True)]
    return out


def bad_inputs() -> list[BadInput]:
    def route(g: Gen, **over):
        kw = {"logits": g.randn(4, 16, dtype=torch.float32), "bias": None, "top_k": 2, "n_group": 4, "topk_group": 2}
        return {**kw, **over}

    def hashed(g: Gen, **over):
        ids = torch.stack([g.perm(16)[:2] for _ in range(4)]).to(dtype=torch.int32, device=g.device)
        return {**{"logits": g.randn(4, 16, dtype=torch.float32), "expert_ids": ids}, **over}

    def disp(g: Gen, **over):
        ids, weights = _routing(g, 4, 8, 2, 0.0)
        return {**{"x": g.randn(4, 128), "ids": ids, "weights": weights, "num_experts": 8}, **over}

    return [
        BadInput("moe_route", "bf16 logits", "logits", lambda g: route(g, logits=g.randn(4, 16))),
        BadInput("moe_route", "groups not dividing E", "n_group", lambda g: route(g, n_group=3)),
        BadInput("moe_route", "topk_group > n_group", "topk_group", lambda g: route(g, topk_group=5)),
        BadInput("moe_route", "top_k beyond the kept groups", "top_k", lambda g: route(g, top_k=9)),
        BadInput(
            "moe_route", "bias of the wrong length", "bias", lambda g: route(g, bias=g.randn(8, dtype=torch.float32))
        ),
        BadInput("moe_route", "unknown scoring", "scoring", lambda g: route(g, scoring="relu")),
        BadInput("moe_route", "groups with sqrtsoftplus", "n_group", lambda g: route(g, scoring="sqrtsoftplus")),
        BadInput("moe_route_hash", "bf16 logits", "logits", lambda g: hashed(g, logits=g.randn(4, 16))),
        BadInput(
            "moe_route_hash",
            "expert id past E",
            "expert_ids",
            lambda g: hashed(g, expert_ids=torch.full((4, 2), 16, dtype=torch.int32, device=g.device)),
        ),
        BadInput(
            "moe_route_hash",
            "negative expert id",
            "expert_ids",
            lambda g: hashed(g, expert_ids=torch.full((4, 2), -1, dtype=torch.int32, device=g.device)),
        ),
        BadInput(
            "moe_route_hash",
            "int64 expert ids",
            "expert_ids",
            lambda g: hashed(g, expert_ids=hashed(g)["expert_ids"].long()),
        ),
        BadInput(
            "moe_route_hash",
            "expert ids rows != tokens",
            "expert_ids",
            lambda g: hashed(g, expert_ids=torch.zeros(5, 2, dtype=torch.int32, device=g.device)),
        ),
        BadInput(
            "moe_route_hash",
            "1-D expert ids",
            "expert_ids",
            lambda g: hashed(g, expert_ids=torch.zeros(4, dtype=torch.int32, device=g.device)),
        ),
        BadInput(
            "moe_route_hash",
            "no expert per token",
            "expert_ids",
            lambda g: hashed(g, expert_ids=torch.zeros(4, 0, dtype=torch.int32, device=g.device)),
        ),
        BadInput("moe_route_hash", "unknown scoring", "scoring", lambda g: hashed(g, scoring="relu")),
        BadInput(
            "moe_route_hash",
            "negative scaling",
            "routed_scaling_factor",
            lambda g: hashed(g, routed_scaling_factor=-1.0),
        ),
        BadInput(
            "moe_route_hash",
            "infinite scaling",
            "routed_scaling_factor",
            lambda g: hashed(g, routed_scaling_factor=float("inf")),
        ),
        BadInput(
            "moe_route",
            "infinite scaling",
            "routed_scaling_factor",
            lambda g: route(g, routed_scaling_factor=float("inf")),
        ),
        BadInput("ep_dispatch", "int64 ids", "ids", lambda g: disp(g, ids=disp(g)["ids"].long())),
        BadInput(
            "ep_dispatch",
            "expert id out of range",
            "ids",
            lambda g: disp(g, ids=torch.full((4, 2), 8, dtype=torch.int32, device=g.device)),
        ),
        BadInput(
            "ep_dispatch",
            "weights of another shape",
            "weights",
            lambda g: disp(g, weights=torch.ones(4, 3, device=g.device)),
        ),
        BadInput(
            "ep_dispatch",
            "ids rows != tokens",
            "ids",
            lambda g: disp(g, ids=torch.zeros(5, 2, dtype=torch.int32, device=g.device)),
        ),
        BadInput("ep_dispatch", "unknown mode", "mode", lambda g: disp(g, mode="fast")),
        BadInput("ep_dispatch", "a billion experts", "num_experts", lambda g: disp(g, num_experts=10**9)),
        BadInput("ep_dispatch", "group not a process group", "group", lambda g: disp(g, group="world")),
        BadInput(
            "ep_dispatch",
            "capacity too small",
            "capacity",
            lambda g: disp(
                g,
                mode="low_latency",
                capacity=0,
                ids=torch.zeros(4, 1, dtype=torch.int32, device=g.device),
                weights=torch.ones(4, 1, device=g.device),
            ),
        ),
    ]
