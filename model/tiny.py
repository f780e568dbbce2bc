"""Random-weight DeepSeek-V3-architecture checkpoints, written deterministically: for tests and benchmarks that
need arbitrary shapes (the embedded trained model, ``deepinfer.model.embedded``, is the default model).

``write_checkpoint(path, config)`` writes ``config.json``, ``model.safetensors`` (bf16) and a byte-level
``tokenizer.json`` (256 byte tokens plus begin/end-of-sentence), all from this file's code and a fixed seed (NumPy's
legacy ``RandomState``, whose stream never changes), so every machine gets the same bytes. ``TINY_CONFIG`` (about
12 MB) has every feature of the architecture the loader and the model support: MLA with a low-rank query, YaRN
rope, a dense first layer, group-limited routing over 16 experts with a shared expert. The rows of ``lm_head`` for
printable ASCII are larger than the others, so the text it produces is mostly readable characters.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from .checkpoint import expected_layout
from .config import ModelConfig

SEED = 20250101
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

TINY_CONFIG: dict = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 258,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 16,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 128,
    "q_lora_rank": 128,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "qk_nope_head_dim": 64,
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 4,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "rope_interleave": True,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "torch_dtype": "bfloat16",
}


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-to-character map of byte-level BPE (printable bytes map to themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


def build_tokenizer() -> Tokenizer:
    """Byte-level tokenizer: token ``b`` is byte ``b``; 256 and 257 are begin/end of sentence; BOS is added."""
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS])
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 256)])
    return tok


def random_weights(config: dict, seed: int = SEED) -> dict[str, torch.Tensor]:
    """Deterministic weights for every tensor of ``config``'s layout: linears ``N(0, 1/K)``, norms 1, the router
    bias ``N(0, 0.1^2)``, embeddings ``N(0, 1)``, ``lm_head`` rows of printable bytes ``N(0, 0.25^2)`` and the
    others ten times smaller. bf16, except the router (fp32, as checkpoints keep it)."""
    cfg = ModelConfig.from_dict(config)
    rng = np.random.RandomState(seed)
    printable = np.zeros(cfg.vocab_size, dtype=bool)
    printable[[*range(32, 127), 10]] = True
    out = {}
    for name, want in sorted(expected_layout(cfg).items()):
        shape = want.shape
        if name.endswith("norm.weight"):
            w = np.ones(shape, dtype=np.float32)
        elif name.endswith("e_score_correction_bias"):
            w = 0.1 * rng.standard_normal(shape).astype(np.float32)
        elif name == "model.embed_tokens.weight":
            w = rng.standard_normal(shape).astype(np.float32)
        elif name == "lm_head.weight":
            w = rng.standard_normal(shape).astype(np.float32) * np.where(printable, 0.25, 0.025)[:, None]
        else:
            w = rng.standard_normal(shape).astype(np.float32) / np.sqrt(shape[-1])
        t = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
        out[name] = t if want.kind == "fp32" else t.to(torch.bfloat16)
    return out


def write_checkpoint(path: str | Path, config: dict | None = None, seed: int = SEED) -> Path:
    """Writes a checkpoint of ``config`` (default: the embedded one) with deterministic random weights and the
    byte-level tokenizer into ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(TINY_CONFIG if config is None else config)
    save_file(random_weights(config, seed), str(path / "model.safetensors"), metadata={"format": "pt"})
    build_tokenizer().save(str(path / "tokenizer.json"))
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path
