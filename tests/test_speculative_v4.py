"""Speculative decoding on DeepSeek-V4 (``model/speculative.py``, ``mtp.V4MTPLayer``).

The MTP layer against an oracle made of transformers' own V4 decoder block: transformers' ``DeepseekV4`` defines no
MTP layer, so the test builds it as DeepSeek's checkpoints lay it out (``config_v4.mtp_layout``) from a one-layer
``DeepseekV4ForCausalLM`` holding the MTP block, whose input streams are replaced by ``h_proj(hnorm(S)) +
e_proj(enorm(embed(t)))`` of the main oracle's final streams ``S``; planted bugs fail that comparison. Then the
engine: every token and log-probability is the one the request takes without speculation (bitwise, batch-invariant
mode), with the checkpoint's drafts (mostly rejected on a random model) and with drafts taken from a run without
speculation and spoiled at random places (mostly accepted), so both branches of verification run; preemption in
the middle of speculation and prefix-cache hits lose nothing; a rejected draft's cache writes need no undoing.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import test_model_v4 as v4
import torch
from model_helpers import one_thread  # noqa: F401 (autouse fixture)
from safetensors.torch import load_file, save_file
from test_speculative import invariant, requests, result  # noqa: F401 (invariant: a fixture)
from transformers import DeepseekV4ForCausalLM

import deepinfer
from deepinfer.model import LLM, SamplingParams
from deepinfer.model.config_v4 import V4Checkpoint, mtp_layout
from deepinfer.model.deepseek_v4 import DeepseekV4
from deepinfer.model.errors import CheckpointError
from deepinfer.model.speculative import MTPDrafter
from deepinfer.selection import use

TOL = 1e-3
MTP_TYPES = {"plain": v4.SLIDING, "yarn": v4.CSA}  # the MTP layer's attention: a window, or compressed sparse


def add_mtp(path, seed: int, mtp_type: str = v4.SLIDING) -> None:
    """Writes a random MTP layer (DeepSeek's names, ``mtp.0.*``) into the transformers checkpoint at ``path``, of
    attention type ``mtp_type`` (listed after the model's layers in ``layer_types``, as DeepSeek's
    ``compress_ratios`` list it)."""
    file = path / "config.json"
    raw = json.loads(file.read_text())
    raw["layer_types"] = [*raw["layer_types"][: raw["num_hidden_layers"]], mtp_type]
    file.write_text(json.dumps(raw))
    cfg = V4Checkpoint.open(path).config
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(path / "model.safetensors")
    for name, (shape, _) in mtp_layout(cfg).items():
        noise = torch.randn(shape, generator=g)
        if name.endswith("norm.weight"):
            t = 1 + 0.2 * noise
        elif name.endswith(("attn_sink", "ape", "_base")):
            t = noise
        elif name.endswith("_scale"):
            t = 1 + 0.3 * noise
        elif name.endswith("gate.bias"):
            t = 0.1 * noise
        else:
            t = noise / math.sqrt(shape[-1])
        tensors[name] = t.contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(name: str):
        if name not in made:
            path = tmp_path_factory.mktemp(f"v4-mtp-{name}")
            oracle = v4.v4_checkpoint(path, seed=len(made) + 21, **v4.CONFIGS[name])
            add_mtp(path, seed=len(made) + 31, mtp_type=MTP_TYPES[name])
            made[name] = (path, oracle)
        return made[name]

    return get


def mtp_oracle(path, oracle, tmp_path) -> DeepseekV4ForCausalLM:
    """The MTP layer's block as transformers builds a V4 decoder block: a one-layer ``DeepseekV4ForCausalLM`` of
    the MTP block, the MTP layer's final norm and ``hc_head``, and the model's embedding and head."""
    raw = json.loads((path / "config.json").read_text())
    n = raw["num_hidden_layers"]
    raw |= {"num_hidden_layers": 1, "layer_types": [raw["layer_types"][n]], "mlp_layer_types": ["moe"]}
    tensors = load_file(path / "model.safetensors")
    out = {k: tensors[k] for k in ("model.embed_tokens.weight", "head.weight")}
    own = {"norm.weight": "model.norm.weight"} | {
        f"hc_head_{k}": f"model.hc_head.hc_{k}" for k in ("fn", "base", "scale")
    }
    for name, t in tensors.items():
        if name.startswith("mtp.0."):
            rest = name.removeprefix("mtp.0.")
            if rest in own:
                out[own[rest]] = t
            elif rest not in ("enorm.weight", "hnorm.weight", "e_proj.weight", "h_proj.weight"):
                out["model.layers.0." + rest] = t
    (tmp_path / "config.json").write_text(json.dumps(raw))
    save_file(out, tmp_path / "model.safetensors", metadata={"format": "pt"})
    return DeepseekV4ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@torch.no_grad()
def oracle_mtp_logprobs(path, oracle, block, ids: list[int]) -> torch.Tensor:
    """Log-probabilities of the MTP layer's prediction of token ``i + 2`` at every position ``i < len(ids) - 1``."""
    seen = {}
    hook = oracle.model.hc_head.register_forward_hook(lambda mod, args, out: seen.setdefault("streams", args[0]))
    oracle(torch.tensor([ids]))
    hook.remove()
    streams = seen["streams"][:, :-1]  # [1, T - 1, hc, H]
    w = {
        k.removeprefix("mtp.0."): v for k, v in load_file(path / "model.safetensors").items() if k.startswith("mtp.0.")
    }
    eps = oracle.config.rms_norm_eps
    e = rms(oracle.model.embed_tokens(torch.tensor([ids[1:]])), w["enorm.weight"], eps) @ w["e_proj.weight"].T
    x = rms(streams, w["hnorm.weight"], eps) @ w["h_proj.weight"].T + e[:, :, None]
    hook = block.model.layers[0].register_forward_pre_hook(lambda mod, args: (x, *args[1:]))
    logits = block(torch.tensor([ids[1:]])).logits[0]
    hook.remove()
    return torch.log_softmax(logits.float(), -1)


def our_mtp_logprobs(model: DeepseekV4, ids: list[int]) -> torch.Tensor:
    st = model.new_state()
    x = torch.tensor(ids, device=model.device)
    batch = model.batch([st], x, [len(ids)])
    streams = model.forward(x, batch)
    st.length = 0  # the MTP layer runs at the same positions (it does not advance the state)
    state = model.mtp[0].forward(streams[:-1], x[1:], model.batch([st], x[1:], [len(ids) - 1]), None)
    return torch.log_softmax(model.mtp[0].compute_logits(state), -1).cpu()


def load(path, backend, device) -> DeepseekV4:
    with use(backend):
        model = DeepseekV4.load(V4Checkpoint.open(path), dtype=torch.float32, device=device or "cpu", mtp=True)
    model.use_pages(8, mtp_layers=1)
    return model


@pytest.mark.parametrize("name", ["plain", "yarn"])
def test_mtp_layer_matches_transformers_block(name, checkpoints, deepinfer_backend, deepinfer_device, tmp_path):
    """The MTP layer of a window (``plain``) and of a compressed sparse (``yarn``) attention type: its predictions
    at every position of prompts longer than the window and several compressor windows, against the oracle."""
    path, oracle = checkpoints(name)
    block = mtp_oracle(path, oracle, tmp_path)
    model = load(path, deepinfer_backend, deepinfer_device)
    assert len(model.mtp) == 1 and model.mtp[0].block[1].kind == MTP_TYPES[name]
    with use(deepinfer_backend):
        for ids in v4.prompts(5)[1:]:
            ref, got = oracle_mtp_logprobs(path, oracle, block, ids), our_mtp_logprobs(model, ids)
            assert (got - ref).abs().max().item() < TOL


@pytest.mark.parametrize("bug", ["hnorm", "e_proj", "hc_head"])
def test_planted_mtp_bugs_fail_the_comparison(bug, checkpoints, deepinfer_backend, tmp_path):
    path, oracle = checkpoints("plain")
    block = mtp_oracle(path, oracle, tmp_path)
    model = load(path, deepinfer_backend, None)
    layer = model.mtp[0]
    if bug == "hnorm":
        layer.hnorm = torch.ones_like(layer.hnorm)
    elif bug == "e_proj":
        layer.e_proj, layer.h_proj = layer.h_proj, layer.e_proj
    else:
        layer.hc_head = model.hc_head  # the model's own instead of the layer's
    ids = v4.prompts(5)[2]
    with use(deepinfer_backend):
        err = (our_mtp_logprobs(model, ids) - oracle_mtp_logprobs(path, oracle, block, ids)).abs().max().item()
    assert err > 100 * TOL


def test_mtp_checkpoints_are_checked(checkpoints, tmp_path):
    """MTP tensors are all there or none; a partial set is refused before anything is read."""
    path, _ = checkpoints("plain")
    assert len(V4Checkpoint.open(path).mtp_keys) == len(mtp_layout(V4Checkpoint.open(path).config))
    tensors = load_file(path / "model.safetensors")
    del tensors["mtp.0.h_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"mtp\.0\.h_proj\.weight"):
        V4Checkpoint.open(tmp_path)
    tensors = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    save_file(tensors, tmp_path / "model.safetensors")
    assert V4Checkpoint.open(tmp_path).mtp_keys == []
    with pytest.raises(deepinfer.InputError, match=r"mtp\.0"):
        LLM(tmp_path, progress=False, speculative_config={"num_speculative_tokens": 1})


@pytest.mark.parametrize("name", ["plain", "yarn"])
def test_rejected_drafts_need_no_undoing(name, checkpoints, deepinfer_backend, deepinfer_device):
    """Caches with room for 3 drafts: a step of the last token and 3 drafts, the first ``a`` right and the rest
    wrong, the sequence kept up to the right ones, then the rest of the text: the logits of a run that never saw a
    wrong draft, at every ``a``."""
    path, _ = checkpoints(name)
    model = load(path, deepinfer_backend, deepinfer_device)
    model.use_pages(8, mtp_layers=1, drafts=3)
    ids = v4.prompts(9)[3] + v4.prompts(10)[4]
    g = torch.Generator().manual_seed(4)
    with use(deepinfer_backend):
        clean = model.new_state()
        x = torch.tensor(ids, device=model.device)
        want = model.compute_logits(model.forward(x, model.batch([clean], x, [len(ids)])))
        for start in (5, 11, 16, 23):  # across window and compressor boundaries
            for a in range(4):
                st = model.new_state()
                model.forward(x[:start], model.batch([st], x[:start], [start]))
                keep = start + 1 + a
                wrong = (x[keep : start + 4] + torch.randint(1, 150, (start + 3 - keep + 1,), generator=g)) % 160
                step = torch.cat([x[start:keep], wrong.to(x.device)])
                model.forward(step, model.batch([st], step, [4]))
                st.length = keep  # the wrong drafts' caches stay where they were written
                rest = x[keep:]
                got = model.compute_logits(model.forward(rest, model.batch([st], rest, [len(rest)])))
                torch.testing.assert_close(got, want[keep:], atol=1e-4, rtol=0)


def serve(path, backend, device, **kw) -> LLM:
    args = dict(dtype="float32", block_size=4, prefill_chunk_size=8, max_num_batched_tokens=64, progress=False)
    return LLM(path, backend, device=device, **(args | kw))


@pytest.mark.usefixtures("invariant")
@pytest.mark.parametrize("name,k", [("plain", 1), ("yarn", 3)])
def test_tokens_identical_with_and_without_speculation(name, k, checkpoints, deepinfer_backend, deepinfer_device):
    path, _ = checkpoints(name)
    seed = random.randrange(1 << 30)
    prompts, params = requests(12, random.Random(seed), 160)
    plain = [result(o) for o in serve(path, deepinfer_backend, deepinfer_device).generate(prompts, params)]
    llm = serve(path, deepinfer_backend, deepinfer_device, speculative_config={"num_speculative_tokens": k})
    got = [result(o) for o in llm.generate(prompts, params)]
    differ = [i for i in range(len(prompts)) if got[i] != plain[i]]
    assert not differ, f"requests {differ} differ with speculation (seed {seed})"
    stats = llm.last_stats["speculative"]
    assert stats["drafted"] > 30 and stats["verifications"] > 10, stats


def oracle_drafts(monkeypatch, continuations: dict, rng: random.Random) -> None:
    """Drafts from a run without speculation (``continuations``: prompt -> its tokens then), each one spoiled with
    probability 1/4, in place of the MTP layer's (which still runs): most are accepted."""
    propose = MTPDrafter.propose

    def spoiled(self, seqs, *args, **kwargs):
        out = propose(self, seqs, *args, **kwargs)
        for seq in seqs:
            full = continuations[tuple(seq.token_ids[: seq.num_prompt_tokens])]
            true = full[seq.num_tokens : seq.num_tokens + len(seq.drafts)]
            seq.drafts = [t if rng.random() > 0.25 else (t + 1) % 160 for t in true]
        return out

    monkeypatch.setattr(MTPDrafter, "propose", spoiled)


@pytest.mark.usefixtures("invariant")
@pytest.mark.parametrize("mode", [None, "swap", "recompute"])
def test_accepted_drafts_keep_every_token(mode, checkpoints, monkeypatch, deepinfer_backend, deepinfer_device):
    """Drafts that are mostly right (``oracle_drafts``), greedy requests, with preemption in the middle of
    speculation (a cache of two sequences' state pages and 11 token pages) or without."""
    path, _ = checkpoints("yarn")
    rng = random.Random(7)
    prompts = [[rng.randrange(2, 160) for _ in range(rng.randint(3, 20))] for _ in range(8)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)
    plain = serve(path, deepinfer_backend, deepinfer_device).generate(prompts, params)
    oracle_drafts(monkeypatch, {tuple(p): p + o.outputs[0].token_ids for p, o in zip(prompts, plain)}, rng)
    kw = {"speculative_config": {"num_speculative_tokens": 3}}
    if mode is not None:
        layout = V4Checkpoint.open(path).config.cache_layout(4, 4, mtp_layers=1, drafts=3)
        kw |= {"num_blocks": 2 * layout.state_pages + 11, "preemption_mode": mode}
    llm = serve(path, deepinfer_backend, deepinfer_device, **kw)
    got = llm.generate(prompts, params)
    assert [result(o) for o in got] == [result(o) for o in plain]
    stats = llm.last_stats["speculative"]
    assert stats["acceptance_rate"] > 0.4 and stats["mean_accepted_length"] > 1.8, stats
    if mode is not None:
        assert llm.engine.num_preemptions > 0


@pytest.mark.usefixtures("invariant")
def test_prefix_cache_hits_keep_every_token(checkpoints, deepinfer_backend, deepinfer_device):
    """Requests sharing a prefix of 24 tokens (a multiple of every rate and page) reuse its state snapshot, the MTP
    layer's rings included, under speculation: the tokens of a run without caching. (The MTP layer's row at the
    prefix's last position was made with the token that followed it in the request that cached it: drafts may
    differ from a run without caching, tokens never do.)"""
    path, _ = checkpoints("yarn")
    rng = random.Random(3)
    shared = [rng.randrange(2, 160) for _ in range(24)]
    prompts = [shared + [rng.randrange(2, 160) for _ in range(rng.randint(1, 9))] for _ in range(6)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    spec = {"num_speculative_tokens": 2}
    off = serve(path, deepinfer_backend, deepinfer_device, enable_prefix_caching=False, speculative_config=spec)
    want = [result(o) for o in off.generate(prompts, params)]
    llm = serve(path, deepinfer_backend, deepinfer_device, speculative_config=spec)
    llm.generate(prompts[:1], params)
    assert [result(o) for o in llm.generate(prompts, params)] == want
    assert llm.engine.stats["cached_prompt_tokens"] >= 24 * 5


@pytest.mark.usefixtures("invariant")
def test_structured_output_holds_with_speculation(deepinfer_backend, deepinfer_device, tmp_path):
    """A V4 checkpoint with a byte-level tokenizer: choice and regex constraints hold on every sampled completion,
    with and without speculation (the grammar masks each verification row after the drafts before it), and the
    tokens are the same both ways."""
    from test_structured_output import CHOICES, check, constrained

    from deepinfer.model.tiny import build_tokenizer

    v4.v4_checkpoint(
        tmp_path, seed=41, **(v4.CONFIGS["plain"] | dict(vocab_size=258, bos_token_id=256, eos_token_id=257))
    )
    add_mtp(tmp_path, seed=42)
    build_tokenizer().save(str(tmp_path / "tokenizer.json"))
    params = [constrained(kind, seed) for kind in ("choice", "regex") for seed in range(4)]
    prompts = [[random.Random(i).randrange(3, 250) for _ in range(1 + i % 5)] for i in range(len(params))]
    plain = serve(tmp_path, deepinfer_backend, deepinfer_device).generate(prompts, params)
    llm = serve(tmp_path, deepinfer_backend, deepinfer_device, speculative_config={"num_speculative_tokens": 2})
    spec = llm.generate(prompts, params)
    for p, a, b in zip(params, plain, spec):
        kind = "choice" if p.structured_outputs.choice == CHOICES else "regex"
        assert a.outputs[0].finish_reason == "stop", a.outputs[0]
        check(kind, a.outputs[0].text)
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert llm.last_stats["speculative"]["drafted"] > 10


@pytest.mark.usefixtures("invariant")
def test_the_engine_drafts_what_the_mtp_layer_computes_alone(checkpoints, monkeypatch, deepinfer_backend):
    """Every draft the engine verifies (first drafts from the MTP pass over each step's rows, chained ones from the
    layer's own states, on the engine's pages across steps and rejected drafts) equals the MTP layer's greedy token
    recomputed from the sequence's tokens on pages of its own: a broken MTP path in the engine fails here even
    though verification keeps the output tokens right."""
    path, _ = checkpoints("yarn")
    seen = recorded_drafts(monkeypatch)
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 160) for _ in range(rng.randint(3, 25))] for _ in range(4)]
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    llm = serve(path, deepinfer_backend, None, speculative_config={"num_speculative_tokens": 3})
    llm.generate(prompts, params)
    assert len(seen) > 10 and sum(len(d) for *_, d in seen) > 30
    model = load(path, deepinfer_backend, None)
    model.use_pages(8, mtp_layers=1, drafts=3)
    assert_drafts_are_the_layers(model, seen, deepinfer_backend)


