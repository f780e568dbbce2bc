"""Expert-parallel load balancing on real multi-process Gloo groups on the CPU (2 and 4 ranks).

A small random checkpoint whose routers are biased towards one expert (every token picks it: half of all routed
pairs with top-2) is served with redundant experts and a rebalance every few steps, so the placement changes
mid-generation while requests of different lengths are prefilled and decoded. Each rank reports its greedy tokens
and log-probabilities, which must equal those of the same group serving without redundancy (bitwise in
batch-invariant mode), checks after the run that every expert slot it holds carries that expert's checkpoint
weights, and reports its placements, what it received and the load it measured. With 4 ranks the launch spans two
"nodes" (``LOCAL_WORLD_SIZE=2``), so the hierarchical policy places the experts. ``move_experts`` alone is checked
on random placements with bf16 and FP8 weights, every slot against the weights of its expert.
"""

from __future__ import annotations

import os

import pytest
import torch
from ep_harness import launch
from safetensors.torch import load_file, save_file

import deepinfer
from deepinfer import QTensor
from deepinfer.model import LLM, Checkpoint, DeepseekV3, SamplingParams
from deepinfer.model.eplb import move_experts, phy2log_of, rank_loads
from deepinfer.model.moe import MoE
from deepinfer.ops.moe import ExpertPlacement

HOT = 5  # the expert every token picks
CKPT_SEED = 9
PROMPT_LENGTHS = [3, 17, 9, 30, 6]
ENGINE = dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=32, prefill_chunk_size=16)
INTERVAL = 4  # steps between rebalances
RUN_TIMEOUT_S = 30.0
RUN_DEADLINE_S = 150.0


def skewed_checkpoint(path):
    """A small random checkpoint whose router bias makes every token choose expert ``HOT`` in every MoE layer."""
    from model_helpers import small_checkpoint

    path = small_checkpoint(path, seed=CKPT_SEED)
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    biased = [k for k in tensors if k.endswith("mlp.gate.e_score_correction_bias")]
    assert biased
    for k in biased:
        tensors[k][HOT] += 2.0  # sigmoid scores are in (0, 1): selected first, whatever the token
    save_file(tensors, str(file), metadata={"format": "pt"})
    return path


# ----------------------------------------------------------------------------------------------------------------
# Scenarios (every rank)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


PARAMS = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, logprobs=0)


def build(path, world: int, **kw) -> LLM:
    return LLM(path, "reference", dtype="float32", progress=False, ep=world, **(ENGINE | kw))


def run(llm: LLM, invariant: bool) -> dict:
    with deepinfer.batch_invariant(invariant):
        outs = llm.generate(prompts(llm.config.vocab_size), PARAMS)
    return {"tokens": [o.outputs[0].token_ids for o in outs], "logprobs": [o.outputs[0].logprobs for o in outs]}


def check_expert_weights(llm: LLM, path) -> tuple[int, list]:
    """``(slots checked, (layer, slot, expert) of those not holding their expert's checkpoint weights)`` over every
    MoE layer of this rank."""
    full = DeepseekV3.load(Checkpoint.open(path), dtype=torch.float32)
    mine = [ffn for *_, ffn in llm.model.layers if isinstance(ffn, MoE)]
    ref = [ffn for *_, ffn in full.layers if isinstance(ffn, MoE)]
    checked, wrong = 0, []
    for layer, (ffn, want) in enumerate(zip(mine, ref)):
        for slot, e in enumerate(ffn.ep.local):
            if not (torch.equal(ffn.w13[slot], want.w13[e]) and torch.equal(ffn.w2[slot], want.w2[e])):
                wrong.append((layer, slot, e))
            checked += 1
    return checked, wrong


def spy_rebalancing(monkeypatch_target, llm: LLM) -> dict:
    """Records, while ``llm`` serves: the layers whose weights ``move_experts`` moves at each step, the threads
    ``rebalance_experts`` runs on (main or not), and every layer's placement after each step."""
    import threading

    from deepinfer.model import eplb as eplb_module

    seen: dict = {"moves": {}, "plan_threads": [], "placements": []}
    move, plan, end_step = eplb_module.move_experts, eplb_module.rebalance_experts, llm.eplb.end_step

    def spy_move(ffn, *args):
        step = llm.eplb.steps
        seen["moves"].setdefault(step, []).append(llm.eplb.layers.index(ffn))
        return move(ffn, *args)

    def spy_plan(*args, **kw):
        seen["plan_threads"].append(threading.current_thread() is threading.main_thread())
        return plan(*args, **kw)

    def spy_end_step():
        end_step()
        seen["placements"].append((llm.eplb.steps, [p.local_experts for p in llm.eplb.placements]))

    monkeypatch_target.setattr(eplb_module, "move_experts", spy_move)
    monkeypatch_target.setattr(eplb_module, "rebalance_experts", spy_plan)
    llm.eplb.end_step = spy_end_step
    return seen


