"""Hugging Face layout checkpoints of the DeepSeek-V3 family: find the files, check them, stream tensors out.

A checkpoint directory holds ``config.json`` and one or more ``*.safetensors`` files, with
``model.safetensors.index.json`` when sharded. Only safetensors are read: pickle files (``*.bin``, ``*.pt``,
``*.pth``, ``*.ckpt``, ``*.pkl``) are refused, since loading them can run arbitrary code.

``Checkpoint.open(path, config)`` reads every file's header (never the data) and checks the whole checkpoint
against the layout ``config.json`` implies (``expected_layout``): each file is well formed and not truncated,
every expected tensor is present once with the expected shape and a usable dtype, FP8 weights come with
``weight_scale_inv`` of the block-scale shape, nothing unexpected is left over. Any problem is a
``CheckpointError`` naming the file and the tensor, raised before a single weight is read. The counts in
``config.json`` are checked against the number of tensors in the headers before the layout is built, and anything
but a regular file is refused before it is opened, so that no checkpoint can make the check itself hang or exhaust
memory.

Multi-token-prediction layers: ``num_nextn_predict_layers = K`` in ``config.json`` declares K MTP layers after the
``L = num_hidden_layers`` decoder layers, named ``model.layers.{L + i}.`` as DeepSeek writes them: ``enorm``,
``hnorm``, ``eh_proj``, a whole decoder layer (attention, and a dense or MoE MLP by the usual index rule),
``shared_head.norm``, and optionally ``shared_head.head`` and ``embed_tokens``. They are checked like the rest and
read only for speculative decoding (``mtp_keys`` lists them). A checkpoint holds either all K of them, complete, or
none: transformers writes ``num_nextn_predict_layers: 1`` but no MTP weights, and serving without speculation does
not need them. A partial or mis-shaped
MTP layer is an error; so is a main-model tensor that is missing, which also catches a ``config.json`` whose
``num_hidden_layers`` is lower than the weights' (its last decoder layers would otherwise pass for MTP layers).

``Checkpoint.read`` then returns one tensor at a time from the memory-mapped files (float weights in the asked
dtype, FP8 weights as a ``QTensor`` with their scales), on the asked device, counting bytes for a progress bar.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors import safe_open

from deepinfer import QTensor

from .config import ModelConfig
from .errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
MAX_HEADER_BYTES = 100 * 1024 * 1024
SCALE_SUFFIX = "_scale_inv"

DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "BF16": (torch.bfloat16, 2),
    "F16": (torch.float16, 2),
    "F32": (torch.float32, 4),
    "F64": (torch.float64, 8),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
    "F8_E8M0": (torch.float8_e8m0fnu, 1),  # ue8m0 block scales (DeepSeek-V4's FP4 experts)
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "I16": (torch.int16, 2),
    "I32": (torch.int32, 4),
    "I64": (torch.int64, 8),
    "BOOL": (torch.bool, 1),
}
FLOAT_KINDS = ("BF16", "F16", "F32")

# Kinds of tensors in the layout: "linear" weights may be FP8 with a weight_scale_inv; the others are float.
LINEAR, FLOAT, FP32 = "linear", "float", "fp32"


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives: its file, safetensors dtype string and shape."""

    file: Path
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Expected:
    """A tensor ``config.json`` implies: its shape and kind (``linear``: float or FP8 block-scaled; ``float``:
    float; ``fp32``: float, used in fp32). ``mtp``: part of a multi-token-prediction layer (read for speculative
    decoding); ``optional``: may be absent (an MTP layer's own ``embed_tokens`` and ``shared_head.head``)."""

    shape: tuple[int, ...]
    kind: str
    mtp: bool = False
    optional: bool = False


def expected_layout(cfg: ModelConfig) -> dict[str, Expected]:
    """Every tensor a checkpoint of ``cfg`` may hold (Hugging Face names, per-expert keys), with its shape: the
    model's, then those of its ``num_nextn_predict_layers`` multi-token-prediction layers (``mtp=True``)."""
    out = dict(_model_items(cfg))
    for layer in range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers):
        out.update(mtp_layer_keys(cfg, layer))
    return out


def _model_items(cfg: ModelConfig) -> Iterator[tuple[str, Expected]]:
    """The model's tensors (no MTP layer), one at a time, in ``expected_layout``'s order."""
    h = cfg.hidden_size
    yield "model.embed_tokens.weight", Expected((cfg.vocab_size, h), FLOAT)
    yield "model.norm.weight", Expected((h,), FLOAT)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", Expected((cfg.vocab_size, h), LINEAR)
    for layer in range(cfg.num_hidden_layers):
        yield from _decoder_layer_items(cfg, layer)


