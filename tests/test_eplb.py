"""Expert-parallel load balancing in one process: the placement algorithm against hand-checked cases, a brute-force
oracle and its invariants (hypothesis), and the load the model measures against the routing recorded independently.
The multi-rank parts (weight moves, rebalancing while generating) are in ``test_eplb_distributed.py``."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer import InputError, ops
from deepinfer.model import LLM, SamplingParams
from deepinfer.model.eplb import (
    _pack,
    _replicate,
    hierarchical,
    initial_placement,
    nodes_of,
    phy2log_of,
    placement_of,
    rank_loads,
    rebalance_experts,
)
from deepinfer.model.errors import ParallelError, RequestError
from deepinfer.model.forward_batch import ForwardBatch
from deepinfer.model.moe import MoE
from deepinfer.model.parallel import check_ep
from deepinfer.ops.moe import ExpertPlacement

# ----------------------------------------------------------------------------------------------------------------
# Hand-checked cases (worked out in the comments)


def test_global_packing_without_redundancy():
    # loads 4 3 2 1 on 2 ranks: 4 -> r0, 3 -> r1, 2 -> r1 (3 < 4), 1 -> r0 (4 < 5): both ranks carry 5
    r = rebalance_experts(torch.tensor([[4.0, 3.0, 2.0, 1.0]]), 4, 1, 1, 2)
    assert r.phy2log.tolist() == [[0, 3, 1, 2]]
    assert r.logcnt.tolist() == [[1, 1, 1, 1]]
    assert r.log2phy.tolist() == [[[0], [2], [3], [1]]]


def test_global_replication_gives_extra_slots_to_the_highest_load_per_copy():
    # loads 12 2 2 2, 6 slots on 2 ranks (at most 2 copies each): expert 0 gets a copy (6 per copy), then expert 0
    # is at its cap and expert 1 (2, lowest index of the ties) gets one. Copies 6 6 | 1 1 | 2 | 2, heaviest first:
    # e0 -> r0, e0 -> r1 (r0 holds e0), e2 -> r0 (6 = 6: lower index), e3 -> r1, e1 -> r0 (8 = 8), e1 -> r1.
    r = rebalance_experts(torch.tensor([[12, 2, 2, 2]]), 6, 1, 1, 2)
    assert r.logcnt.tolist() == [[2, 2, 1, 1]]
    assert r.phy2log.tolist() == [[0, 1, 2, 0, 1, 3]]
    assert r.log2phy.tolist() == [[[0, 3], [1, 4], [2, -1], [5, -1]]]
    assert rank_loads(r.phy2log[0], [12, 2, 2, 2], 2) == [9.0, 9.0]


def test_hierarchical_packs_groups_to_nodes_then_replicates_within_nodes():
    # groups {0, 1} (load 3) and {2, 3} (load 13) over 2 nodes of 2 ranks, 2 slots per rank: the heavier group goes
    # to node 0. Node 0 holds experts 2 (10) and 3 (3) in 4 slots, at most 2 copies each: 2 -> 2 copies (5), then
    # 3 -> 2 copies (1.5); copies 5 5 1.5 1.5 -> r0: 2, r1: 2, r0: 3, r1: 3. Node 1 likewise with 1 (2) and 0 (1).
    r = rebalance_experts(torch.tensor([[1.0, 2.0, 10.0, 3.0]]), 8, 2, 2, 4)
    assert r.phy2log.tolist() == [[2, 3, 2, 3, 0, 1, 0, 1]]
    assert r.logcnt.tolist() == [[2, 2, 2, 2]]
    # the same load with groups that do not divide over the nodes: the global policy over 4 ranks
    g = rebalance_experts(torch.tensor([[1.0, 2.0, 10.0, 3.0]]), 8, 1, 2, 4)
    assert g.logcnt.tolist() == [[1, 1, 4, 2]]  # 10 -> 4 copies of 2.5 (cap 4 ranks), 3 -> 2 of 1.5
    assert hierarchical(2, 2) and not hierarchical(1, 2) and not hierarchical(4, 1) and not hierarchical(3, 2)


def test_packing_moves_an_item_when_only_holders_of_the_label_have_room():
    # weights 9 5 3 1 | 1 1 (label 2 twice), 3 per pack: 9 -> p0, 5 -> p1, 3 -> p1, 1 (label 0) -> p1 (8 < 9, p1
    # full), first label-2 copy -> p0, second: only p0 has room and holds label 2. Moving an item of p1 to p0:
    # 5 gives max(15, 5), 3 gives max(13, 7), 1 gives max(11, 9): the label-0 item moves, the copy takes its place.
    packs = _pack([1, 3, 1, 1, 9, 5], [0, 1, 2, 2, 3, 4], 2, 3)
    assert [sorted(p) for p in packs] == [[0, 2, 4], [1, 3, 5]]


def test_replication_is_optimal_against_brute_force():
    g = torch.Generator().manual_seed(5)
    for _ in range(40):
        n = int(torch.randint(1, 5, (1,), generator=g))
        cap = int(torch.randint(1, 4, (1,), generator=g))
        slots = int(torch.randint(n, n * cap + 1, (1,), generator=g))
        load = (torch.rand(n, generator=g) ** 3 * 50).tolist()
        counts = _replicate(load, slots, cap)
        assert sum(counts) == slots and all(1 <= c <= cap for c in counts)
        best = min(
            max(w / c for w, c in zip(load, cs))
            for cs in itertools.product(range(1, cap + 1), repeat=n)
            if sum(cs) == slots
        )
        assert max(w / c for w, c in zip(load, counts)) == pytest.approx(best)


# ----------------------------------------------------------------------------------------------------------------
# Invariants


@st.composite
def problems(draw):
    ranks = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    nodes = draw(st.sampled_from([d for d in range(1, ranks + 1) if ranks % d == 0]))
    groups = draw(st.sampled_from([1, 2, 4, 8]))
    experts = groups * draw(st.integers(1, 4))
    physical = ranks * draw(st.integers(-(-experts // ranks), experts))
    layers = draw(st.integers(1, 3))
    skew = draw(st.sampled_from([1.0, 3.0, 8.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    load = (torch.rand(layers, experts, generator=g) ** skew * 1000).round()
    if draw(st.booleans()):
        load[:, draw(st.integers(0, experts - 1))] += 5000  # one expert takes most of the tokens
    return load, physical, groups, nodes, ranks


@settings(max_examples=150, deadline=None)
@given(problems())
def test_invariants(problem):
    load, physical, groups, nodes, ranks = problem
    layers, experts = load.shape
    r = rebalance_experts(load, physical, groups, nodes, ranks)
    per, per_node = physical // ranks, ranks // nodes
    hier = hierarchical(groups, nodes) and physical <= experts * per_node
    assert r.phy2log.shape == (layers, physical) and r.phy2log.dtype == torch.int64
    for i in range(layers):
        row = r.phy2log[i].tolist()
        assert sorted(set(row)) == list(range(experts)), "every logical expert placed"
        slots = [row[k * per : (k + 1) * per] for k in range(ranks)]
        assert all(len(set(s)) == per for s in slots), "a rank holds an expert at most once"
        assert placement_of(row, ranks, experts).problem() is None
        assert r.logcnt[i].tolist() == [row.count(e) for e in range(experts)]
        for e in range(experts):
            held = [k for k in r.log2phy[i, e].tolist() if k >= 0]
            assert held == [k for k, x in enumerate(row) if x == e]
        w = load[i].double().tolist()
        loads = rank_loads(row, w, ranks)
        biggest_copy = max(w[e] / row.count(e) for e in range(experts))
        if hier:  # groups stay whole on one node; copies of an expert stay on its node
            node_of = [k // (per * per_node) for k in range(physical)]
            size = experts // groups
            for grp in range(groups):
                assert len({node_of[k] for k, x in enumerate(row) if x // size == grp}) == 1
            node_loads = [sum(loads[n * per_node : (n + 1) * per_node]) for n in range(nodes)]
            group_loads = [sum(w[grp * size : (grp + 1) * size]) for grp in range(groups)]
            assert max(node_loads) <= sum(node_loads) / nodes + max(group_loads) + 1e-6
            for n in range(nodes):
                mine = loads[n * per_node : (n + 1) * per_node]
                assert max(mine) <= sum(mine) / per_node + biggest_copy + 1e-6
        else:  # the stated bound: the heaviest rank exceeds the mean by less than one copy's load
            assert max(loads) <= sum(loads) / ranks + biggest_copy + 1e-6


@settings(max_examples=60, deadline=None)
@given(problems())
def test_previous_placement_keeps_experts_in_place(problem):
    load, physical, groups, nodes, ranks = problem
    first = rebalance_experts(load, physical, groups, nodes, ranks)
    again = rebalance_experts(load, physical, groups, nodes, ranks, previous=first.phy2log)
    assert torch.equal(again.phy2log, first.phy2log), "the same load re-placed moves nothing"
    other = load.flip(-1)
    fresh = rebalance_experts(other, physical, groups, nodes, ranks)
    kept = rebalance_experts(other, physical, groups, nodes, ranks, previous=first.phy2log)
    assert torch.equal(fresh.logcnt, kept.logcnt)
    per = physical // ranks

    def moved(new):
        return sum(
            len(set(new[i, k * per : (k + 1) * per].tolist()) - set(first.phy2log[i, k * per : (k + 1) * per].tolist()))
            for i in range(load.shape[0])
            for k in range(ranks)
        )

    assert moved(kept.phy2log) <= moved(fresh.phy2log)
    for i in range(load.shape[0]):  # the same per-rank loads up to the order of the ranks within a node
        a = sorted(rank_loads(kept.phy2log[i], other[i], ranks))
        b = sorted(rank_loads(fresh.phy2log[i], other[i], ranks))
        assert a == pytest.approx(b)


def test_redundancy_balances_a_skewed_load_better():
    g = torch.Generator().manual_seed(2)
    load = torch.rand(4, 32, generator=g) * 100
    load[:, 3] += 3000
    plain = rebalance_experts(load, 32, 4, 1, 4)
    spread = rebalance_experts(load, 40, 4, 1, 4)
    for i in range(4):
        a, b = rank_loads(plain.phy2log[i], load[i], 4), rank_loads(spread.phy2log[i], load[i], 4)
        assert max(b) < 0.6 * max(a)
        assert spread.logcnt[i, 3] == 4


def test_errors_name_the_argument():
    load = torch.ones(2, 8)
    cases = [
        (dict(load=torch.ones(8)), "load"),
        (dict(load=-load), "load"),
        (dict(num_physical=9), "num_physical"),
        (dict(num_physical=6), "num_physical"),
        (dict(num_physical=40), "num_physical"),
        (dict(num_groups=3), "num_groups"),
        (dict(num_nodes=3), "num_nodes"),
        (dict(num_ranks=0), "num_ranks"),
        (dict(previous=torch.zeros(2, 4, dtype=torch.int64)), "previous"),
    ]
    for kw, arg in cases:
        args = dict(load=load, num_physical=8, num_groups=2, num_nodes=1, num_ranks=4) | kw
        with pytest.raises(InputError) as err:
            rebalance_experts(**args)
        assert err.value.arg == arg, (kw, err.value)


def test_placement_helpers():
    assert initial_placement(8, 0, 2, 4, 1) == ExpertPlacement.contiguous(8, 2)
    p = initial_placement(8, 4, 4, 4, 2)
    assert [len(r) for r in p.local_experts] == [3] * 4 and p.problem() is None
    assert placement_of(phy2log_of(p), 4, 8) == p
    assert (
        nodes_of(8, {"LOCAL_WORLD_SIZE": "4"}) == 2
        and nodes_of(8, {}) == 1
        and nodes_of(6, {"LOCAL_WORLD_SIZE": "4"}) == 1
    )


def test_check_ep_redundant_experts():
    assert check_ep(2, 32, 2, num_redundant_experts=2) == 2
    assert check_ep(3, 32, 3, num_redundant_experts=4) == 3  # 36 slots: 3 does not divide 32, but divides 36
    cases = [
        ((1, 32, None), -1, "an int >= 0"),
        ((1, 32, None), 2, "0 without expert parallelism"),
        ((2, 32, 2), 1, "a multiple of ep=2"),
        ((2, 4, 2), 5, "at most 4"),
    ]
    for args, redundant, expected in cases:
        with pytest.raises(ParallelError) as err:
            check_ep(*args, num_redundant_experts=redundant)
        assert err.value.arg == "num_redundant_experts" and expected in err.value.expected, err.value


# ----------------------------------------------------------------------------------------------------------------
# Load measured by the model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from model_helpers import small_checkpoint

    return small_checkpoint(tmp_path_factory.mktemp("eplb"), seed=3)


ENGINE = dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=32, prefill_chunk_size=16)


def spy_routes(monkeypatch, names: tuple[str, ...] = ("moe_route",)) -> list[torch.Tensor]:
    """Records the expert ids of every call of the routing ops ``names``, in order."""
    calls: list[torch.Tensor] = []
    for name in names:
        route = getattr(ops, name)

        def spy(*args, _route=route, **kw):
            out = _route(*args, **kw)
            calls.append(out[1].clone())
            return out

        monkeypatch.setattr(ops, name, spy)
    return calls


def measured_and_routed(llm: LLM, calls: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Serves three prompts on ``llm`` (its load window 3 steps) and returns the load it measured and the tokens
    per expert of the routing ``calls`` recorded over its last 3 steps, ``[MoE layers, E]`` each."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, llm.config.vocab_size, (n,), generator=g).tolist() for n in (3, 20, 9)]
    llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    layers = len(llm.eplb.layers)
    assert len(calls) % layers == 0
    steps = len(calls) // layers
    assert steps == llm.engine.stats["steps"] == llm.eplb.steps > 3
    experts = llm.config.n_routed_experts
    counts = torch.stack([torch.bincount(c.flatten().long(), minlength=experts) for c in calls]).view(steps, layers, -1)
    return llm.expert_load(), counts[-3:].sum(0)


def test_expert_load_counts_the_routed_tokens_over_a_sliding_window(ckpt, monkeypatch):
    llm = LLM(ckpt, "reference", dtype="float32", progress=False, enable_eplb=True, eplb_window_size=3, **ENGINE)
    load, routed = measured_and_routed(llm, spy_routes(monkeypatch))
    assert len(llm.eplb.layers) == 2
    assert torch.equal(load, routed), "the last 3 steps"
    assert int(routed.sum()) > 0


def test_padding_rows_of_a_graph_batch_are_not_counted(ckpt, monkeypatch):
    llm = LLM(ckpt, "reference", dtype="float32", progress=False, enable_eplb=True, **ENGINE)
    calls = spy_routes(monkeypatch)
    moe = llm.eplb.layers[0]
    assert isinstance(moe, MoE)
    x = torch.randn(5, llm.config.hidden_size, generator=torch.Generator().manual_seed(1))
    batch = ForwardBatch(
        positions=torch.zeros(5, dtype=torch.int32),
        slot_mapping=torch.full((5,), -1),
        num_decode=5,
        seq_lens=torch.tensor([4, 0, 7, 0, 0], dtype=torch.int32),
    )
    moe.forward(x, batch)
    ids = calls[0]
    want = torch.bincount(ids[[0, 2]].flatten().long(), minlength=llm.config.n_routed_experts)
    assert torch.equal(llm.eplb.current[0], want)
    assert int(llm.eplb.current[1].sum()) == 0


def test_eplb_arguments(ckpt):
    llm = LLM(ckpt, "reference", dtype="float32", progress=False, **ENGINE)
    with pytest.raises(RequestError, match="enable_eplb=True"):
        llm.expert_load()
    bad = [
        (dict(enable_eplb=1), "enable_eplb"),
        (dict(eplb_window_size=0), "eplb_window_size"),
        (dict(eplb_step_interval=0), "eplb_step_interval"),
        (dict(enable_eplb=True, eplb_rebalance_layers_per_chunk=0), "eplb_rebalance_layers_per_chunk"),
        (dict(num_redundant_experts=2), "num_redundant_experts"),  # redundant copies need the balancer
    ]
    for kw, arg in bad:
        with pytest.raises(InputError) as err:
            LLM(ckpt, "reference", progress=False, **kw)
        assert err.value.arg == arg
    assert "enable_eplb" in err.value.expected
    with pytest.raises(ParallelError) as err:
        LLM(ckpt, "reference", progress=False, enable_eplb=True, num_redundant_experts=2)
    assert err.value.arg == "num_redundant_experts"
    with pytest.raises(RequestError, match="enable_eplb=True"):
        llm.rebalance_experts()


def test_rebalance_in_one_process_keeps_the_placement(ckpt):
    llm = LLM(ckpt, "reference", dtype="float32", progress=False, enable_eplb=True, eplb_step_interval=2, **ENGINE)
    before = llm.eplb.placements
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=5, ignore_eos=True))
    assert llm.eplb.rebalances >= 2 and llm.eplb.placements == before
    assert llm.rebalance_experts() is False and llm.eplb.placements == before


# ----------------------------------------------------------------------------------------------------------------
# Persistent dispatch tables (ExpertPlacement.table_slot)


class Slot:
    """A table slot: any object that takes weak references."""


def assert_tables_of(tab, placement: ExpertPlacement) -> None:
    """``tab`` holds ``placement``'s tables, checked against the placement's definition (``route``)."""
    experts, world = placement.num_experts, placement.world_size
    for e in range(experts):
        holders = placement.expert_ranks[e]
        assert int(tab.holders[e]) == len(holders)
        for src, token in itertools.product(range(world), range(2 * world)):
            copy = (src + token) % len(holders)
            rank, local = placement.route(e, src, token)
            assert (int(tab.rank[e, copy]), int(tab.local[e, copy])) == (rank, local)
    assert [t.tolist() for t in tab.global_ids] == [list(r) for r in placement.local_experts]


@pytest.mark.parametrize("experts, world, per", [(8, 4, 3), (10, 6, 2)])  # up to 4 copies of 4 ranks; 3 of 6
def test_placements_of_one_slot_share_tables_rewritten_in_place(experts, world, per):
    from deepinfer.ops.moe import load_placement_tables
    from deepinfer.reference.ep import placement_tables

    g = torch.Generator().manual_seed(5)
    slot = Slot()

    def random_placement() -> ExpertPlacement:
        ranks = [torch.randperm(experts, generator=g)[:per].tolist() for _ in range(world)]
        missing = sorted(set(range(experts)) - {e for r in ranks for e in r})
        for r, e in enumerate(missing):  # every expert held: replace an expert held elsewhere too
            victim = next(i for i, x in enumerate(ranks[r % world]) if sum(x in q for q in ranks) > 1)
            ranks[r % world][victim] = e
        return ExpertPlacement(experts, tuple(tuple(r) for r in ranks), table_slot=slot)

    first = random_placement()
    assert first.problem() is None
    captured = placement_tables(first, torch.device("cpu"))
    assert_tables_of(captured, first)
    ptrs = [t.data_ptr() for t in (captured.holders, captured.rank, captured.local, *captured.global_ids)]
    for _ in range(5):
        new = random_placement()
        assert new.problem() is None
        load_placement_tables(new, "cpu")
        assert_tables_of(captured, new)  # what a graph captured over the first placement reads now
        assert [t.data_ptr() for t in (captured.holders, captured.rank, captured.local, *captured.global_ids)] == ptrs
        assert placement_tables(new, torch.device("cpu")) is captured
    other = ExpertPlacement(experts, first.local_experts, table_slot=Slot())  # another slot: tables of its own
    assert placement_tables(other, torch.device("cpu")) is not captured
    assert new == ExpertPlacement(experts, new.local_experts) and repr(new) == repr(replace(new, table_slot=None))
    grown = tuple((*r, next(e for e in range(experts) if e not in r)) for r in first.local_experts)
    wider = ExpertPlacement(experts, grown, table_slot=slot)  # one more expert per rank: not this slot's shape
    assert wider.problem() is None
    with pytest.raises(InputError) as err:
        load_placement_tables(wider, "cpu")
    assert err.value.arg == "placement"
    with pytest.raises(InputError) as err:
        load_placement_tables(ExpertPlacement(experts, first.local_experts, table_slot=3), "cpu")
    assert err.value.arg == "placement" and "weak references" in err.value.expected


def test_dispatch_through_a_slot_follows_the_placement_loaded_last(deepinfer_backend, deepinfer_device):
    """One process, low-latency mode (which reads the tables): dispatching under a slot gives what the placement
    without a slot gives, after the slot was loaded with another placement."""
    import deepinfer

    with deepinfer.use(deepinfer_backend) as spec:
        _dispatch_through_a_slot(torch.device(deepinfer_device or spec.device_type), graphs=False)


def test_a_graph_captured_over_a_slot_replays_the_placement_loaded_last(deepinfer_backend, deepinfer_device):
    """On a CUDA device (skipped elsewhere): a graph captured dispatching over one placement of a slot, replayed
    after another placement was loaded into the slot, gives that placement's eager dispatch."""
    import deepinfer

    with deepinfer.use(deepinfer_backend) as spec:
        dev = torch.device(deepinfer_device or spec.device_type)
        if dev.type != "cuda" or not torch.cuda.is_available():
            pytest.skip(f"no CUDA graphs on {dev}")
        _dispatch_through_a_slot(dev, graphs=True)


