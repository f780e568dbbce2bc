"""Expert parallelism over the processes of a ``torch.distributed`` group: set-up, and keeping the ranks in step.

Every rank of the group serves the same requests with the same engine and holds every weight but the routed
experts: scheduling, embeddings, attention, the dense layers and sampling run on every rank alike. With
``ep = N`` ranks, rank ``r`` holds experts ``[r * E / N, (r + 1) * E / N)`` (``ExpertPlacement.contiguous``; ``N``
must divide ``E``) and loads only their weights. In each MoE layer rank ``r`` takes its share of the batch's ``T``
tokens (rows ``[r * c, (r + 1) * c)`` with ``c = ceil(T / N)``, possibly none), routes them, sends them to the
ranks holding their experts (``ep_dispatch``), combines the expert outputs (``ep_combine``), adds its shared
experts, and all ranks all-gather the layer's output: every rank continues with the whole batch, and no expert row
is computed twice.

Ranks stay in step because everything that decides what runs is deterministic and the same on every rank:

- requests: every rank adds the same requests in the same order (the caller's contract);
- sampling: greedy needs nothing; a request with a seed samples by it; a request without one gets its seed from a
  generator seeded by rank 0's random draw, broadcast once when the engine starts, so unseeded sampling is random
  per run yet the same on every rank;
- the cache: an automatically sized cache takes the smallest page count of the ranks (free memory may differ), so
  scheduling and preemption, which depend only on the pages and the requests, decide alike;
- CUDA graphs: used only if capture succeeded on every rank, so the MoE mode of each step (``low_latency`` in a
  replayed graph, ``normal`` otherwise) is the same on every rank.

Divergence is still an error, never a hang or a silently wrong answer: the engine checks once that every rank has
the same settings, and before each step's forward it all-gathers a fingerprint of the scheduled batch and of the
tokens sampled by the previous step; any difference raises ``RankDivergenceError`` on every rank. These checks run
on the host: over a Gloo group, the group itself; over any other (NCCL), a Gloo group on the same ranks with the same
timeout (``host_group``), so that a check never waits for the device's queue. A rank that dies or stops answering
surfaces on the others as the process group's error after its timeout.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.ops.moe import ExpertPlacement

from .errors import ParallelError, RankDivergenceError
from .moe import ExpertParallel

DEFAULT_TIMEOUT_S = 600.0


def check_ep(
    ep: Any, num_experts: int, group_size: int | None, *, arg: str = "ep", num_redundant_experts: int = 0
) -> int:
    """``ep`` as an int after checking it: a positive int (None means 1), equal to ``group_size`` (the size of the
    process group, None when there is none) when above 1, and a divisor of the model's ``num_experts`` routed
    experts plus ``num_redundant_experts`` (copies of hot experts, ``eplb.py``: a non-negative int, 0 for one rank,
    and at most ``num_experts * (ep - 1)`` since a rank holds an expert once). Raises ``ParallelError`` naming
    ``arg`` or ``num_redundant_experts``."""
    if ep is None:
        ep = 1
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ParallelError(arg, "a positive int (the number of ranks the routed experts are split over)", repr(ep))
    redundant = num_redundant_experts
    if isinstance(redundant, bool) or not isinstance(redundant, int) or redundant < 0:
        raise ParallelError("num_redundant_experts", "an int >= 0", repr(redundant))
    if ep == 1:
        if redundant:
            raise ParallelError(
                "num_redundant_experts",
                "0 without expert parallelism (one rank holds each expert once)",
                str(redundant),
            )
        return ep
    if group_size is None:
        raise ParallelError(
            arg,
            f"an initialised torch.distributed process group of {ep} ranks (launch with torchrun --nproc-per-node "
            f"{ep} and call torch.distributed.init_process_group, or run `deepinfer generate --ep {ep}` under "
            "torchrun)",
            f"ep={ep} and no process group",
        )
    if group_size != ep:
        raise ParallelError(arg, f"the size of the process group ({group_size} ranks)", str(ep))
    if num_experts < 1:
        raise ParallelError(arg, "1 for a model without routed experts (nothing to split)", str(ep))
    if redundant > num_experts * (ep - 1):
        raise ParallelError(
            "num_redundant_experts",
            f"at most {num_experts * (ep - 1)} (each of the {num_experts} experts at most once per rank)",
            str(redundant),
        )
    if (num_experts + redundant) % ep:
        if redundant:
            raise ParallelError(
                "num_redundant_experts",
                f"a count that makes the {num_experts} routed experts plus the redundant ones a multiple of ep={ep}",
                str(redundant),
            )
        fill = ep - num_experts % ep  # the fewest redundant experts that make the slots divide evenly
        raise ParallelError(
            arg,
            f"a divisor of the model's {num_experts} routed experts (every rank holds as many), or redundant "
            f"experts making up the difference (enable_eplb=True and num_redundant_experts {fill}, {fill + ep}, "
            "...)",
            str(ep),
        )
    return ep


def expert_parallel(
    ep: Any,
    num_experts: int,
    group: Any = None,
    *,
    arg: str = "ep",
    num_redundant_experts: int = 0,
    num_groups: int = 1,
) -> ExpertParallel:
    """This process's ``ExpertParallel`` for ``ep`` ranks (``check_ep``): for ``ep`` None or 1 one process holding
    every expert; otherwise, over ``group`` (default: the default process group, which must be initialised) and
    this process's rank in it: without ``num_redundant_experts`` the contiguous placement (however many nodes the
    ranks span), with them the placement ``eplb.initial_placement`` gives for the router's ``num_groups`` groups and
    the nodes of the launch."""
    import torch.distributed as dist

    if group is not None and not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        if dist.is_available() and isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
            # what torch.distributed.new_group returns on a rank outside the group
            raise ParallelError("ep_group", "a process group this process belongs to", "a group without it")
        raise ParallelError("ep_group", "a torch.distributed ProcessGroup or None (the default group)", repr(group))
    ready = dist.is_available() and dist.is_initialized()
    if group is None and ready and ep not in (None, 1):
        group = dist.group.WORLD
    size = dist.get_world_size(group) if group is not None and ready else None
    ep = check_ep(ep, num_experts, size, arg=arg, num_redundant_experts=num_redundant_experts)
    if ep == 1:
        return ExpertParallel.single(num_experts)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ParallelError("ep_group", "a process group this process belongs to", "a group without it")
    if num_redundant_experts == 0:
        return ExpertParallel(ExpertPlacement.contiguous(num_experts, ep), rank, group)
    from .eplb import initial_placement, nodes_of

    groups = num_groups if num_groups and num_experts % num_groups == 0 else 1
    placement = initial_placement(num_experts, num_redundant_experts, ep, groups, nodes_of(ep))
    return ExpertParallel(placement, rank, group)


# ----------------------------------------------------------------------------------------------------------------
# Launch under torchrun


@dataclass
class Launch:
    """This process's place in a torchrun launch: ``rank`` of ``world_size``, ``local_rank`` on its host, the torch
    ``device`` it computes on, and whether ``init_from_torchrun`` created the default process group (``close``
    destroys it then)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_group: bool

    def close(self, barrier: bool = False) -> None:
        """Destroys the default process group if this launch created it. Over NCCL, drop every LLM of the group
        (or its CUDA graphs: ``LLMEngine.drop_cuda_graphs``) first: destruction waits for captured collectives.
        ``barrier``: every rank reaches this point first (after a run that ended well on every rank), so no rank
        tears its connections down while another still finishes its last collective over them."""
        import torch.distributed as dist

        if self.owns_group and dist.is_initialized():
            if barrier:
                dist.barrier()
            dist.destroy_process_group()
            self.owns_group = False


