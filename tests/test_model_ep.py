"""The model with its routed experts sharded over real multi-process Gloo groups on the CPU (2 and 4 ranks).

Each group is spawned once and plays several scenarios; every rank reports what it produced and the parent
compares it with one process holding every expert (computed here, in the test process): the same greedy and seeded
tokens, log-probabilities within fp32 noise, and bitwise the same ones in batch-invariant mode. Requests of
different lengths are prefilled in chunks next to decodes, under cache pressure (preemption), with the engine's
normal MoE dispatch and with decode steps forced to the low-latency dispatch CUDA-graph replays use. Each rank also
returns its expert weights, checked against its block of the full model. Diverging ranks, a dead rank and a hung
rank must surface as errors within the process group's timeout; the harness kills whatever is left, so a bug can
fail these tests but never hang the run. A group presented as one whose collectives run on a device (NCCL) must get
the engine's rank checks over a Gloo group on the same ranks. The command line runs under
``torch.distributed.run`` (torchrun).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ep_harness import launch

import deepinfer
from deepinfer import cli
from deepinfer.model import LLM, Checkpoint, DeepseekV3, SamplingParams
from deepinfer.model.errors import ParallelError, RankDivergenceError
from deepinfer.model.forward_batch import ForwardBatch
from deepinfer.model.moe import MoE
from deepinfer.model.parallel import check_ep, init_from_torchrun

CKPT_SEED = 7  # fixed: fp32 noise between one and several ranks can never flip a near-tie differently per run
PROMPT_LENGTHS = [1, 5, 13, 30, 47, 8]
ENGINE = dict(block_size=8, num_blocks=9, max_num_seqs=4, max_num_batched_tokens=32, prefill_chunk_size=16)
RUN_TIMEOUT_S = 30.0  # process-group timeout while the scenarios run: a desynchronised bug fails, never hangs
RUN_DEADLINE_S = 120.0  # the harness kills every rank after this long
FAULT_TIMEOUT_S = 3.0


# ----------------------------------------------------------------------------------------------------------------
# What every rank (and the one-process reference) runs


def build(path, ep: int | None, **kw) -> LLM:
    return LLM(path, "reference", dtype="float32", progress=False, ep=ep, **(ENGINE | kw))


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def params(seeded: bool = True) -> list[SamplingParams]:
    """Greedy and sampled requests (top-k / top-p on some), all asking for log-probabilities."""
    return [
        SamplingParams(
            max_tokens=12,
            temperature=0.0 if i % 2 else 0.9,
            top_p=0.9 if i % 3 == 2 else 1.0,
            top_k=8 if i % 4 == 0 else 0,
            seed=500 + i if seeded else None,
            ignore_eos=True,
            logprobs=0,
        )
        for i in range(len(PROMPT_LENGTHS))
    ]


def force_low_latency_decode(llm: LLM) -> list[int]:
    """Makes every decode-only step dispatch its experts in ``low_latency`` mode, as a replayed CUDA graph does;
    returns a list that counts those steps."""
    forward, used = llm.model.forward, []

    def patched(input_ids, batch, kv_caches, index_caches=None):
        if batch.cu_seqlens_q is None:
            batch.moe_mode = "low_latency"
            used.append(1)
        return forward(input_ids, batch, kv_caches, index_caches)

    llm.model.forward = patched
    return used


def generation(path, ep: int | None, variant: str) -> dict:
    """Tokens and log-probabilities of the prompts under ``variant``: ``normal`` (the engine as it is),
    ``invariant`` (batch-invariant mode) or ``low_latency`` (decode steps in low-latency mode)."""
    llm = build(path, ep)
    used = force_low_latency_decode(llm) if variant == "low_latency" else []
    with deepinfer.batch_invariant(variant == "invariant"):
        outs = llm.generate(prompts(llm.config.vocab_size), params())
    return {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "logprobs": [o.outputs[0].logprobs for o in outs],
        "preemptions": llm.engine.num_preemptions,
        "low_latency_steps": len(used),
        "decode_steps": llm.engine.stats["steps"],
    }


def mtp_checkpoint(path, name: str):
    """The module's checkpoint shape with a multi-token-prediction layer, written under ``name`` beside ``path``."""
    from model_helpers import small_checkpoint

    return small_checkpoint(Path(path).parent / name, seed=CKPT_SEED, num_nextn_predict_layers=1)


