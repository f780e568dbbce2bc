"""Helpers of the model tests: tiny DeepseekV3 checkpoints written by transformers, an FP8 copy, and the oracle.

The oracle is Hugging Face transformers' ``DeepseekV3ForCausalLM`` in fp32 on the same weights. Where our paged
cache stores the latent at a lower precision than the computation (bf16, or the ``fp8_ds_mla`` record), the oracle
is given a cache that stores it at that precision too (``LatentPrecisionCache``): the rounding is written here from
the formats' definitions, independently of deepinfer's code, and applied where transformers caches the latent.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.cache_utils import DynamicCache

import deepinfer

# The oracle needs a DeepseekV3 that caches the compressed latent and takes its cache as ``cache=`` (transformers
# 5.24). Older releases take ``past_key_values=``, ignore ``cache=`` (every decode step then sees one token) and cache
# per-head K and V, so ``LatentPrecisionCache`` would round the wrong tensors: refuse them instead of failing later.
if "cache" not in inspect.signature(DeepseekV3ForCausalLM.forward).parameters:
    raise RuntimeError(
        f"the model cross-checks need transformers >= 5.24 (a DeepseekV3 that caches the latent), found "
        f"{transformers.__version__}"
    )


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread (and do not slow down next to other work on the machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

BASE = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=3,
    n_shared_experts=1,
    first_k_dense_replace=1,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    max_position_embeddings=512,
    routed_scaling_factor=2.5,
    bos_token_id=0,
    eos_token_id=1,
)


def hf_checkpoint(path: Path, seed: int, classes=(DeepseekV3Config, DeepseekV3ForCausalLM), **overrides) -> Path:
    """A tiny random ``DeepseekV3ForCausalLM`` (or the model of ``classes``: its config and model class) saved by
    transformers (bf16 weights, hub layout with per-expert keys). Weights are redrawn so every part matters: norms
    ``1 + N(0, 0.2^2)``, norm biases ``N(0, 0.2^2)``, router bias ``N(0, 0.1^2)``, linears ``N(0, 1/K)``,
    embeddings ``N(0, 1)``, ``lm_head`` ``N(0, 0.5^2)`` (spread-out logits)."""
    config_class, model_class = classes
    cfg = config_class(**(BASE | overrides))
    torch.manual_seed(seed)
    model = model_class(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "inv_freq" in name:
                continue
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.2 * noise)
            elif name.endswith("norm.bias"):
                p.copy_(0.2 * noise)
            elif "e_score_correction_bias" in name:
                p.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            elif "lm_head" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def fp8_e4m3_blocks(w: torch.Tensor, block: int = 128, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantises ``w [N, K]``: one fp32 scale per 128x128 block (``amax / 448``, or the next power of two
    for ``ue8m0``), data ``w / scale`` in e4m3. Returns ``(data, scale)`` with ``w ~= data * scale``."""
    n, k = w.shape
    rows, cols = math.ceil(n / block), math.ceil(k / block)
    scale = torch.empty(rows, cols)
    data = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * block : (i + 1) * block, j * block : (j + 1) * block].float()
            s = max(tile.abs().max().item(), 1e-4) / 448.0
            if ue8m0:
                s = 2.0 ** math.ceil(math.log2(s))
            scale[i, j] = s
            data[i * block : (i + 1) * block, j * block : (j + 1) * block] = (
                (tile / s).clamp(-448, 448).to(torch.float8_e4m3fn)
            )
    return data, scale


def is_quantized_linear(name: str) -> bool:
    """The linears DeepSeek-V3 checkpoints store in FP8: every projection but the router, embeddings, lm_head; in
    DeepSeek-V3.2 also the indexer's ``wq_b`` and ``wk``, but not its ``weights_proj`` (kept in high precision)."""
    if name.endswith("weights_proj.weight"):
        return False
    return name.endswith(("proj.weight", "proj_with_mqa.weight", "indexer.wq_b.weight", "indexer.wk.weight"))