class Patches:
    """A minimal monkeypatch for the rank processes: ``setattr`` now, ``undo`` restores."""

    def __init__(self):
        self.saved: list = []

    def setattr(self, target, name: str, value) -> None:
        self.saved.append((target, name, getattr(target, name)))
        setattr(target, name, value)

    def undo(self) -> None:
        for target, name, value in reversed(self.saved):
            setattr(target, name, value)
        self.saved.clear()


def table_state(llm: LLM) -> list:
    """Per MoE layer: the addresses of its dispatch tables now, and whether they hold its placement now (checked
    against ``ExpertPlacement.route``)."""
    from deepinfer.reference.ep import placement_tables

    out = []
    for ffn in llm.eplb.layers:
        p = ffn.ep.placement
        tab = placement_tables(p, llm.model.device)
        ptrs = [t.data_ptr() for t in (tab.holders, tab.rank, tab.local, *tab.global_ids)]
        ok = all(
            (int(tab.rank[e, (s + t) % int(tab.holders[e])]), int(tab.local[e, (s + t) % int(tab.holders[e])]))
            == p.route(e, s, t)
            for e in range(p.num_experts)
            for s in range(p.world_size)
            for t in range(p.world_size)
        )
        out.append((ptrs, ok and [x.tolist() for x in tab.global_ids] == [list(r) for r in p.local_experts]))
    return out


def sc_generate(rank: int, world: int, path) -> dict:
    if world == 4:
        os.environ["LOCAL_WORLD_SIZE"] = "2"  # two "nodes" of two ranks: the hierarchical policy
    out: dict = {}
    for invariant in (False, True):
        out[f"plain_{invariant}"] = run(build(path, world), invariant)
        llm = build(
            path,
            world,
            enable_eplb=True,
            num_redundant_experts=world,
            eplb_step_interval=INTERVAL,
            eplb_rebalance_layers_per_chunk=1,
        )
        initial = llm.eplb.placements
        tables_before = table_state(llm)
        patches = Patches()
        seen = spy_rebalancing(patches, llm)
        try:
            out[f"eplb_{invariant}"] = run(llm, invariant)
        finally:
            patches.undo()
        out[f"seen_{invariant}"] = seen
        out[f"tables_{invariant}"] = (tables_before, table_state(llm))
        out[f"steps_{invariant}"] = llm.engine.stats["steps"]
        out[f"rebalances_{invariant}"] = llm.eplb.rebalances
        out[f"moved_{invariant}"] = llm.eplb.moved
    out["initial"] = initial
    out["final"] = llm.eplb.placements
    out["load"] = llm.expert_load().tolist()
    out["num_nodes"] = llm.eplb.num_nodes
    out["checked"] = check_expert_weights(llm, path)
    out["rebalanced_now"] = llm.rebalance_experts()  # at once, from the whole window's load
    out["after_now"] = (llm.eplb.placements, table_state(llm), not llm.eplb.in_progress)
    out["checked_after"] = check_expert_weights(llm, path)
    return out


def sc_failed_plan(rank: int, world: int, path) -> dict:
    """Computing the placement fails on the last rank only: every rank must drop those rebalances at the same
    steps and keep serving (no rank waits for a plan the failing rank never sends)."""
    from deepinfer.model import eplb as eplb_module

    plain = run(build(path, world), False)
    llm = build(path, world, enable_eplb=True, num_redundant_experts=world, eplb_step_interval=INTERVAL)
    initial = llm.eplb.placements
    patches = Patches()
    if rank == world - 1:

        def broken(*args, **kw):
            raise RuntimeError("planted failure")

        patches.setattr(eplb_module, "rebalance_experts", broken)
    try:
        out = run(llm, False)
    finally:
        patches.undo()
    return {
        "same_tokens": out["tokens"] == plain["tokens"],
        "failed": llm.eplb.failed,
        "rebalances": llm.eplb.rebalances,
        "unchanged": llm.eplb.placements == initial,
    }


def _stack(n: int, rows: int, cols: int, fp8: bool, experts: list[int]):
    """Stacked weights of ``experts``, each derived from its own id alone."""
    parts = [torch.randn(rows, cols, generator=torch.Generator().manual_seed(1000 + e)) for e in experts]
    w = torch.stack(parts) if parts else torch.zeros(0, rows, cols)
    if not fp8:
        return w.bfloat16()
    scale = w.abs().amax(dim=(-1,), keepdim=True).clamp_min(1e-6) / 448.0
    data = (w / scale).to(torch.float8_e4m3fn)
    return QTensor(data, scale.expand(-1, -1, 1).contiguous(), (1, cols), "fp32")