def model_layout_size(cfg: ModelConfig) -> int:
    """How many tensors the model (no MTP layer) has: ``len`` of ``expected_layout`` less the MTP layers, counted
    without building it, so that it can be checked against the files before anything of that size is made."""
    layers, experts = cfg.num_hidden_layers, cfg.n_routed_experts
    if experts <= 0:
        moe_layers = 0
    elif cfg.mlp_layer_types is not None:
        moe_layers = sum(cfg.is_moe_layer(i) for i in range(len(cfg.mlp_layer_types)))
    else:
        moe_layers = max(0, layers - cfg.first_k_dense_replace)
    moe_mlp = 1 + (cfg.scoring_func == "sigmoid") + 3 * experts + (3 if cfg.n_shared_experts else 0)
    per_layer = 2 + len(attention_keys(cfg, ""))
    return 2 + (not cfg.tie_word_embeddings) + layers * per_layer + (layers - moe_layers) * 3 + moe_layers * moe_mlp


def decoder_layer_keys(cfg: ModelConfig, layer: int) -> dict[str, Expected]:
    """The tensors of decoder layer ``layer``: its two norms, its attention and its MLP (dense or MoE by the layer
    index, as ``ModelConfig.is_moe_layer`` says)."""
    return dict(_decoder_layer_items(cfg, layer))


def _decoder_layer_items(cfg: ModelConfig, layer: int) -> Iterator[tuple[str, Expected]]:
    h, p = cfg.hidden_size, f"model.layers.{layer}."
    yield p + "input_layernorm.weight", Expected((h,), FLOAT)
    yield p + "post_attention_layernorm.weight", Expected((h,), FLOAT)
    yield from attention_keys(cfg, p + "self_attn.").items()
    yield from _mlp_items(cfg, layer, p + "mlp.")


def attention_keys(cfg: ModelConfig, a: str) -> dict[str, Expected]:
    """The tensors of one MLA block under the prefix ``a`` (``model.layers.{i}.self_attn.``), with its indexer for
    sparse attention."""
    h, heads, r, dr = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    out: dict[str, Expected] = {}
    if cfg.q_lora_rank is None:
        out[a + "q_proj.weight"] = Expected((heads * cfg.qk_head_dim, h), LINEAR)
    else:
        out[a + "q_a_proj.weight"] = Expected((cfg.q_lora_rank, h), LINEAR)
        out[a + "q_a_layernorm.weight"] = Expected((cfg.q_lora_rank,), FLOAT)
        out[a + "q_b_proj.weight"] = Expected((heads * cfg.qk_head_dim, cfg.q_lora_rank), LINEAR)
        if cfg.attention_bias:
            out[a + "q_a_proj.bias"] = Expected((cfg.q_lora_rank,), FLOAT)
    out[a + "kv_a_proj_with_mqa.weight"] = Expected((r + dr, h), LINEAR)
    out[a + "kv_a_layernorm.weight"] = Expected((r,), FLOAT)
    out[a + "kv_b_proj.weight"] = Expected((heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), r), LINEAR)
    out[a + "o_proj.weight"] = Expected((h, heads * cfg.v_head_dim), LINEAR)
    if cfg.attention_bias:
        out[a + "kv_a_proj_with_mqa.bias"] = Expected((r + dr,), FLOAT)
        out[a + "o_proj.bias"] = Expected((h,), FLOAT)
    if cfg.sparse_attention:
        out.update(indexer_keys(cfg, a + "indexer."))
    return out


def indexer_keys(cfg: ModelConfig, prefix: str) -> dict[str, Expected]:
    """DeepSeek-V3.2's lightning indexer (``weights_proj`` is used in fp32, as transformers keeps it)."""
    dim = cfg.index_head_dim
    return {
        prefix + "wq_b.weight": Expected((cfg.index_n_heads * dim, cfg.q_lora_rank), LINEAR),
        prefix + "wk.weight": Expected((dim, cfg.hidden_size), LINEAR),
        prefix + "k_norm.weight": Expected((dim,), FLOAT),
        prefix + "k_norm.bias": Expected((dim,), FLOAT),
        prefix + "weights_proj.weight": Expected((cfg.index_n_heads, cfg.hidden_size), FP32),
    }