def fp8_copy(src: Path, dst: Path, oracle: Path, ue8m0: bool = False) -> tuple[Path, Path]:
    """Writes ``dst``: ``src`` with its linears in FP8 (``weight`` e4m3 + ``weight_scale_inv``) and a
    ``quantization_config``; and ``oracle``: the same checkpoint with those weights dequantised to fp32 (what
    transformers runs)."""
    for d in (dst, oracle):
        d.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    q, deq = {}, {}
    for name, w in tensors.items():
        if is_quantized_linear(name):
            data, scale = fp8_e4m3_blocks(w, ue8m0=ue8m0)
            q[name], q[name.replace(".weight", ".weight_scale_inv")] = data, scale
            s = scale.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
            deq[name] = data.float() * s
        else:
            q[name], deq[name] = w, w.float()
    save_file(q, str(dst / "model.safetensors"), metadata={"format": "pt"})
    save_file(deq, str(oracle / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (oracle / "config.json").write_text(json.dumps(config))
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        **({"scale_fmt": "ue8m0"} if ue8m0 else {}),
    }
    (dst / "config.json").write_text(json.dumps(config))
    return dst, oracle


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def round_fp8_ds_mla(c: torch.Tensor) -> torch.Tensor:
    """The latent ``c [..., r]`` as an ``fp8_ds_mla`` record holds it: per 128 values a power-of-two scale
    ``2^ceil(log2(max(amax, 1e-4) / 448))``, values ``c / scale`` in e4m3."""
    g = c.float().reshape(*c.shape[:-1], -1, 128)
    amax = g.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    scale = torch.where(scale < amax / 448.0, scale * 2, scale)
    return ((g / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale).reshape(c.shape).to(c.dtype)


class LatentPrecisionCache(DynamicCache):
    """transformers' cache, storing the compressed latent and the rotary key at our paged cache's precision
    (``bf16``: both bf16; ``fp8_ds_mla``: the latent as the FP8 record, the rotary key bf16)."""

    def __init__(self, *args, kv_format: str = "bf16", **kwargs):
        super().__init__(*args, **kwargs)
        self.kv_format = kv_format

    def update(self, latent, k_rot, layer_idx, *args, **kwargs):
        latent = round_fp8_ds_mla(latent) if self.kv_format == "fp8_ds_mla" else round_bf16(latent)
        return super().update(latent, round_bf16(k_rot), layer_idx, *args, **kwargs)


def act_quant(x: torch.Tensor, ue8m0: bool) -> torch.Tensor:
    """DeepSeek-V3's activation quantisation, applied and undone: per token per 128 channels
    ``scale = max(amax, 1e-4) / 448`` (next power of two for ``ue8m0``), values rounded to e4m3."""
    g = x.float().reshape(*x.shape[:-1], -1, 128)
    s = g.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448.0
    if ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s)))
        s = torch.where(s < g.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448.0, s * 2, s)
    return ((g / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).reshape(x.shape).to(x.dtype)


@contextlib.contextmanager
def forward_hooks(modules, hook):
    """Inside the block, ``hook(module, args, output)`` runs after every forward of each of ``modules`` (a hook that
    returns a value replaces the output)."""
    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def fp8_activations(model, ue8m0: bool = False, kv_b: bool = True):
    """Inside the block, every ``F.linear`` of ``model`` on a weight stored in FP8 (``is_quantized_linear``, and
    the routed experts) first quantises its input as DeepSeek-V3's FP8 GEMMs do. ``kv_b=False`` leaves
    ``kv_b_proj`` unquantised: absorbed decode multiplies by the dequantised ``W_UK`` / ``W_UV`` (DeepSeek's own
    inference code does the same), so no activation meets that weight in FP8."""
    quantized = {
        p.untyped_storage().data_ptr()
        for n, p in model.named_parameters()
        if (is_quantized_linear(n) and (kv_b or "kv_b_proj" not in n)) or ".experts." in n
    }
    original = F.linear

    def linear(x, w, b=None):
        if w.untyped_storage().data_ptr() in quantized:
            x = act_quant(x, ue8m0)
        return original(x, w, b)

    F.linear = linear
    try:
        yield
    finally:
        F.linear = original


def oracle_logprobs(
    model,
    prompt: list[int],
    generated: list[int] = (),
    *,
    kv_format: str | None = None,
    prefill=contextlib.nullcontext,
    decode=contextlib.nullcontext,
) -> torch.Tensor:
    """``log_softmax`` of the oracle's logits (fp32) for ``prompt + generated``: row ``i`` predicts token ``i + 1``.

    The prompt runs in one forward inside ``prefill()``, then each generated token but the last is fed one at a
    time over transformers' cache inside ``decode()``, as an engine prefills then decodes. ``kv_format``: cache the
    latent at that precision (``LatentPrecisionCache``), or at full precision when None.
    """
    if kv_format is None:
        cache = DynamicCache(config=model.config)
    else:
        cache = LatentPrecisionCache(config=model.config, kv_format=kv_format)
    with torch.no_grad():
        with prefill():
            logits = [model(torch.tensor([prompt]), cache=cache, use_cache=True).logits[0]]
        with decode():
            for t in list(generated)[:-1]:
                logits.append(model(torch.tensor([[t]]), cache=cache, use_cache=True).logits[0])
    return torch.log_softmax(torch.cat(logits).float(), dim=-1)


def load_oracle(path: Path, dtype: torch.dtype = torch.float32):
    """transformers' model of ``path`` with its reference code paths (eager attention and experts)."""
    return DeepseekV3ForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
    ).eval()