def speculative_generation(path, ep: int | None, spec: dict | None) -> dict:
    """Tokens and log-probabilities in batch-invariant mode, with speculative decoding ``spec`` (or none)."""
    llm = build(path, ep, speculative_config=spec)
    with deepinfer.batch_invariant():
        outs = llm.generate(prompts(llm.config.vocab_size), params())
    return {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "logprobs": [o.outputs[0].logprobs for o in outs],
        "drafted": llm.engine.spec_stats.drafted,
    }


def expert_weights(llm: LLM) -> list[tuple[tuple[int, ...], torch.Tensor, torch.Tensor]]:
    """Per MoE layer: the global ids of this rank's experts and their stacked weights."""
    return [(llm.ep.local, ffn.w13, ffn.w2) for *_, ffn in llm.model.layers if isinstance(ffn, MoE)]


# ----------------------------------------------------------------------------------------------------------------
# Scenarios (run on every rank; the same calls in the same order everywhere)


def sc_normal(rank: int, world: int, path) -> dict:
    return generation(path, world, "normal")


def sc_invariant(rank: int, world: int, path) -> dict:
    return generation(path, world, "invariant")


def sc_low_latency(rank: int, world: int, path) -> dict:
    return generation(path, world, "low_latency")


def sc_speculative(rank: int, world: int, path) -> dict:
    return speculative_generation(mtp_checkpoint(path, f"mtp-rank{rank}"), world, {"num_speculative_tokens": 2})


def sc_experts(rank: int, world: int, path) -> list:
    return expert_weights(build(path, world))


def sc_moe_layer(rank: int, world: int, path) -> None:
    """One MoE layer alone, both dispatch modes, batches smaller and larger than the group (some ranks get no token):
    bitwise the layer of one process holding every expert with batch-invariant ops."""
    sharded = build(path, world).model
    full = DeepseekV3.load(Checkpoint.open(path), dtype=torch.float32)
    layer = next(i for i, (*_, ffn) in enumerate(full.layers) if isinstance(ffn, MoE))
    g = torch.Generator().manual_seed(3)
    for tokens in (1, world - 1, world + 1, 9):
        x = torch.randn(tokens, full.cfg.hidden_size, generator=g)
        for mode in ("normal", "low_latency"):
            fb = ForwardBatch(positions=torch.zeros(tokens, dtype=torch.int32), slot_mapping=None, moe_mode=mode)
            with deepinfer.batch_invariant():
                got, want = sharded.layers[layer][3].forward(x, fb), full.layers[layer][3].forward(x, fb)
            assert got.shape == want.shape == x.shape
            assert torch.equal(got, want), (tokens, mode, (got - want).abs().max())


def sc_unseeded(rank: int, world: int, path) -> list:
    """Unseeded sampling: random per run, yet the same on every rank (compared by the parent)."""
    llm = build(path, world)
    outs = llm.generate(prompts(llm.config.vocab_size), params(seeded=False))
    return [o.outputs[0].token_ids for o in outs]


def sc_wrong_ep(rank: int, world: int, path) -> None:
    with pytest.raises(ParallelError) as err:
        build(path, 2 * world)
    assert err.value.arg == "ep" and f"({world} ranks)" in err.value.expected and err.value.actual == str(2 * world)


def sc_divergent_prompts(rank: int, world: int, path) -> None:
    """The last rank's second prompt differs in one token: every rank raises before the first forward."""
    llm = build(path, world)
    ps = prompts(llm.config.vocab_size)
    if rank == world - 1:
        ps[1][-1] = ps[1][-1] + 1
    with pytest.raises(RankDivergenceError, match="scheduled batch"):
        llm.generate(ps, params())
    assert llm.engine.stats["steps"] == 0


def sc_divergent_settings(rank: int, world: int, path) -> None:
    with pytest.raises(RankDivergenceError, match="engine settings"):
        build(path, world, max_num_seqs=4 + (rank == world - 1))


def sc_divergent_sampling(rank: int, world: int, path) -> None:
    """The last rank reads back a different token at one step (as numerics that differ per rank would make it): the
    next launch fails on every rank."""
    llm = build(path, world)
    runner = llm.engine.runner
    launch, calls = runner.launch, []

    def patched(batch, *args):
        step = launch(batch, *args)
        read = step.result

        def result():
            out = read()
            calls.append(1)
            if rank == world - 1 and len(calls) == 4:
                for sampled in out.sampled.values():
                    sampled[0].token = (sampled[0].token + 1) % llm.config.vocab_size
            return out

        step.result = result
        return step

    runner.launch = patched
    with pytest.raises(RankDivergenceError, match="sampled tokens"):
        llm.generate(prompts(llm.config.vocab_size), params())
    assert len(calls) == 4  # the next launch checks the tokens read back so far


