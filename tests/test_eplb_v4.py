"""Expert load balancing on DeepSeek-V4: the load its MoE layers measure (top-k and hash-routed) against the routing
recorded independently, and on 2 Gloo ranks on the CPU a rebalance mid-generation.

A tiny random V4 checkpoint is skewed so that every token picks expert ``HOT`` in every MoE layer: a large selection
bias in the top-k routed layers, ``tid2eid`` naming it first for every token in the hash-routed one. Served with
``ep=2``, 2 redundant experts and a rebalance every few steps (its routed experts fp32; packed FP4 in a copy; with
speculative decoding through a random MTP layer in another), every rank must give the greedy tokens of one process
serving without EPLB (log-probabilities within 1e-4, bitwise in batch-invariant mode), the placements must change
mid-generation (the hot expert gets a copy on both ranks in every layer, the hash-routed one included; the MTP layer
keeps its load-time placement), and every slot of every rank must then hold its expert's checkpoint weights.
The harness (``ep_harness.launch``) kills whatever is left, so a bug fails, never hangs.
"""

from __future__ import annotations

import json

import pytest
import torch
from ep_harness import launch
from model_helpers import one_thread  # noqa: F401 (autouse fixture)
from safetensors.torch import load_file, save_file
from test_eplb import measured_and_routed, spy_routes

import deepinfer
from deepinfer import FP4Tensor
from deepinfer.model import LLM, SamplingParams
from deepinfer.model.config_v4 import V4Checkpoint
from deepinfer.model.deepseek_v4 import DeepseekV4

HOT = 5  # the expert every token picks
ENGINE = dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=32, prefill_chunk_size=16)
LENGTHS = [3, 17, 9, 30, 6]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
INTERVAL = 4  # steps between rebalances
WORLD = 2


def skewed_v4_checkpoint(path):
    """A tiny random V4 checkpoint (``test_model_v4``'s ``plain``: one hash-routed and three top-k routed MoE layers)
    whose routing sends every token to expert ``HOT`` in every MoE layer."""
    from test_model_v4 import CONFIGS, v4_checkpoint

    v4_checkpoint(path, seed=9, **CONFIGS["plain"])
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    biased = [k for k in tensors if k.endswith("ffn.gate.bias")]
    hashed = [k for k in tensors if k.endswith("ffn.gate.tid2eid")]
    assert biased and hashed
    for k in biased:
        tensors[k][HOT] += 10.0  # sqrtsoftplus scores of these logits are about 1: selected first, whatever the token
    for k in hashed:
        table = tensors[k]
        table[table == HOT] = (HOT + 1) % 8  # the other slots name anything but HOT
        table[:, 0] = HOT
    save_file(tensors, str(file), metadata={"format": "pt"})
    return path


def fp4_copy(src, dst):
    """A copy of the checkpoint at ``src`` with its routed experts in packed FP4 (``test_model_v4``'s encoding), the
    rest as it is."""
    from test_model_v4 import _fp4_rows

    dst.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if ".ffn.experts." in name:
            out[name], out[name + "_scale_inv"] = _fp4_rows(w.float())
        else:
            out[name] = w
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = dict(quant_method="fp8", fmt="e4m3", weight_block_size=[128, 128], expert_dtype="fp4")
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def mtp_copy(src, dst):
    """A copy of the checkpoint at ``src`` with a random multi-token-prediction layer (``test_speculative_v4``)."""
    import shutil

    from test_speculative_v4 import add_mtp

    dst.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "config.json"):
        shutil.copy(src / name, dst / name)
    add_mtp(dst, seed=31)
    return dst


MTP = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}


def build(path, ep: int | None, **kw) -> LLM:
    return LLM(path, "reference", dtype="float32", progress=False, ep=ep, **(ENGINE | kw))


def run(llm: LLM, invariant: bool) -> dict:
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, llm.config.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]
    with deepinfer.batch_invariant(invariant):
        outs = llm.generate(prompts, PARAMS)
    return {"tokens": [o.outputs[0].token_ids for o in outs], "logprobs": [o.outputs[0].logprobs for o in outs]}


def _rows(w, i: int) -> list[torch.Tensor]:
    """Expert ``i`` of a stack as plain tensors (FP4: its packed data and scale bytes)."""
    if isinstance(w, FP4Tensor):
        return [w.data[i], w.scale[i].view(torch.uint8)]
    return [w[i]]


def wrong_slots(llm: LLM, path) -> tuple[int, list]:
    """``(slots checked, (layer, slot, expert) of those not holding their expert's checkpoint weights)`` over this
    rank's MoE layers (and its multi-token-prediction layers'), against the model loaded whole in one process."""
    mtp = bool(llm.model.mtp)
    with deepinfer.use("reference"):
        full = DeepseekV4.load(V4Checkpoint.open(path), dtype=torch.float32, mtp=mtp)
    mine, ref = llm.model.moe_layers(), full.moe_layers()
    if mtp:
        mine, ref = mine + [m.block[3] for m in llm.model.mtp], ref + [m.block[3] for m in full.mtp]
    checked, wrong = 0, []
    for layer, (ffn, want) in enumerate(zip(mine, ref)):
        assert type(ffn.w13) is type(want.w13)
        for slot, e in enumerate(ffn.ep.local):
            pairs = [*zip(_rows(ffn.w13, slot), _rows(want.w13, e)), *zip(_rows(ffn.w2, slot), _rows(want.w2, e))]
            if not all(torch.equal(a, b) for a, b in pairs):
                wrong.append((layer, slot, e))
            checked += 1
    return checked, wrong