def _env_int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except (KeyError, ValueError) as e:
        raise ParallelError(name, "an int set by torchrun", repr(env.get(name))) from e


def init_from_torchrun(
    ep: int | None,
    *,
    device_type: str,
    dist_backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    arg: str = "--ep",
    env: Mapping[str, str] | None = None,
) -> Launch | None:
    """Joins the default process group of a torchrun launch for expert parallelism over ``ep`` ranks.

    Outside torchrun (no ``WORLD_SIZE`` in ``env``, default ``os.environ``): None for ``ep`` None or 1, else
    ``ParallelError``. Under torchrun: ``ep`` None means ``WORLD_SIZE``, any other value must equal it
    (``ParallelError`` naming ``arg`` otherwise); a launch of one process returns None. Otherwise this process
    selects device ``LOCAL_RANK`` of ``device_type`` (not for ``cpu``), initialises the default group
    (``dist_backend``, the backend's ``BackendSpec.dist_backend``; None: torch's default for the device type) with
    ``timeout_s`` as the timeout of every collective, unless one is already initialised (it must then have
    ``WORLD_SIZE`` ranks), and returns its ``Launch``.
    """
    env = os.environ if env is None else env
    if "WORLD_SIZE" not in env:
        if ep in (None, 1):
            return None
        raise ParallelError(
            arg,
            f"a launch by torchrun --nproc-per-node {ep} (it sets WORLD_SIZE, RANK and MASTER_ADDR)",
            f"{arg} {ep} outside torchrun (WORLD_SIZE is not set)",
        )
    world = _env_int(env, "WORLD_SIZE")
    if ep is None:
        ep = world
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ParallelError(arg, "a positive int", repr(ep))
    if ep != world:
        raise ParallelError(arg, f"the number of processes torchrun started (WORLD_SIZE={world})", str(ep))
    if world == 1:
        return None
    _env_int(env, "RANK")  # init_process_group reads it; checked here for a clear error
    local_rank = _env_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
    if device_type == "cpu":
        device = torch.device("cpu")
    else:
        device = torch.device(device_type, local_rank)
        module = getattr(torch, device_type, None)
        if module is not None and hasattr(module, "set_device"):
            module.set_device(device)
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != world:
            raise ParallelError(
                "process group", f"WORLD_SIZE={world} ranks (torchrun's)", f"{dist.get_world_size()} ranks"
            )
        return Launch(dist.get_rank(), world, local_rank, device, owns_group=False)
    backend = dist_backend or dist.Backend.default_device_backend_map.get(device_type)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return Launch(dist.get_rank(), world, local_rank, device, owns_group=True)