def _dispatch_through_a_slot(dev: torch.device, graphs: bool) -> None:
    g = torch.Generator().manual_seed(6)
    experts, tokens, k, hidden = 8, 5, 2, 16
    x = torch.randn(tokens, hidden, generator=g).to(dev)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]).to(torch.int32).to(dev)
    weights = torch.rand(tokens, k, generator=g).to(dev)
    slot = Slot()
    orders = [tuple(torch.randperm(experts, generator=g).tolist()) for _ in range(3)]

    def dispatch(placement):
        recv, recv_ids, recv_w, layout, _ = ops.ep_dispatch(
            x, ids, weights, num_experts=experts, group=None, mode="low_latency", capacity=tokens, placement=placement
        )
        return recv, recv_ids, recv_w, layout.masked_m

    def same(a, b):  # the rows each local expert received (past masked_m, rows hold anything)
        if not torch.equal(a[3], b[3]):
            return False
        return all(torch.equal(p[e, :m], q[e, :m]) for e, m in enumerate(a[3].tolist()) for p, q in zip(a[:3], b[:3]))

    for order in orders:
        want = dispatch(ExpertPlacement(experts, (order,)))
        assert same(dispatch(ExpertPlacement(experts, (order,), table_slot=slot)), want)
    if not graphs:
        return
    import deepinfer
    from deepinfer.ops.moe import load_placement_tables

    fresh = Slot()
    first = ExpertPlacement(experts, (orders[0],), table_slot=fresh)
    last = ExpertPlacement(experts, (orders[1],), table_slot=fresh)
    with deepinfer.value_checks(False):  # as the engine captures: no host reads of values
        dispatch(first)  # warm-up outside the graph
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = dispatch(first)
    load_placement_tables(last, dev)
    graph.replay()
    torch.cuda.synchronize()
    assert same(out, dispatch(ExpertPlacement(experts, (orders[1],))))
    assert not same(out, dispatch(ExpertPlacement(experts, (orders[0],)))), "the two orders must differ"


