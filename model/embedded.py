"""The embedded model: a small DeepSeek-V3-architecture model trained on the Python standard library's source code.

It ships inside the package (``checkpoint_dir()``), in the Hugging Face layout a user's checkpoint has
(``config.json``, ``model.safetensors``, ``tokenizer.json``), in two variants: ``bf16`` and ``fp8`` (DeepSeek's
128x128 block-scaled e4m3 linears). It has one multi-token-prediction layer under DeepSeek's key names. It is the
default model of ``deepinfer generate`` and the fixture of every test that needs a real next-token distribution.

Its corpus exists offline on every machine: the ``.py`` files of the running interpreter's standard library
(``stdlib_documents``). A file belongs to the held-out split when the first byte of the SHA-256 of its path relative
to the library root is below 13 (about 5% of the files), so the split is the same on every Python version and a
held-out file is never trained on, whatever the version that trained the model. ``training/train_embedded.py``
trains it; ``checkpoints/tiny-py/README.md`` (its card) and ``training.json`` beside it record how, on what data, and
how well.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

NAME = "tiny-py"
VARIANTS = ("bf16", "fp8")
HELDOUT_BELOW = 13  # of 256: the held-out share of files


@dataclass(frozen=True)
class Document:
    """One source file of the corpus: its path relative to the library root, and its text."""

    path: str
    text: str


def checkpoint_dir(variant: str = "bf16") -> Path:
    """The directory of the embedded model's ``variant`` (``bf16`` or ``fp8``)."""
    if variant not in VARIANTS:
        raise ValueError(f"embedded model variant must be one of {list(VARIANTS)}, got {variant!r}")
    return Path(__file__).parent / "checkpoints" / NAME / variant


def default_checkpoint() -> Path:
    """The model ``LLM()`` and ``deepinfer generate`` run when given none: the embedded model, bf16."""
    return checkpoint_dir("bf16")


def is_heldout(path: str) -> bool:
    """Whether the corpus file at ``path`` (relative to the library root, ``/``-separated) is held out."""
    return hashlib.sha256(path.encode()).digest()[0] < HELDOUT_BELOW


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_documents(split: str, root: Path | None = None) -> list[Document]:
    """The corpus files of ``split`` (``train`` or ``heldout``), sorted by path: every ``*.py`` file under the
    standard library's root that is UTF-8 text, outside ``site-packages`` and ``__pycache__``."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    root = stdlib_root() if root is None else root
    out = []
    for file in sorted(root.rglob("*.py")):
        rel = file.relative_to(root).as_posix()
        parts = rel.split("/")
        if "site-packages" in parts or "__pycache__" in parts or is_heldout(rel) != (split == "heldout"):
            continue
        try:
            text = file.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        out.append(Document(rel, text))
    return out


def token_stream(encode: Callable[[str], list[int]], eos_id: int, docs: list[Document]) -> list[int]:
    """Every document as ``encode(text)`` (begin-of-sentence first, as the tokenizer adds it), then ``eos_id``: the
    stream the model was trained and is evaluated on."""
    out: list[int] = []
    for d in docs:
        out += encode(d.text)
        out.append(eos_id)
    return out


def windows(stream: list[int], seq_len: int) -> list[list[int]]:
    """``stream`` cut into windows of ``seq_len + 1`` tokens, each sharing its first token with the previous
    window's last, so that every token but the first is predicted exactly once (the last window may be shorter)."""
    return [stream[i : i + seq_len + 1] for i in range(0, len(stream) - 1, seq_len)]


def unigram_bits(train: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> float:
    """The baseline the model's held-out figure stands beside: the summed negative log-probability, in bits, of
    ``targets`` under the token frequencies of ``train`` (both int64 token ids), add-one smoothed."""
    freq = torch.bincount(train, minlength=vocab_size).double() + 1
    return -(freq / freq.sum()).log2()[targets].sum().item()