# ----------------------------------------------------------------------------------------------------------------
# Keeping ranks in step


def fingerprint(*values: Any) -> int:
    """A 63-bit digest of ``values`` (ints, floats, strings, None and tuples or lists of them) that is the same in
    every process (unlike ``hash`` of a string)."""
    digest = hashlib.blake2b(repr(values).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


_host_groups: dict[Any, Any] = {}  # per process group whose collectives run on a device: its Gloo twin


def host_group(group: Any) -> Any | None:
    """A group over the ranks of ``group`` whose collectives run on the host: ``group`` itself if it is a Gloo group,
    else a Gloo group on the same ranks, in the same order, with the same timeout, made on the first call (every rank
    of ``group`` calls this at the same point, as it does any collective). None where torch has no Gloo."""
    import torch.distributed as dist

    if str(dist.get_backend(group)) == "gloo":
        return group
    if group not in _host_groups:
        if not dist.is_gloo_available():
            return None
        ranks = dist.get_process_group_ranks(group)
        _host_groups[group] = dist.new_group(
            ranks, timeout=_timeout(group), backend="gloo", use_local_synchronization=True, sort_ranks=False
        )
    return _host_groups[group]


def _timeout(group: Any) -> datetime.timedelta | None:
    """The timeout of ``group``'s collectives, or None (torch's default) where its backend does not show it."""
    for device in getattr(group, "_device_types", []):
        timeout = getattr(getattr(group._get_backend(device), "options", None), "_timeout", None)
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return None


class RankSync:
    """Small collectives that keep the ranks of an expert-parallel ``group`` in step, run on the host
    (``host_group``): they never wait for the device. Without Gloo they run over ``group`` itself, with tensors on
    ``device``. Every rank calls the same methods in the same order."""

    SLOTS = 3  # every check gathers (where, first value, second value): the same size whatever is checked

    def __init__(self, group: Any, device: torch.device):
        import torch.distributed as dist

        host = host_group(group)
        self.group = host if host is not None else group
        self.world = dist.get_world_size(self.group)
        self.src = dist.get_global_rank(self.group, 0)
        self.device = torch.device("cpu") if host is not None or device.type == "cpu" else device

    def broadcast_int(self, value: int) -> int:
        """Rank 0's ``value`` (a signed 64-bit int) on every rank."""
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.broadcast(t, self.src, group=self.group)
        return int(t.item())

    def min_int(self, value: int) -> int:
        """The smallest ``value`` of the ranks, on every rank."""
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def check(self, where: str, values: Mapping[str, Any]) -> None:
        """Raises ``RankDivergenceError`` on every rank unless every rank passed the same ``where`` and the same
        ``values`` (at most two, compared by ``fingerprint``). ``where`` says what the ranks are doing."""
        import torch.distributed as dist

        if len(values) > self.SLOTS - 1:
            raise ValueError(f"RankSync.check compares at most {self.SLOTS - 1} values, got {len(values)}")
        names = list(values)
        mine = [fingerprint(where)] + [fingerprint(values[n]) for n in names]
        mine += [0] * (self.SLOTS - len(mine))
        t = torch.tensor(mine, dtype=torch.int64, device=self.device)
        out = torch.empty(self.world * self.SLOTS, dtype=torch.int64, device=self.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, t, group=self.group)
        rows = out.view(self.world, self.SLOTS).tolist()
        bad = [r for r in range(1, self.world) if rows[r] != rows[0]]
        if not bad:
            return
        elsewhere = [r for r in bad if rows[r][0] != rows[0][0]]
        if elsewhere:
            me = dist.get_rank(self.group)
            what = f"rank(s) {elsewhere} are elsewhere than rank 0 (rank {me} is at {where})"
        else:
            diff = sorted({names[i - 1] for r in bad for i in range(1, len(names) + 1) if rows[r][i] != rows[0][i]})
            what = f"rank(s) {bad} differ from rank 0 in {', '.join(diff)} at {where}"
        raise RankDivergenceError(
            f"the ranks of the expert-parallel group diverged: {what}. Every rank must add the same requests in the "
            "same order with the same engine settings."
        )