def sc_device_group(rank: int, world: int, path) -> None:
    """Over a group whose collectives run on a device (here the Gloo group, reported as NCCL), the engine's rank
    checks run over a Gloo group on the same ranks with the group's timeout, made once: the same tokens as over the
    group itself, and a divergence still raises on every rank."""
    import torch.distributed as dist

    from deepinfer.model import parallel

    plain = generation(path, world, "normal")["tokens"]
    get_backend = dist.get_backend
    device_group = dist.group.WORLD
    dist.get_backend = lambda group=None: "nccl" if group is device_group else get_backend(group)
    try:
        llm = build(path, world)
        assert llm.ep.group is device_group
        sync = llm.engine.sync
        assert sync.group is not device_group and get_backend(sync.group) == "gloo"
        assert dist.get_process_group_ranks(sync.group) == dist.get_process_group_ranks(device_group)
        assert (
            parallel._timeout(sync.group).total_seconds()
            == RUN_TIMEOUT_S
            == parallel._timeout(device_group).total_seconds()
        )
        assert parallel.host_group(device_group) is sync.group
        assert [o.outputs[0].token_ids for o in llm.generate(prompts(llm.config.vocab_size), params())] == plain
        llm = build(path, world)
        assert llm.engine.sync.group is sync.group
        ps = prompts(llm.config.vocab_size)
        if rank == world - 1:
            ps[1][-1] = ps[1][-1] + 1
        with pytest.raises(RankDivergenceError, match="scheduled batch"):
            llm.generate(ps, params())
    finally:
        dist.get_backend = get_backend


def sc_dead_rank(rank: int, world: int, path) -> None:
    """The last rank exits without a word in the middle of a forward; the others generate."""
    llm = build(path, world)
    if rank == world - 1:
        ffn = next(ffn for *_, ffn in llm.model.layers if isinstance(ffn, MoE))
        ffn.forward = lambda x, batch: os._exit(3)
    llm.generate(prompts(llm.config.vocab_size), params())


def sc_hung_rank(rank: int, world: int, path) -> None:
    """The last rank stops answering at its third step; the others generate."""
    llm = build(path, world)
    if rank == world - 1:
        launch, calls = llm.engine.runner.launch, []

        def patched(batch, previous):
            calls.append(1)
            if len(calls) == 3:
                time.sleep(3600)
            return launch(batch, previous)

        llm.engine.runner.launch = patched
    llm.generate(prompts(llm.config.vocab_size), params())


SCENARIOS = {
    f.__name__.removeprefix("sc_"): f
    for f in (
        sc_normal,
        sc_invariant,
        sc_low_latency,
        sc_speculative,
        sc_experts,
        sc_moe_layer,
        sc_unseeded,
        sc_wrong_ep,
        sc_divergent_prompts,
        sc_divergent_settings,
        sc_divergent_sampling,
        sc_device_group,
    )
}
FAULTS = {"dead_rank": sc_dead_rank, "hung_rank": sc_hung_rank}


# ----------------------------------------------------------------------------------------------------------------
# Harness


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from model_helpers import small_checkpoint

    return small_checkpoint(tmp_path_factory.mktemp("ep"), seed=CKPT_SEED)


@pytest.fixture(scope="module")
def one_process(ckpt) -> dict:
    """The reference: one process holding every expert."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {v: generation(ckpt, None, v) for v in ("normal", "invariant", "low_latency")}
        out["experts"] = expert_weights(build(ckpt, None))
    finally:
        torch.set_num_threads(before)
    return out


# Scenarios each group size plays: every one with 2 ranks, the comparisons with the model with 4.
WORLDS = {2: list(SCENARIOS), 4: ["normal", "invariant", "low_latency", "experts", "moe_layer"]}


@pytest.fixture(scope="module")
def ranks(ckpt):
    """``ranks(world, scenario)``: every rank's payload of ``scenario``; each group size is spawned once."""
    runs: dict[int, dict] = {}

    def get(world: int, scenario: str) -> list:
        if world not in runs:
            runs[world] = launch(
                __name__, world, WORLDS[world], args=(ckpt,), pg_timeout_s=RUN_TIMEOUT_S, deadline_s=RUN_DEADLINE_S
            )
        got, out = runs[world], []
        for rank in range(world):
            if (rank, scenario) not in got:
                pytest.fail(f"rank {rank} of {world} never reported {scenario!r}")
            err, payload, _ = got[(rank, scenario)]
            assert err is None, f"rank {rank} of {world}:\n{err}"
            out.append(payload)
        return out

    return get