class FakeLayer:
    def __init__(self, experts: list[int], fp8: bool):
        self.w13 = _stack(len(experts), 8, 128, fp8, experts)
        self.w2 = _stack(len(experts), 4, 128, False, experts)


def random_placement(g: torch.Generator, experts: int, world: int, per: int) -> ExpertPlacement:
    """Each expert once, then extra copies on ranks lacking them, shuffled within each rank."""
    ranks: list[list[int]] = [[] for _ in range(world)]
    order = torch.randperm(experts, generator=g).tolist()
    for i, e in enumerate(order):
        ranks[i % world].append(e)
    for r in range(world):
        spare = [e for e in torch.randperm(experts, generator=g).tolist() if e not in ranks[r]]
        ranks[r] += spare[: per - len(ranks[r])]
        ranks[r] = [ranks[r][i] for i in torch.randperm(per, generator=g).tolist()]
    return ExpertPlacement(experts, tuple(tuple(r) for r in ranks))


def sc_moves(rank: int, world: int) -> list[int]:
    g = torch.Generator().manual_seed(21)
    received = []
    for trial in range(6):
        experts, per = 6, 3 + trial % 2
        old = random_placement(g, experts, world, per)
        new = random_placement(g, experts, world, per)
        fp8 = trial % 2 == 1
        layer = FakeLayer(list(old.local_experts[rank]), fp8)
        got = move_experts(layer, old, new, rank, torch.distributed.group.WORLD)
        want = FakeLayer(list(new.local_experts[rank]), fp8)
        for a, b in ((layer.w13, want.w13), (layer.w2, want.w2)):
            if isinstance(a, QTensor):
                assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)
            else:
                assert torch.equal(a, b), (trial, rank)
        assert got == len(set(new.local_experts[rank]) - set(old.local_experts[rank]))
        received.append(got)
    return received


DIFFERING_SETTINGS = {  # per case, the last rank's load balancing settings; the others use the first entry's
    "same": dict(enable_eplb=True, num_redundant_experts=2, eplb_step_interval=INTERVAL),
    "enable_eplb": dict(enable_eplb=False, eplb_step_interval=INTERVAL),
    "eplb_step_interval": dict(enable_eplb=True, num_redundant_experts=2, eplb_step_interval=INTERVAL + 1),
    "eplb_window_size": dict(
        enable_eplb=True, num_redundant_experts=2, eplb_step_interval=INTERVAL, eplb_window_size=3
    ),
    "eplb_rebalance_layers_per_chunk": dict(
        enable_eplb=True, num_redundant_experts=2, eplb_step_interval=INTERVAL, eplb_rebalance_layers_per_chunk=None
    ),
}


def sc_divergent_settings(rank: int, world: int, path) -> dict:
    """The last rank builds the LLM with one load balancing setting unlike the others' (which decide at which steps
    the balancer's collectives run): every rank raises at construction, before any step could wait on a peer."""
    from deepinfer.model.errors import RankDivergenceError

    out = {}
    for case, theirs in DIFFERING_SETTINGS.items():
        kw = theirs if rank == world - 1 else DIFFERING_SETTINGS["same"]
        try:
            build(path, world, **kw)
            out[case] = "built"
        except RankDivergenceError as e:
            out[case] = str(e)
    return out


SCENARIOS = {
    "generate": sc_generate,
    "moves": sc_moves,
    "failed_plan": sc_failed_plan,
    "divergent_settings": sc_divergent_settings,
}


# ----------------------------------------------------------------------------------------------------------------
# Harness


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return skewed_checkpoint(tmp_path_factory.mktemp("eplb_ep"))


@pytest.fixture(scope="module")
def ranks(ckpt):
    runs: dict[tuple[int, str], dict] = {}

    def get(world: int, scenario: str) -> list:
        if (world, scenario) not in runs:
            args = () if scenario == "moves" else (ckpt,)
            runs[(world, scenario)] = launch(
                __name__, world, [scenario], args=args, pg_timeout_s=RUN_TIMEOUT_S, deadline_s=RUN_DEADLINE_S
            )
        got, out = runs[(world, scenario)], []
        for rank in range(world):
            if (rank, scenario) not in got:
                pytest.fail(f"rank {rank} of {world} never reported {scenario!r}")
            err, payload, _ = got[(rank, scenario)]
            assert err is None, f"rank {rank} of {world}:\n{err}"
            out.append(payload)
        return out

    return get


@pytest.mark.parametrize("world", [2, 4])
def test_move_experts_puts_every_expert_in_its_new_slots(ranks, world):
    got = ranks(world, "moves")
    assert sum(sum(r) for r in got) > 0