def recorded_drafts(monkeypatch) -> list[tuple[list[int], int, list[int]]]:
    """A list that collects ``(tokens, computed, drafts)`` of every sequence ``MTPDrafter.propose`` gives drafts."""
    seen = []
    propose = MTPDrafter.propose

    def recorded(self, seqs, *a, **k):
        out = propose(self, seqs, *a, **k)
        seen.extend((list(s.token_ids), s.num_computed, list(s.drafts)) for s in seqs if s.drafts)
        return out

    monkeypatch.setattr(MTPDrafter, "propose", recorded)
    return seen


def assert_drafts_are_the_layers(model, seen: list, backend: str) -> None:
    """Each ``(tokens, computed, drafts)`` the engine proposed is what ``model``'s MTP layer gives run alone: the
    model over the ``computed + 1`` tokens, then the layer's first draft and its chained ones."""
    mtp = model.mtp[0]
    with use(backend):
        for tokens, computed, drafts in seen:
            x = torch.tensor(tokens[: computed + 1], device=model.device)
            st = model.new_state()
            streams = model.forward(x, model.batch([st], x, [len(x)]))
            st.length = 0
            state = mtp.forward(streams[:-1], x[1:], model.batch([st], x[1:], [len(x) - 1]), None)[-1:]
            got = [int(mtp.compute_logits(state).argmax())]
            for j in range(1, len(drafts)):  # chained: the layer's own state and its last draft, one row further
                st.length = computed - 1 + j
                ids = torch.tensor(got[-1:], device=model.device)
                state = mtp.forward(state, ids, model.batch([st], ids, [1]), None)
                got.append(int(mtp.compute_logits(state).argmax()))
            assert got == drafts, (len(tokens), computed)
