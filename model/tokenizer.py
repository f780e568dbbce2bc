"""``Tokenizer``: a checkpoint's ``tokenizer.json``, read with the ``tokenizers`` library (no remote code)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from .errors import CheckpointError


class Tokenizer:
    """Encodes text to token ids and back. ``bos_id`` is prepended when ``tokenizer_config.json`` asks for it
    (``add_bos_token``) and the tokenizer's own post-processor does not add it."""

    def __init__(self, tok: _HFTokenizer, bos_id: int | None = None):
        self._tok, self.bos_id = tok, bos_id

    @classmethod
    def from_dir(cls, path: str | Path, bos_token_id: int | None = None) -> Tokenizer | None:
        """The tokenizer of a checkpoint directory, or None when it has no ``tokenizer.json``."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            if file.exists():  # a FIFO would block the read
                raise CheckpointError(f"{file}: not a regular file")
            return None
        try:
            tok = _HFTokenizer.from_file(str(file))
        except Exception as e:  # the tokenizers library raises its own exception type
            raise CheckpointError(f"{file}: not a valid tokenizer.json: {e}") from e
        bos = None
        config = path / "tokenizer_config.json"
        if config.is_file():
            try:
                if json.loads(config.read_text()).get("add_bos_token"):
                    bos = bos_token_id
            except (OSError, ValueError, AttributeError) as e:
                raise CheckpointError(f"{config}: not valid JSON: {e}") from e
        return cls(tok, bos)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. ``add_special_tokens=False``: none added (neither the post-processor's nor the
        BOS), for text that already holds them, such as a rendered chat template."""
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