@pytest.mark.parametrize("world", [2, 4])
def test_rebalancing_mid_generation_keeps_greedy_outputs(ranks, world):
    got = ranks(world, "generate")
    for rank, out in enumerate(got):
        plain, eplb = out["plain_False"], out["eplb_False"]
        assert eplb["tokens"] == plain["tokens"], f"rank {rank}"
        for a, b in zip(eplb["logprobs"], plain["logprobs"]):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-4)
        assert out["eplb_True"] == out["plain_True"], f"rank {rank}: batch-invariant outputs differ bitwise"
        assert out["plain_True"]["tokens"] == plain["tokens"]
        for invariant in (False, True):  # rebalanced while requests were running, not only at the end
            steps, rebalances = out[f"steps_{invariant}"], out[f"rebalances_{invariant}"]
            assert 2 <= rebalances <= steps // INTERVAL
    assert all(out["final"] == got[0]["final"] and out["load"] == got[0]["load"] for out in got)
    assert sum(out["moved_False"] for out in got) > 0


@pytest.mark.parametrize("world", [2, 4])
def test_a_rebalance_is_spread_over_steps_and_ranks_switch_together(ranks, world):
    got = ranks(world, "generate")
    for rank, out in enumerate(got):
        for invariant in (False, True):
            seen = out[f"seen_{invariant}"]
            moves = {int(step): layers for step, layers in seen["moves"].items()}
            assert moves, "the test needs a rebalance that moves weights"
            assert all(len(layers) == 1 for layers in moves.values()), f"rank {rank}: one layer per step: {moves}"
            # a rebalance that changes both MoE layers switches them at two different steps
            assert any(moves.get(step) == [0] and moves.get(step + 1) == [1] for step in moves), moves
            assert seen["plan_threads"] and not any(seen["plan_threads"]), "placements computed off the main thread"
            assert seen["placements"] == got[0][f"seen_{invariant}"]["placements"], f"rank {rank} switched apart"
            assert seen["moves"] == got[0][f"seen_{invariant}"]["moves"]
            before, after = out[f"tables_{invariant}"]
            assert [ptrs for ptrs, _ in after] == [ptrs for ptrs, _ in before], "tables rewritten in place"
            assert all(ok for _, ok in before + after), "each layer's tables hold its placement"
            # between the steps of one rebalance the two layers were on different placements' generations
            changes = [
                (step, i)
                for (step, now), (_, prev) in zip(seen["placements"][1:], seen["placements"])
                for i in range(len(now))
                if now[i] != prev[i]
            ]
            assert {step for step, _ in changes} == set(moves), (changes, moves)


def test_a_placement_that_fails_on_one_rank_drops_the_rebalance_on_every_rank(ranks):
    got = ranks(2, "failed_plan")
    assert all(out["failed"] >= 1 and out["failed"] == got[0]["failed"] for out in got), got
    assert all(out["rebalances"] == 0 and out["unchanged"] and out["same_tokens"] for out in got), got


@pytest.mark.parametrize("world", [2, 4])
def test_rebalanced_placement_spreads_the_hot_expert(ranks, world):
    got = ranks(world, "generate")
    out = got[0]
    load = torch.tensor(out["load"])
    assert load.shape[1] == 32
    # every token picks the hot expert: it takes one in top_k (2) of the routed pairs
    assert bool((load[:, HOT] * 2 == load.sum(1)).all()), load[:, HOT]
    nodes = out["num_nodes"]
    assert nodes == (2 if world == 4 else 1)
    for initial, final, row in zip(out["initial"], out["final"], load):
        holders = final.expert_ranks[HOT]
        assert len(holders) == world // nodes, "as many copies as a node has ranks"
        before = rank_loads(phy2log_of(initial), row, world)
        after = rank_loads(phy2log_of(final), row, world)
        assert max(after) < max(before), (before, after)
        mean = sum(after) / world
        if nodes == 1:
            assert max(after) <= mean + float(row[HOT]) / len(holders) + 1e-6
    for rank, payload in enumerate(got):  # each rank checked its own slots against the checkpoint
        checked, wrong = payload["checked"]
        assert not wrong, f"rank {rank}: (layer, slot, expert) not holding the expert's weights: {wrong}"
        assert checked == sum(len(p.local_experts[rank]) for p in out["final"])
        placements, tables, done = payload["after_now"]
        assert done and placements == got[0]["after_now"][0] and all(ok for _, ok in tables)
        assert not payload["checked_after"][1], f"rank {rank}: (layer, slot, expert) wrong after rebalance_experts()"


def test_ranks_with_different_load_balancing_settings_raise_at_construction(ranks):
    for rank, out in enumerate(ranks(2, "divergent_settings")):
        assert out.pop("same") == "built", f"rank {rank}"
        for case, message in out.items():
            assert "expert load balancing settings" in message and "engine start" in message, (rank, case, message)