def assert_close_logprobs(got: list, want: list) -> None:
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g), torch.tensor(w), rtol=0, atol=1e-4)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("variant", ["normal", "low_latency"])
def test_same_tokens_as_one_process(ranks, one_process, world, variant):
    ref = one_process[variant]
    assert ref["preemptions"] > 0, "the cache is meant to be tight enough to preempt"
    if variant == "low_latency":
        assert ref["low_latency_steps"] > 0
    for rank, got in enumerate(ranks(world, variant)):
        assert got["tokens"] == ref["tokens"], f"rank {rank}"
        assert got["tokens"] == one_process["normal"]["tokens"], f"rank {rank}"
        assert_close_logprobs(got["logprobs"], ref["logprobs"])
        assert (got["preemptions"], got["low_latency_steps"]) == (ref["preemptions"], ref["low_latency_steps"])


def test_speculative_decoding_gives_one_process_tokens_without_it(ranks, ckpt):
    """The MTP layer's experts are sharded like the model's; drafting, verification and the checks across ranks
    run on every rank, and the tokens are bitwise those of one process without speculation."""
    ref = speculative_generation(mtp_checkpoint(ckpt, "mtp-one"), None, None)
    for rank, got in enumerate(ranks(2, "speculative")):
        assert got["drafted"] > 0, f"rank {rank}"
        assert (got["tokens"], got["logprobs"]) == (ref["tokens"], ref["logprobs"]), f"rank {rank}"


@pytest.mark.parametrize("world", WORLDS)
def test_bitwise_the_same_in_batch_invariant_mode(ranks, one_process, world):
    ref = one_process["invariant"]
    for rank, got in enumerate(ranks(world, "invariant")):
        assert got["tokens"] == ref["tokens"] and got["logprobs"] == ref["logprobs"], f"rank {rank}"


@pytest.mark.parametrize("world", WORLDS)
def test_each_rank_holds_its_block_of_experts(ranks, one_process, world):
    full = one_process["experts"]
    num_experts = full[0][1].shape[0]
    per = num_experts // world
    for rank, layers in enumerate(ranks(world, "experts")):
        assert len(layers) == len(full)
        mine = slice(rank * per, (rank + 1) * per)
        for (local, w13, w2), (_, f13, f2) in zip(layers, full):
            assert local == tuple(range(num_experts))[mine]
            assert torch.equal(w13, f13[mine]) and torch.equal(w2, f2[mine])


CHECKED_IN_RANKS = [
    "moe_layer",
    "wrong_ep",
    "divergent_prompts",
    "divergent_settings",
    "divergent_sampling",
    "device_group",
]


@pytest.mark.parametrize(
    ("world", "scenario"), [(w, name) for w, names in WORLDS.items() for name in names if name in CHECKED_IN_RANKS]
)
def test_scenario_passes_on_every_rank(ranks, world, scenario):
    ranks(world, scenario)


def test_unseeded_sampling_is_the_same_on_every_rank(ranks):
    got = ranks(2, "unseeded")
    assert all(tokens == got[0] for tokens in got)


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_surfaces_within_timeout(ckpt, fault):
    """A rank that dies or hangs while the others generate makes them fail within the group's timeout."""
    start = time.monotonic()
    got = launch(
        __name__, 2, [fault], args=(ckpt,), pg_timeout_s=FAULT_TIMEOUT_S, deadline_s=FAULT_TIMEOUT_S + 60, expect={0}
    )
    assert (0, fault) in got, f"rank 0 neither finished nor failed within {time.monotonic() - start:.0f} s"
    err, _, seconds = got[(0, fault)]
    assert err is not None, "generation succeeded without its peer"
    assert "RankDivergenceError" not in err and "ParallelError" not in err, err
    assert seconds < FAULT_TIMEOUT_S + 15, f"the error took {seconds:.1f} s"


