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


def sc_generate(rank: int, world: int, path) -> dict:
    if world == 4:
        os.environ["LOCAL_WORLD_SIZE"] = "2"  # two "nodes" of two ranks: the hierarchical policy
    out: dict = {}
    for invariant in (False, True):
        out[f"plain_{invariant}"] = run(build(path, world), invariant)
        llm = build(path, world, enable_eplb=True, num_redundant_experts=world, eplb_step_interval=INTERVAL)
        initial = llm.eplb.placements
        out[f"eplb_{invariant}"] = run(llm, invariant)
        out[f"steps_{invariant}"] = llm.engine.stats["steps"]
        out[f"rebalances_{invariant}"] = llm.eplb.rebalances
        out[f"moved_{invariant}"] = llm.eplb.moved
    out["initial"] = initial
    out["final"] = llm.eplb.placements
    out["load"] = llm.expert_load().tolist()
    out["num_nodes"] = llm.eplb.num_nodes
    out["checked"] = check_expert_weights(llm, path)
    return out


class FakeGraphs:
    """Stands in for the decode CUDA graphs (never replayed: ``fits`` is false): records each capture, and fails the
    captures after the first on the last rank."""

    def __init__(self, rank: int, world: int, llm: LLM):
        self.rank, self.world, self.llm, self.captures = rank, world, llm, []

    def fits(self, n: int) -> bool:
        return False

    def capture(self) -> bool:
        self.captures.append([p.local_experts for p in self.llm.eplb.placements])
        self.llm.eplb.current[0, 0] += 10**6  # as a warm-up forward's counting would
        return not (self.rank == self.world - 1 and len(self.captures) > 1)


def sc_recapture(rank: int, world: int, path) -> dict:
    """After a rebalance that changes a placement the engine captures its graphs again, forgets what the capture
    counted, and keeps them only where every rank captured."""
    llm = build(path, world, enable_eplb=True, num_redundant_experts=world, eplb_step_interval=3)
    fake = FakeGraphs(rank, world, llm)
    llm.engine.runner.graphs = fake
    changes = []
    end_step = llm.eplb.end_step

    def spy() -> bool:
        changed = end_step()
        changes.append((changed, [p.local_experts for p in llm.eplb.placements]))
        return changed

    llm.eplb.end_step = spy
    llm.generate(prompts(llm.config.vocab_size), PARAMS)
    return {
        "changes": changes,
        "captures": fake.captures,
        "graphs_kept": llm.engine.runner.graphs is fake,
        "load": llm.expert_load().tolist(),  # plain data: a tensor in the queue can outlive its process
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


SCENARIOS = {"generate": sc_generate, "moves": sc_moves, "recapture": sc_recapture}


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
            assert rebalances == steps // INTERVAL >= 2
    assert all(out["final"] == got[0]["final"] and out["load"] == got[0]["load"] for out in got)
    assert sum(out["moved_False"] for out in got) > 0


def test_graphs_are_captured_again_after_a_rebalance(ranks):
    got = ranks(2, "recapture")
    for out in got:
        changed = [placements for c, placements in out["changes"] if c]
        assert len(changed) >= 2, "the test needs two rebalances that change a placement"
        # captured at the first change (with the new placements) and at the second, where the last rank failed:
        # no rank keeps its graphs, and none captures again
        assert out["captures"] == changed[:2]
        assert not out["graphs_kept"]
        assert max(max(row) for row in out["load"]) < 10**6, "what the captures counted was forgotten"
        assert out["changes"] == got[0]["changes"]


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