def mlp_keys(cfg: ModelConfig, layer: int, m: str) -> dict[str, Expected]:
    """The tensors of layer ``layer``'s MLP under the prefix ``m`` (``model.layers.{i}.mlp.``): a dense SwiGLU, or
    the router, the routed experts and the shared experts."""
    return dict(_mlp_items(cfg, layer, m))


def _mlp_items(cfg: ModelConfig, layer: int, m: str) -> Iterator[tuple[str, Expected]]:
    h = cfg.hidden_size
    if not cfg.is_moe_layer(layer):
        yield from _mlp(m, h, cfg.intermediate_size)
        return
    yield m + "gate.weight", Expected((cfg.n_routed_experts, h), FP32)
    if cfg.scoring_func == "sigmoid":
        yield m + "gate.e_score_correction_bias", Expected((cfg.n_routed_experts,), FP32)
    for e in range(cfg.n_routed_experts):
        yield from _mlp(f"{m}experts.{e}.", h, cfg.moe_intermediate_size)
    if cfg.n_shared_experts:
        yield from _mlp(m + "shared_experts.", h, cfg.moe_intermediate_size * cfg.n_shared_experts)


def mtp_layer_keys(cfg: ModelConfig, layer: int) -> dict[str, Expected]:
    """The tensors of the multi-token-prediction layer ``layer`` (``num_hidden_layers + i``), as DeepSeek writes
    them: ``enorm`` and ``hnorm`` (the token's embedding and the previous hidden state), ``eh_proj`` (their
    concatenation projected back to the hidden size), a whole decoder layer (its MLP dense or MoE by the same
    index rule), and ``shared_head.norm``; ``embed_tokens`` and ``shared_head.head`` are optional (the model's
    own are shared with it, and some checkpoints leave the copies out)."""
    h, v, p = cfg.hidden_size, cfg.vocab_size, f"model.layers.{layer}."
    out = {
        p + "enorm.weight": Expected((h,), FLOAT),
        p + "hnorm.weight": Expected((h,), FLOAT),
        p + "eh_proj.weight": Expected((h, 2 * h), LINEAR),
        **decoder_layer_keys(cfg, layer),
        p + "shared_head.norm.weight": Expected((h,), FLOAT),
        p + "shared_head.head.weight": Expected((v, h), LINEAR, optional=True),
        p + "embed_tokens.weight": Expected((v, h), FLOAT, optional=True),
    }
    return {n: replace(e, mtp=True) for n, e in out.items()}


def _mlp(prefix: str, hidden: int, inter: int) -> Iterator[tuple[str, Expected]]:
    yield prefix + "gate_proj.weight", Expected((inter, hidden), LINEAR)
    yield prefix + "up_proj.weight", Expected((inter, hidden), LINEAR)
    yield prefix + "down_proj.weight", Expected((hidden, inter), LINEAR)


FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
              (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))  # fmt: skip


def check_regular_file(file: Path, mode: int) -> None:
    """``CheckpointError`` unless ``mode`` (of ``file``, symlinks followed) is a regular file's: opening a FIFO
    blocks until a writer comes, and a device may never end."""
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in FILE_KINDS if test(mode)), "not a file")
        raise CheckpointError(f"{file}: not a regular file ({kind}); checkpoint files must be regular files")