# ----------------------------------------------------------------------------------------------------------------
# Set-up errors, in one process


def test_check_ep_names_argument_expected_and_actual():
    assert check_ep(None, 32, None) == 1 and check_ep(1, 32, None) == 1 and check_ep(4, 32, 4) == 4
    cases = [
        ((0, 32, None), "positive int", "0"),
        ((2, 32, None), "initialised torch.distributed process group of 2 ranks", "no process group"),
        ((2, 32, 4), "(4 ranks)", "2"),
        ((3, 32, 3), "a divisor of the model's 32 routed experts", "3"),
        ((3, 32, 3), "enable_eplb=True and num_redundant_experts 1, 4, ...", "3"),  # 33 slots: 11 per rank
        ((2, 0, 2), "without routed experts", "2"),
    ]
    for args, expected, actual in cases:
        with pytest.raises(ParallelError) as err:
            check_ep(*args)
        assert err.value.arg == "ep" and expected in err.value.expected and actual in err.value.actual, err.value


def test_llm_ep_without_process_group(ckpt):
    with pytest.raises(ParallelError, match=r"argument 'ep'.*process group of 2 ranks.*torchrun"):
        build(ckpt, 2)


def test_ep_group_that_is_not_a_process_group_is_named(ckpt):
    """Before any process group exists, and with one: a clear error about ``ep_group`` whatever ``ep`` is, and one
    saying so for a group this process is not in."""
    import torch.distributed as dist

    def refused(expected: str = "ProcessGroup", actual: str = "'group 1'", ep_group="group 1", **kw):
        with pytest.raises(ParallelError) as err:
            build(ckpt, ep_group=ep_group, **kw)
        assert err.value.arg == "ep_group" and expected in err.value.expected, err.value
        assert err.value.actual == actual

    refused(ep=2)
    refused(ep=None)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        refused(ep=1)
        refused(ep=None)
        # torch.distributed.new_group's answer on a rank outside the new group
        outside = dist.GroupMember.NON_GROUP_MEMBER
        refused("belongs to", "a group without it", ep=2, ep_group=outside)
    finally:
        dist.destroy_process_group()


def test_init_from_torchrun_environment_errors():
    assert init_from_torchrun(None, device_type="cpu", env={}) is None
    assert init_from_torchrun(1, device_type="cpu", env={"WORLD_SIZE": "1", "RANK": "0"}) is None
    with pytest.raises(ParallelError, match=r"argument '--ep'.*torchrun --nproc-per-node 2.*WORLD_SIZE is not set"):
        init_from_torchrun(2, device_type="cpu", env={})
    with pytest.raises(ParallelError, match=r"argument '--ep'.*WORLD_SIZE=4.*got 2"):
        init_from_torchrun(2, device_type="cpu", env={"WORLD_SIZE": "4", "RANK": "0"})


# ----------------------------------------------------------------------------------------------------------------
# The command line


def test_cli_reports_ep_outside_torchrun(ckpt, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cli.main(["generate", "--model", str(ckpt), "--ep", "2"]) == 2
    out = capsys.readouterr().out
    assert "'--ep'" in out and "torchrun --nproc-per-node 2" in out
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    assert cli.main(["generate", "--model", str(ckpt), "--ep", "2"]) == 2
    assert "WORLD_SIZE=3" in capsys.readouterr().out


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def completions(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("prompt ")]


def test_cli_under_torchrun_prints_the_tokens_of_one_process(ckpt, tmp_path, monkeypatch, capsys):
    batch = tmp_path / "prompts.txt"
    batch.write_text("\n".join(f"prompt {i}: {'x' * (7 * i)}" for i in range(5)) + "\n")
    argv = ["generate", "--model", str(ckpt), "--batch", str(batch), "--max-tokens", "8", "--dtype", "float32"]
    argv += ["--backend", "reference"]
    env = dict(os.environ, DEEPINFER_BATCH_INVARIANT="1", OMP_NUM_THREADS="1")
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    assert cli.main(argv) == 0
    want = completions(capsys.readouterr().out)
    assert len(want) == 5
    run = subprocess.run(
        [*TORCHRUN, "--nproc-per-node", "2", "-m", "deepinfer", *argv, "--ep", "2", "--dist-timeout", "30"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert completions(run.stdout) == want, run.stdout  # printed once (by rank 0), the same text
    assert "experts over 2 ranks" in run.stdout