def token_logprobs(lp: torch.Tensor, tokens: list[int]) -> list[float | None]:
    """Per token of ``tokens``, its log-probability in ``lp`` (row ``i`` predicts token ``i + 1``); None first."""
    return [None] + [lp[j - 1, tokens[j]].item() for j in range(1, len(tokens))]


# 32 experts: outside batch-invariant mode the reference moe_route takes torch's sigmoid over all T x E logits at once,
# and torch's CPU loop rounds its scalar tail differently from its vector body (32 floats per step with AVX-512), so
# unless E is a multiple of 32 a row's routing weights depend on T (batch-invariant mode scores each row alone); with
# 32 experts every row is whole vector steps.
SMALL = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=2,
    n_routed_experts=32,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=2,
    kv_lora_rank=32,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    max_position_embeddings=1024,
)


def small_checkpoint(path: Path, seed: int = 0, **overrides) -> Path:
    """A small DeepSeek-V3 checkpoint with a byte-level tokenizer, written by deepinfer's own writer (engine tests
    need no oracle)."""
    from deepinfer.model.tiny import TINY_CONFIG, write_checkpoint

    return write_checkpoint(path, TINY_CONFIG | SMALL | overrides, seed=seed)


def random_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


class ReplayedForward:
    """Stands in for a captured CUDA graph off the GPU: ``replay`` runs the captured forward again over the same
    static inputs and writes its outputs into the tensors the capture returned, as a graph's replay does.

    Graphs captured into one memory pool may keep their outputs where a graph captured before them keeps its
    temporaries, so a replay may overwrite the outputs of every graph captured after it: ``replay`` fills those
    with garbage (NaN, or an integer no index reaches), so that a reader of a stale output fails here too."""

    def __init__(self, forward, key: tuple[int, int], out, replayed: list[tuple[int, int]], captured: list):
        """``captured``: the graphs of this one's pool so far, in capture order (this one is appended)."""
        self.forward, self.key, self.out, self.replayed = forward, key, out, replayed
        self.captured, self.order = captured, len(captured)
        captured.append(self)

    def replay(self) -> None:
        self.replayed.append(self.key)
        with deepinfer.value_checks(False):  # as a graph's replay: the engine's forward checks no values
            for held, new in zip(self.out, self.forward(self.key)):
                if held is not None:  # an output the forward does not compute (draft probabilities)
                    held.copy_(new)
        mine = {t.data_ptr() for t in self.out if t is not None}
        for graph in self.captured[self.order + 1 :]:
            for t in graph.out:
                if t is not None and t.data_ptr() not in mine:
                    t.fill_(float("nan") if t.is_floating_point() else torch.iinfo(t.dtype).max)

    def pool(self) -> None:
        return None


def replay_graphs_on_cpu(monkeypatch) -> list[tuple[int, int]]:
    """Lets the engine take the CUDA-graph decode path (``cuda_graphs.DecodeGraphs``: buckets, static input buffers,
    padding rows, low-latency experts) on any device, each replay running the forward eagerly: what the graph path
    computes, checked where no GPU is. Returns the list of (bucket, width) replayed, in order, that replays append
    to."""
    from deepinfer.model import cuda_graphs

    replayed: list[tuple[int, int]] = []
    pools: dict[int, list[ReplayedForward]] = {}  # per engine's graphs (one pool each), in capture order

    def capture_one(self, forward, key, pool):
        with deepinfer.value_checks(False):  # as the capture's warm-up runs
            out = forward(key)
        return ReplayedForward(forward, key, out, replayed, pools.setdefault(id(self), [])), out

    from deepinfer.model import model_runner

    launch = model_runner.ModelRunner.launch

    def launch_copying(self, *args, **kwargs):
        # a step's results are copied to the host when it is launched, as the GPU's queued copies are: the graphs'
        # outputs they may be views of change with the next replay
        step = launch(self, *args, **kwargs)
        step._host = {name: value.clone() for name, value in step._host.items()}
        return step

    monkeypatch.setattr(cuda_graphs, "can_capture", lambda backend, device: True)
    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "_capture_one", capture_one)
    monkeypatch.setattr(model_runner.ModelRunner, "launch", launch_copying)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return replayed