def test_load_counted_inside_cuda_graphs_matches_eager(deepinfer_backend, deepinfer_device, tmp_path):
    """On a backend that replays CUDA graphs (skipped elsewhere): the load counted by graph-replayed decode steps,
    padding rows excluded, equals that of eager steps, in batch-invariant mode where both route alike."""
    import deepinfer
    from deepinfer import registry
    from deepinfer.model.tiny import TINY_CONFIG, write_checkpoint

    spec = registry.get().lookup(deepinfer_backend)
    if "cuda_graphs" not in spec.capabilities or not torch.cuda.is_available() or deepinfer_device == "cpu":
        pytest.skip(f"{deepinfer_backend} does not run CUDA graphs here")
    # the kernel shapes of test_model_cuda.py; written directly (model_helpers needs transformers for its oracles)
    path = write_checkpoint(tmp_path, TINY_CONFIG | dict(q_lora_rank=64, kv_lora_rank=512, qk_rope_head_dim=16), seed=1)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 258, (n,), generator=g).tolist() for n in (5, 40, 17, 1, 29)]  # bucket 8: padding
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    common = dict(block_size=16, max_num_seqs=8, progress=False, enable_eplb=True, eplb_window_size=10_000)
    out = {}
    with deepinfer.batch_invariant():
        for eager in (True, False):
            llm = LLM(path, deepinfer_backend, enforce_eager=eager, **common)
            assert (llm.engine.runner.graphs is None) == eager
            tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            out[eager] = (tokens, llm.expert_load())
    assert out[True][0] == out[False][0]
    assert int(out[True][1].sum()) > 0 and torch.equal(out[True][1], out[False][1])


def test_slot_tables_name_an_accelerator_by_its_index(monkeypatch):
    """``cuda`` and ``cuda:0`` are one device: a slot's buffers are found under either name (the engine loads tables
    on ``model.device``, which may carry no index, while dispatch looks them up on the inputs' indexed device)."""
    from deepinfer.reference import ep

    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    assert ep._indexed(torch.device("cuda")) == torch.device("cuda", 0)
    assert ep._indexed(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert ep._indexed(torch.device("cpu")) == torch.device("cpu")