def sc_generate(rank: int, world: int, path, fp4_path, mtp_path) -> dict:
    out = {}
    for name, ckpt, invariant, kw in VARIANTS:
        ckpt = {"fp32": path, "fp4": fp4_path, "mtp": mtp_path}[ckpt]
        llm = build(ckpt, world, enable_eplb=True, num_redundant_experts=2, eplb_step_interval=INTERVAL, **kw)
        initial = llm.eplb.placements
        got = run(llm, invariant)
        out[name] = {
            **got,
            "initial": [p.local_experts for p in initial],
            "final": [p.local_experts for p in llm.eplb.placements],
            "packed": isinstance(llm.model.moe_layers()[0].w13, FP4Tensor),
            "steps": llm.engine.stats["steps"],
            "rebalances": llm.eplb.rebalances,
            "moved": llm.eplb.moved,
            "slots": wrong_slots(llm, ckpt),
            "mtp_kept": [m.block[3].ep.placement == llm.ep.placement for m in llm.model.mtp],
            "drafted": llm.engine.spec_stats.drafted,
        }
    return out


# (name, checkpoint, batch-invariant, LLM arguments)
VARIANTS = [
    ("normal", "fp32", False, {}),
    ("invariant", "fp32", True, {}),
    ("fp4", "fp4", True, {}),
    ("mtp", "mtp", True, MTP),  # speculative decoding: the MTP layer keeps its load-time placement
]
SCENARIOS = {"generate": sc_generate}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    path = skewed_v4_checkpoint(tmp_path_factory.mktemp("v4-eplb"))
    fp4 = fp4_copy(path, tmp_path_factory.mktemp("v4-eplb-fp4"))
    return path, fp4, mtp_copy(path, tmp_path_factory.mktemp("v4-eplb-mtp"))


@pytest.fixture(scope="module")
def runs(ckpts):
    paths = dict(zip(("fp32", "fp4", "mtp"), ckpts))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = {name: run(build(paths[ckpt], None, **kw), invariant) for name, ckpt, invariant, kw in VARIANTS}
    finally:
        torch.set_num_threads(before)
    got = launch(__name__, WORLD, ["generate"], args=ckpts, pg_timeout_s=30.0, deadline_s=150.0)
    ranks = []
    for rank in range(WORLD):
        assert (rank, "generate") in got, f"rank {rank} never reported"
        err, payload, _ = got[(rank, "generate")]
        assert err is None, f"rank {rank}:\n{err}"
        ranks.append(payload)
    return one, ranks


def test_v4_rebalanced_mid_generation_gives_the_tokens_of_one_process_without_eplb(runs):
    one, ranks = runs
    for rank, out in enumerate(ranks):
        got, want = out["normal"], one["normal"]
        assert got["tokens"] == want["tokens"], f"rank {rank}"
        for a, b in zip(got["logprobs"], want["logprobs"]):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-4)
        for name in ("invariant", "fp4", "mtp"):
            assert out[name]["tokens"] == one[name]["tokens"], f"rank {rank}, {name}"
            assert out[name]["logprobs"] == one[name]["logprobs"], f"rank {rank}, {name}: not bitwise"
        assert out["fp4"]["packed"] and not out["normal"]["packed"]
    assert one["invariant"]["tokens"] == one["normal"]["tokens"]


@pytest.mark.parametrize("name", ["normal", "invariant", "fp4", "mtp"])
def test_v4_experts_are_re_placed_and_every_slot_holds_its_experts_weights(runs, name):
    _, ranks = runs
    out = ranks[0][name]
    assert all(r[name]["final"] == out["final"] for r in ranks), "the ranks agree on the placements"
    assert 2 <= out["rebalances"] <= out["steps"] // INTERVAL, "rebalanced while requests were running"
    assert sum(r[name]["moved"] for r in ranks) > 0
    assert len(out["final"]) == 4, "every MoE layer, the hash-routed one included"
    for initial, final in zip(out["initial"], out["final"]):
        assert sum(HOT in experts for experts in initial) == 1
        assert all(HOT in experts for experts in final), "the hot expert has a copy on every rank"
    mtp = name == "mtp"
    for rank, r in enumerate(ranks):
        assert r[name]["mtp_kept"] == ([True] if mtp else [])
        assert (r[name]["drafted"] > 0) == mtp
        checked, wrong = r[name]["slots"]
        assert checked == sum(len(experts[rank]) for experts in out["final"]) + mtp * len(out["initial"][0][rank])
        assert not wrong, f"rank {rank}: (layer, slot, expert) not holding the expert's weights: {wrong}"


def test_v4_expert_load_counts_the_routed_tokens_of_top_k_and_hash_layers(ckpts, monkeypatch):
    llm = build(ckpts[0], None, enable_eplb=True, eplb_window_size=3)
    load, routed = measured_and_routed(llm, spy_routes(monkeypatch, ("moe_route", "moe_route_hash")))
    assert len(llm.eplb.layers) == 4
    assert torch.equal(load, routed), "the last 3 steps"
    assert bool((load[:, HOT] * 2 == load.sum(1)).all()), "every token picks the hot expert, in every layer"
