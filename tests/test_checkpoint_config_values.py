"""Config values the other cross-checks leave at their defaults, read as transformers reads them.

Served: deepinfer's prompt log-probabilities (fp32 activations, bf16 latent cache) within 1e-2 nats of transformers'
fp32 model, on tiny random checkpoints it writes, over a cache holding the latent in bf16
(``model_helpers.LatentPrecisionCache``). ``rms_norm_eps``: transformers (as DeepSeek's own inference code) gives the
layer norms and the final norm that epsilon, but the norms of the low-rank query and of the latent
(``q_a_layernorm``, ``kv_a_layernorm``) keep their default of 1e-6 whatever the config says. DeepSeek-V3's own
checkpoints set 1e-6, where the two agree; others (Moonlight: 1e-5) do not.
``n_shared_experts: 0``: the empty shared-expert weights transformers writes load as no shared expert.

Read: fields whose meaning transformers' classes settle, compared with what those classes make of the same
config: the rotary tables (and DeepSeek-V3's softmax scale) from any mix of the hub's ``rope_scaling`` /
``rope_theta`` and transformers' ``rope_parameters``, DeepSeek-V4's rope width, and the routing fields a config
leaves out. Refused when config.json is read, naming the field: a DeepSeek-V3.2 config asking for half-split
attention rope (which transformers' DeepseekV32 does not have), and impossible routing for the MoE layers that
``mlp_layer_types`` lists.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from model_helpers import hf_checkpoint, load_oracle, one_thread, oracle_logprobs, random_prompts  # noqa: F401
from transformers import DeepseekV3Config, DeepseekV4Config, DeepseekV32Config, DeepseekV32ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

from deepinfer import ops
from deepinfer.model import LLM, CheckpointError, ModelConfig, SamplingParams
from deepinfer.model.config_v4 import V4Config

TOL = 1e-2
# index_topk above every prompt's length: the indexer keeps every token, so its selection (discrete, checked by
# test_model_v32) cannot differ.
V32 = dict(index_n_heads=4, index_head_dim=32, index_topk=64)


def _oracle(path, family: str):
    if family == "v3":
        return load_oracle(path)
    return DeepseekV32ForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()


def _max_prompt_error(path, family: str, backend, device) -> float:
    oracle = _oracle(path, family)
    prompts = random_prompts(oracle.config.vocab_size, [6, 23, 40], seed=2)
    llm = LLM(path, backend, device=device, dtype="float32", block_size=8, progress=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0))
    worst = 0.0
    for p, o in zip(prompts, outs):
        lp = oracle_logprobs(oracle, p, kv_format="bf16")
        worst = max(worst, *(abs(lp[j - 1, p[j]].item() - o.prompt_logprobs[j]) for j in range(1, len(p))))
    return worst


@pytest.mark.parametrize("family", ["v3", "v32"])
@pytest.mark.parametrize("eps", [1e-2, 1e-5])
def test_rms_norm_eps_reaches_the_layer_norms_only(family, eps, tmp_path, deepinfer_backend, deepinfer_device):
    classes = {} if family == "v3" else {"classes": (DeepseekV32Config, DeepseekV32ForCausalLM)}
    extra = {} if family == "v3" else V32
    path = hf_checkpoint(tmp_path, 5, **classes, **extra, rms_norm_eps=eps)
    err = _max_prompt_error(path, family, deepinfer_backend, deepinfer_device)
    assert err < TOL, f"prompt log-probabilities differ from transformers' by up to {err:.3g} (rms_norm_eps {eps})"


def test_deepseek_v32_with_half_split_rope_is_refused(tmp_path):
    """transformers' DeepseekV32 has no ``rope_interleave``: its attention rotates interleaved pairs whatever the
    config says (its indexer the half-split layout). A config asking for half-split attention rope describes another
    model: refused, naming the field, rather than served with the other rotation."""
    path = hf_checkpoint(tmp_path, 5, (DeepseekV32Config, DeepseekV32ForCausalLM), **V32, rope_interleave=False)
    with pytest.raises(CheckpointError) as e:
        LLM(path, "reference", dtype="float32", progress=False)
    assert "rope_interleave" in str(e.value) and "deepseek_v32" in str(e.value)


V4_FIELDS = dict(
    vocab_size=160,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    head_dim=32,
    q_lora_rank=48,
    n_routed_experts=8,
    num_experts_per_tok=2,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=4,
    index_head_dim=16,
)


@pytest.mark.parametrize(
    "rope_fields",
    [
        {"partial_rotary_factor": 0.25, "qk_rope_head_dim": 16},
        {"partial_rotary_factor": 0.5, "qk_rope_head_dim": 8},
        {"qk_rope_head_dim": 16},
        {"partial_rotary_factor": 0.25},
        {},
    ],
)
def test_v4_rope_width_is_read_as_transformers_reads_it(rope_fields):
    """transformers' DeepseekV4Config takes ``partial_rotary_factor`` where it is given and the legacy
    ``qk_rope_head_dim`` only without it; a config holding both (disagreeing) rotates as many channels there."""
    raw = {"model_type": "deepseek_v4", **V4_FIELDS, **rope_fields}
    theirs = DeepseekV4Config(**V4_FIELDS, **rope_fields).qk_rope_head_dim
    assert V4Config.from_dict(raw).qk_rope_head_dim == theirs


V3_FIELDS = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    max_position_embeddings=512,
)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale_all_dim": 1.0}
POSITIONS = 256


@pytest.mark.parametrize(
    "rope_fields",
    [
        {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}, "rope_scaling": YARN},
        {"rope_scaling": YARN | {"rope_theta": 500.0}, "rope_theta": 20000.0},
        {"rope_parameters": YARN | {"rope_theta": 500.0}, "original_max_position_embeddings": 1024},
        {
            "rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64},
            "original_max_position_embeddings": 1024,
        },
        {"rope_scaling": YARN, "rope_theta": 500.0},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}},
        {"rope_theta": 500.0},
    ],
)
def test_v3_rope_fields_are_read_as_transformers_reads_them(rope_fields):
    """The rotary table (base, YaRN's frequencies and cos/sin factor) and the attention's softmax scale as
    transformers' DeepseekV3 builds them from the hub's ``rope_scaling`` / ``rope_theta`` and its own
    ``rope_parameters``, in any mix of the two."""
    ours = ModelConfig.from_dict({"model_type": "deepseek_v3", **V3_FIELDS, **rope_fields})
    theirs = DeepseekV3Config(**V3_FIELDS, **copy.deepcopy(rope_fields))  # transformers edits the dicts it is given
    cos, sin = DeepseekV3RotaryEmbedding(theirs)(torch.zeros(1), torch.arange(POSITIONS)[None])
    half = ours.qk_rope_head_dim // 2
    table = ops.rope_cos_sin_cache(ours.qk_rope_head_dim, POSITIONS, ours.rope_theta, ours.rope_scaling)
    torch.testing.assert_close(table, torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=1), rtol=1e-5, atol=1e-5)
    scale = ops.mla_softmax_scale(ours.qk_head_dim, ours.rope_scaling)
    assert scale == pytest.approx(DeepseekV3Attention(theirs, 0).scaling, rel=1e-9)


V4_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize(
    "rope_fields",
    [
        {"rope_parameters": {"rope_type": "default"}, "rope_scaling": V4_YARN},
        {"rope_parameters": V4_YARN, "rope_scaling": V4_YARN | {"factor": 2.0}},
        {"rope_scaling": V4_YARN, "rope_theta": 500.0, "compress_rope_theta": 3000.0},
        {"rope_parameters": V4_YARN, "original_max_position_embeddings": 1024},
        {"rope_parameters": V4_YARN},
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
        {"rope_scaling": {"type": "yarn", "factor": 4.0}, "max_position_embeddings": 2048},
        {
            "rope_parameters": {
                "main": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25},
                "compress": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "attention_factor": 1.0,
                    "partial_rotary_factor": 0.25,
                },
            },
            "partial_rotary_factor": 0.25,
            "max_position_embeddings": 2048,
        },
        {
            "rope_parameters": {
                "main": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25},
                "compress": {"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.25},
            },
            "partial_rotary_factor": 0.25,
            "max_position_embeddings": 2048,
        },
        {
            "rope_parameters": {
                "main": {"rope_type": "default", "partial_rotary_factor": 0.25},
                "compress": V4_YARN | {"mscale": 1.0, "mscale_all_dim": 0.5, "partial_rotary_factor": 0.25},
            },
            "partial_rotary_factor": 0.25,
        },
        {
            "rope_parameters": {
                "main": {"rope_type": "default", "partial_rotary_factor": 0.25},
                "compress": {"rope_type": "default", "partial_rotary_factor": 0.25},
            },
            "partial_rotary_factor": 0.25,
            "rope_theta": 500.0,
            "compress_rope_theta": 3000.0,
        },
        {
            "rope_parameters": {
                "main": {"rope_type": "default", "partial_rotary_factor": 0.5},
                "compress": V4_YARN | {"attention_factor": 1.0, "partial_rotary_factor": 0.5},
            },
            "partial_rotary_factor": 0.25,
        },
        {
            "rope_parameters": {"main": {"rope_type": "default"}, "compress": {"rope_type": "default"}},
            "qk_rope_head_dim": 4,
            "index_head_dim": 32,
        },
        {"rope_theta": 500.0},
    ],
)
def test_v4_rope_fields_are_read_as_transformers_reads_them(rope_fields):
    """The main and the compressed branches' rotary tables as transformers' DeepseekV4RotaryEmbedding builds them
    from ``rope_parameters`` and the hub's ``rope_scaling``, in any mix of the two. A YaRN ``compress`` rope given
    nested keeps cos/sin unscaled only where it says ``attention_factor: 1``; transformers fills that in for the
    flat form alone. A nested rope rotates as many channels as its own ``partial_rotary_factor`` says, else the
    config's ``partial_rotary_factor``, else all of them (not the legacy ``qk_rope_head_dim``)."""
    ours = V4Config.from_dict({"model_type": "deepseek_v4", **V4_FIELDS, **rope_fields})
    rotary = DeepseekV4RotaryEmbedding(DeepseekV4Config(**(V4_FIELDS | copy.deepcopy(rope_fields))))
    positions = torch.arange(POSITIONS)[None]
    for kind, theta, scaling in (
        ("main", ours.rope_theta, None),
        ("compress", ours.compress_rope_theta, ours.compress_rope_scaling),
    ):
        cos, sin = rotary(torch.zeros(1), positions, layer_type=kind)
        table = ops.rope_cos_sin_cache(ours.qk_rope_head_dim, POSITIONS, theta, scaling)
        theirs = torch.cat([cos[0], sin[0]], dim=1)
        assert torch.allclose(table, theirs, rtol=1e-5, atol=1e-5), f"{kind}: {(table - theirs).abs().max()}"


# Each differs from both transformers' default and DeepSeek-V2's reading, so that leaving it out shows which is taken.
ROUTING_FIELDS = dict(
    n_routed_experts=16,
    n_shared_experts=2,
    routed_scaling_factor=1.5,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=3,
    first_k_dense_replace=1,
    norm_topk_prob=False,
    q_lora_rank=48,
    moe_intermediate_size=32,
    max_position_embeddings=8192,
)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v32"])
@pytest.mark.parametrize("left_out", list(ROUTING_FIELDS))
def test_fields_a_config_leaves_out_take_transformers_defaults(model_type, left_out):
    """A config.json without one of these fields is read with the default transformers' config class of its
    ``model_type`` gives it (DeepSeek-V3's values, not DeepSeek-V2's)."""
    sparse = model_type == "deepseek_v32"
    fields = {k: v for k, v in (V3_FIELDS | ROUTING_FIELDS | (V32 if sparse else {})).items() if k != left_out}
    theirs = (DeepseekV32Config if sparse else DeepseekV3Config)(**fields)
    ours = ModelConfig.from_dict({"model_type": model_type, **fields})
    assert getattr(ours, left_out) == getattr(theirs, left_out)


@pytest.mark.parametrize(
    "routing, fragment",
    [
        ({"n_group": 3}, "'n_group' must divide n_routed_experts"),
        ({"topk_group": 5}, "'topk_group' must lie in"),
        ({"num_experts_per_tok": 9}, "'num_experts_per_tok' must lie in"),
    ],
)
def test_routing_of_moe_layers_listed_in_mlp_layer_types_is_checked_at_load(routing, fragment):
    """DeepSeek-V3.2's ``mlp_layer_types`` decides which layers are MoE, whatever ``first_k_dense_replace`` says;
    the routing of those layers is checked when config.json is read, not left to fail in the first forward."""
    fields = V3_FIELDS | ROUTING_FIELDS | V32 | {"first_k_dense_replace": 2, "mlp_layer_types": ["dense", "sparse"]}
    with pytest.raises(CheckpointError, match=fragment):
        ModelConfig.from_dict({"model_type": "deepseek_v32", **fields, **routing})


def test_no_shared_expert_loads_the_empty_weights_transformers_writes(tmp_path, deepinfer_backend, deepinfer_device):
    """``n_shared_experts: 0``: transformers builds the shared expert with an intermediate size of 0 and writes its
    weights with no elements. They load as no shared expert, the prompt log-probabilities match transformers', and a
    shared-expert weight that holds elements under that config is still refused."""
    path = hf_checkpoint(tmp_path / "none", 6, n_shared_experts=0)
    err = _max_prompt_error(path, "v3", deepinfer_backend, deepinfer_device)
    assert err < TOL, f"prompt log-probabilities differ from transformers' by up to {err:.3g}"
    one = hf_checkpoint(tmp_path / "one", 6, n_shared_experts=1)
    config = json.loads((one / "config.json").read_text())
    (one / "config.json").write_text(json.dumps(config | {"n_shared_experts": 0}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.\d\.mlp\.shared_experts\."):
        LLM(one, "reference", device="cpu", progress=False)