def read_header(file: Path) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, from its header alone; checks the header against the file size.
    Anything but a regular file (symlinks followed) is refused before it is opened."""
    try:
        check_regular_file(file, file.stat().st_mode)
        # Non-blocking, so that a file swapped for a FIFO after the check cannot block the open either.
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            check_regular_file(file, st.st_mode)
            size = st.st_size
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file}: truncated or not a safetensors file ({size} bytes, no header)")
            n = int.from_bytes(head, "little")
            if n > min(size - 8, MAX_HEADER_BYTES):
                raise CheckpointError(
                    f"{file}: truncated or corrupt: the header claims {n} bytes but the file has {size - 8} after "
                    "the length field"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{file}: cannot be read: {e}") from e
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError(f"a JSON {type(header).__name__}, not an object")
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{file}: corrupt safetensors header (not a JSON object): {e}") from e
    data_bytes = size - 8 - n
    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    end_max = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            if not isinstance(dtype, str):
                raise ValueError("a dtype that is not a string")
            if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in (*shape, start, end)):
                raise ValueError("negative or non-integer sizes")
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{file}: corrupt header entry for tensor {name!r}: {info!r} ({e})") from e
        if dtype not in DTYPES:
            raise CheckpointError(f"{file}: tensor {name!r} has dtype {dtype}, which the model cannot use")
        need = math.prod(shape) * DTYPES[dtype][1]
        if end - start != need:
            raise CheckpointError(
                f"{file}: corrupt header: tensor {name!r} {dtype}{list(shape)} needs {need} bytes, its offsets "
                f"span {end - start}"
            )
        if end > data_bytes:
            raise CheckpointError(
                f"{file}: truncated: tensor {name!r} ends at byte {end} of the data but the file holds only "
                f"{data_bytes} bytes of data"
            )
        end_max = max(end_max, end)
        spans.append((start, end, name))
        tensors[name] = TensorInfo(file, dtype, shape)
    if end_max != data_bytes:
        raise CheckpointError(
            f"{file}: corrupt: the header describes {end_max} bytes of data but the file holds {data_bytes}"
        )
    # As safetensors itself requires when the file is opened: the tensors' bytes tile the data, in offset order,
    # with no gap and no overlap (checked here, so that the file is refused before any weight is read).
    at = 0
    for start, end, name in sorted(spans):
        if start != at:
            what = "it overlaps the tensor before it" if start < at else f"it leaves bytes {at} .. {start} unused"
            where = f"tensor {name!r} starts at byte {start} of the data, expected {at}"
            raise CheckpointError(f"{file}: corrupt header: {where} ({what})")
        at = end
    return tensors


def read_tensors(path: Path) -> dict[str, TensorInfo]:
    """Every tensor of a checkpoint directory by name, from its files' headers (each checked by ``read_header``); a
    name in two files, or an index entry naming the wrong file or no tensor, is a ``CheckpointError``."""
    tensors: dict[str, TensorInfo] = {}
    for file in find_files(path):
        for name, info in read_header(file).items():
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} is in both {tensors[name].file} and {file}")
            tensors[name] = info
    index = path / INDEX_FILE
    if index.is_file():  # find_files has checked that it reads as an index
        for name, file in json.loads(index.read_text())["weight_map"].items():
            if name not in tensors or tensors[name].file.name != file:
                where = f"it is in {tensors[name].file}" if name in tensors else "no file holds it"
                raise CheckpointError(f"{index}: maps tensor {name!r} to {file} but {where}")
    return tensors


def find_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (from the index when there is one)."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory (expected a Hugging Face layout checkpoint directory)")
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a valid index (needs a 'weight_map' object): {e}") from e
        for name in files:
            if not isinstance(name, str) or not name.endswith(".safetensors") or "/" in name or "\\" in name:
                raise CheckpointError(f"{index}: refers to {name!r}; only safetensors files in this directory")
            if not (path / name).exists():
                raise CheckpointError(f"{index}: refers to {name}, which is missing from {path}")
            check_regular_file(path / name, (path / name).stat().st_mode)
        single = path / "model.safetensors"
        if single.exists() and single.name not in files:  # transformers would load that one and not the index's
            raise CheckpointError(
                f"{path}: holds both {single.name} and {INDEX_FILE}, which does not list it: two checkpoints in one "
                f"directory (transformers loads {single.name}); keep one"
            )
        return [path / n for n in files]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(
                f"{path}: holds only pickle checkpoint files ({', '.join(pickles)}); they are refused because "
                "loading them can run arbitrary code. Convert the checkpoint to safetensors."
            )
        raise CheckpointError(f"{path}: no *.safetensors files")
    return files


def _check_counts(path: Path, cfg: ModelConfig, tensors: dict[str, TensorInfo]) -> None:
    """Refuses a ``config.json`` that implies more tensors than the files hold, before its layout is built: the
    counts in it (``num_hidden_layers``, ``n_routed_experts``) are then bounded by the headers, and an absurd one
    costs no more than the files' own size. Names the first missing tensor, as the full check would."""
    want = model_layout_size(cfg)
    have = sum(not n.endswith(SCALE_SUFFIX) for n in tensors)
    if want <= have:
        return
    # More tensors are implied than exist, so one of the first have + 1 implied names is missing.
    first = next(n for n, _ in _model_items(cfg) if n not in tensors)
    files = ", ".join(sorted({i.file.name for i in tensors.values()})) or "no tensors at all"
    raise CheckpointError(
        f"{path}: missing tensor {first!r}: config.json (num_hidden_layers = {cfg.num_hidden_layers}, "
        f"n_routed_experts = {cfg.n_routed_experts}, first_k_dense_replace = {cfg.first_k_dense_replace}) implies "
        f"{want} tensors, the files hold {have} (searched {files})"
    )


@dataclass
class Checkpoint:
    """A checked checkpoint directory. ``tensors``: every tensor by name; ``layout``: the tensors the model loads
    (``expected_layout`` less the MTP layers); ``mtp_layout``: those of the multi-token-prediction layers;
    ``mtp_keys``: the MTP tensors this checkpoint holds (read for speculative decoding; empty when it has none);
    ``bytes_read``: bytes returned by ``read`` so far."""

    path: Path
    config: ModelConfig
    tensors: dict[str, TensorInfo]
    layout: dict[str, Expected]
    mtp_layout: dict[str, Expected] = field(default_factory=dict)
    mtp_keys: list[str] = field(default_factory=list)
    bytes_read: int = 0
    _handles: dict[Path, object] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, path: str | Path, config: ModelConfig | None = None) -> Checkpoint:
        path = Path(path)
        config = config or ModelConfig.from_dir(path)
        tensors = read_tensors(path)
        _check_counts(path, config, tensors)
        expected = expected_layout(config)
        layout = {n: e for n, e in expected.items() if not e.mtp}
        ckpt = cls(path, config, tensors, layout, {n: e for n, e in expected.items() if e.mtp})
        ckpt._check()
        return ckpt

    def _check(self) -> None:
        cfg, layout, mtp_layout = self.config, self.layout, self.mtp_layout
        expected = {**layout, **mtp_layout}
        seen: set[str] = set()
        for name, info in sorted(self.tensors.items()):
            if self._empty_shared_expert(name.removesuffix(SCALE_SUFFIX)):
                continue
            if name.endswith(SCALE_SUFFIX):
                weight = name[: -len(SCALE_SUFFIX)]
                if weight not in expected or expected[weight].kind != LINEAR:
                    raise CheckpointError(f"{info.file}: unexpected tensor {name!r} (no FP8 linear weight {weight!r})")
                if weight in mtp_layout:
                    self.mtp_keys.append(name)
                continue
            if name not in expected:
                raise CheckpointError(f"{info.file}: unexpected tensor {name!r} (not part of {self._described()})")
            seen.add(name)
            self._check_tensor(name, info, expected[name])
            if name in mtp_layout:
                self.mtp_keys.append(name)
        expert_kinds: dict[str, set[bool]] = {}
        for n in expected:  # the multi-token-prediction layers' experts are stacked alike
            if ".mlp.experts." in n and n in self.tensors:
                expert_kinds.setdefault(n.split(".")[2], set()).add(self.tensors[n].dtype == "F8_E4M3")
        for layer, kinds in expert_kinds.items():
            if len(kinds) > 1:
                raise CheckpointError(
                    f"{self.path}: the routed experts of layer {layer} mix FP8 and float weights; they are stacked "
                    "into one tensor per layer, so they must all be FP8 or all float"
                )
        missing = [n for n in layout if n not in seen]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            files = ", ".join(sorted({i.file.name for i in self.tensors.values()})) or "no tensors at all"
            raise CheckpointError(
                f"{self.path}: missing tensor {missing[0]!r}{more}, which config.json implies (searched {files})"
            )
        missing = [n for n, e in mtp_layout.items() if n not in seen and not e.optional]
        if self.mtp_keys and missing:  # no MTP tensor at all is fine: serving never needs them
            layer = int(missing[0].split(".")[2])
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise CheckpointError(
                f"{self.path}: incomplete multi-token-prediction layer {layer}: missing tensor {missing[0]!r}{more}; "
                f"config.json declares num_hidden_layers = {cfg.num_hidden_layers} and num_nextn_predict_layers = "
                f"{cfg.num_nextn_predict_layers}, so a checkpoint holds all its MTP layers, complete, or none "
                "(does num_hidden_layers match the weights?)"
            )

    def _empty_shared_expert(self, name: str) -> bool:
        """Whether ``name`` is a shared expert's weight with no elements where config.json has ``n_shared_experts:
        0``: transformers builds that expert with an intermediate size of 0 and writes its empty weights."""
        info = self.tensors.get(name)
        return (
            self.config.n_shared_experts == 0
            and ".mlp.shared_experts." in name
            and info is not None
            and 0 in info.shape
        )

    def _described(self) -> str:
        cfg = self.config
        mtp = cfg.num_nextn_predict_layers
        with_mtp = f" plus {mtp} multi-token-prediction layer{'s' if mtp > 1 else ''}" if mtp else ""
        return f"the {cfg.num_hidden_layers}-layer {cfg.model_type} layout{with_mtp} config.json describes"

    def _check_tensor(self, name: str, info: TensorInfo, want: Expected) -> None:
        if info.shape != want.shape:
            raise CheckpointError(
                f"{info.file}: tensor {name!r} has shape {list(info.shape)}, config.json implies {list(want.shape)}"
            )
        scale = self.tensors.get(name + SCALE_SUFFIX)
        if info.dtype == "F8_E4M3" and want.kind == LINEAR:
            fp8 = self.config.fp8
            if fp8 is None:
                raise CheckpointError(
                    f"{info.file}: tensor {name!r} is FP8 but config.json has no fp8 quantization_config"
                )
            if scale is None:
                raise CheckpointError(f"{info.file}: FP8 tensor {name!r} has no {name + SCALE_SUFFIX!r}")
            want_scale = tuple(math.ceil(s / b) for s, b in zip(info.shape, fp8.block))
            if scale.shape != want_scale or scale.dtype not in (*FLOAT_KINDS, "F8_E8M0"):  # E8M0: ue8m0 scales
                raise CheckpointError(
                    f"{scale.file}: tensor {name + SCALE_SUFFIX!r} is {scale.dtype}{list(scale.shape)}, expected "
                    f"float or F8_E8M0 {list(want_scale)} (one scale per {fp8.block[0]}x{fp8.block[1]} block of "
                    f"{name!r})"
                )
            if info.shape[1] % fp8.block[1]:
                raise CheckpointError(
                    f"{info.file}: FP8 tensor {name!r} has K = {info.shape[1]} input features, not a multiple of "
                    f"{fp8.block[1]}; FP8 GEMMs need whole K blocks"
                )
            return
        if scale is not None:
            raise CheckpointError(f"{scale.file}: unexpected tensor {name + SCALE_SUFFIX!r}: {name!r} is not FP8")
        if info.dtype not in FLOAT_KINDS:
            kinds = "bf16, fp16, fp32 or FP8 e4m3 with block scales" if want.kind == LINEAR else "bf16, fp16 or fp32"
            raise CheckpointError(f"{info.file}: tensor {name!r} has dtype {info.dtype}; expected {kinds}")

    def is_fp8(self, name: str) -> bool:
        return self.tensors[name].dtype == "F8_E4M3"

    def nbytes(self, name: str) -> int:
        info = self.tensors[name]
        total = math.prod(info.shape) * DTYPES[info.dtype][1]
        scale = self.tensors.get(name + SCALE_SUFFIX)
        if scale is not None:
            total += math.prod(scale.shape) * DTYPES[scale.dtype][1]
        return total

    def _raw(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        handle = self._handles.get(info.file)
        if handle is None:
            try:
                handle = safe_open(str(info.file), framework="pt")
            except Exception as e:  # safetensors raises its own error type
                raise CheckpointError(f"{info.file}: cannot be opened as safetensors: {e}") from e
            self._handles[info.file] = handle
        try:
            return handle.get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{info.file}: tensor {name!r} cannot be read: {e}") from e

    def read(self, name: str, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor | QTensor:
        """Tensor ``name`` on ``device``: FP8 weights as a ``QTensor`` (block (128, 128), scales fp32; a NaN or
        infinite scale is a ``CheckpointError``), any other as a ``dtype`` tensor."""
        if self.is_fp8(name):
            fp8 = self.config.fp8
            data = self._raw(name).to(device)
            scale = self._raw(name + SCALE_SUFFIX).float()
            if not bool(torch.isfinite(scale).all()):  # every value of such a block would be NaN or inf
                bad = scale[~torch.isfinite(scale)][0].item()
                raise CheckpointError(
                    f"{self.tensors[name + SCALE_SUFFIX].file}: tensor {name + SCALE_SUFFIX!r} holds a scale of {bad}, "
                    "expected finite scales"
                )
            scale = scale.to(device)
            out: torch.Tensor | QTensor = QTensor(data, scale, fp8.block, fp8.scale_format)
        else:
            out = self._raw(name).to(device=device, dtype=dtype)
        self.bytes_read += self.nbytes(name)
        return out

    def total_bytes(self, names) -> int:
        return sum(self.nbytes(n) for n in names)

    def close(self) -> None:
        self._handles.clear()
