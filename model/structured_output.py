"""Structured output: a request's generated text held to a JSON schema, a regular expression, a grammar or a list of
choices, through the llguidance grammar engine (the names are vLLM's).

``StructuredOutputsParams`` names the constraint; ``Grammars`` compiles it against a checkpoint's tokenizer (once per
distinct constraint, kept for the most recent 256) and hands each request a copy of the compiled matcher. Each
step the engine asks every constrained request's matcher for its allowed tokens (a ``[ceil(V / 32)]`` int32
bitmask, written by llguidance straight into a host tensor), applies it with ``deepinfer.ops.apply_token_bitmask``
before sampling, and feeds the sampled token back; a request whose grammar is complete can only end (its
end-of-sequence token); one whose matcher refuses the sampled token (it is in error) ends with finish reason
``error``. A step with constrained requests is not launched before the previous step's tokens are
known, since its masks depend on them.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import RequestError, StructuredOutputError


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint. json: a JSON schema (a dict, or its JSON text), generated with the separators alone
    between tokens (llguidance's ``whitespace_flexible`` off, unless the schema's own ``x-guidance`` turns it on;
    its other options there are kept); regex: the whole generated text matches it; grammar: a Lark or GBNF grammar;
    choice: the text is one of these strings."""

    json: dict | str | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        given = [n for n in ("json", "regex", "grammar", "choice") if getattr(self, n) is not None]
        if len(given) != 1:
            raise StructuredOutputError(
                f"StructuredOutputsParams: exactly one of json, regex, grammar, choice must be given, got {given}"
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise StructuredOutputError(
                f"StructuredOutputsParams: json must be a schema (dict or JSON text), got {self.json!r}"
            )
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise StructuredOutputError(
                    f"StructuredOutputsParams: {name} must be a string, got {getattr(self, name)!r}"
                )
        choice = self.choice
        if choice is not None and (
            not isinstance(choice, (list, tuple)) or not all(isinstance(c, str) for c in choice)
        ):
            choice = None
        if self.choice is not None and not choice:
            raise StructuredOutputError(
                f"StructuredOutputsParams: choice must be a non-empty list of strings, got {self.choice!r}"
            )

    def key(self) -> tuple[str, str]:
        """``(format, text)`` as llguidance's ``grammar_from`` takes them; also the compilation cache's key."""
        if self.json is not None:
            try:
                schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            except ValueError as e:
                raise StructuredOutputError(f"structured output: invalid json_schema: not JSON: {e}") from e
            options = schema.get("x-guidance", {}) if isinstance(schema, dict) else None
            if isinstance(options, dict):  # no free whitespace (a model can wander off into it) unless the schema asks
                schema = {**schema, "x-guidance": {"whitespace_flexible": False, **options}}
            # keys in the schema's order: llguidance generates an object's properties in the order they are declared
            return "json_schema", json.dumps(schema)
        if self.regex is not None:
            return "regex", self.regex
        if self.grammar is not None:
            return "grammar", self.grammar
        return "choice", json.dumps(list(self.choice))


class Grammars:
    """The grammar engine bound to one checkpoint's tokenizer (``tokenizer.json``) and vocabulary. Safe to call from
    several threads (compilation releases the GIL, so a server compiles on threads of its own while it steps)."""

    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_ids: tuple[int, ...]):
        try:
            import llguidance
        except ImportError as e:  # a dependency of deepinfer; only structured output needs it
            raise RequestError(f"structured output needs the llguidance package (pip install llguidance): {e}") from e
        self._ll = llguidance
        self.tokenizer = llguidance.LLTokenizer(
            Path(tokenizer_file).read_text(), n_vocab=vocab_size, eos_token=list(eos_ids)
        )

    @functools.lru_cache(maxsize=256)  # noqa: B019 (one instance per LLM; the cache is meant to live with it)
    def _pristine(self, fmt: str, text: str) -> Any:
        """The compiled matcher of one constraint, never fed a token: requests get copies of it."""
        return self._compile(fmt, text)

    def _compile(self, fmt: str, text: str) -> Any:
        try:
            grammar = self._ll.grammar_from(fmt, text)
        except ValueError as e:
            raise StructuredOutputError(f"structured output: invalid {fmt}: {' '.join(str(e).split())}") from e
        # log_level 0: a matcher's errors reach the request's stop_reason, not stderr
        m = self._ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():  # the engine's message spans lines (a caret under the fault): one line here
            raise StructuredOutputError(f"structured output: invalid {fmt}: {' '.join(m.get_error().split())}")
        return m

    def matcher(self, params: StructuredOutputsParams) -> Any:
        """A fresh matcher for one request (a copy of the constraint's compiled one, compiled on its first use and
        kept for the 256 most recent constraints); ``StructuredOutputError`` for a constraint the engine cannot
        compile."""
        return self._pristine(*params.key()).deep_copy()


def matcher_error(matcher: Any) -> str:
    """The first line of a matcher's error (llguidance adds its parser state on the lines after)."""
    lines = matcher.get_error().strip().splitlines()
    return lines[0] if lines else "the grammar refused the token"


def allowed_tokens(matchers: list[tuple[Any, list[int]]], vocab_size: int, pin: bool = False) -> torch.Tensor:
    """int32 on the host, ``ceil(vocab_size / 32)`` words a row, in the layout ``deepinfer.ops.apply_token_bitmask``
    takes: per ``(matcher, drafts)``, ``1 + len(drafts)`` rows, row ``i`` the tokens the matcher allows after
    ``drafts[:i]`` (speculative decoding verifies a row per draft). Past a draft the grammar refuses, rows repeat
    the last mask (no later draft can be accepted there). Each matcher is left as it was (drafts rolled back).
    ``pin``: in page-locked memory, for an asynchronous copy to an accelerator (torch's host allocator reuses the
    block once the copies that read it are done)."""
    words = (vocab_size + 31) // 32
    mask = torch.empty(sum(1 + len(d) for _, d in matchers), words, dtype=torch.int32, pin_memory=pin)
    row_bytes = 4 * words
    base = mask.data_ptr()
    row = 0
    for m, drafts in matchers:
        m.unsafe_compute_mask_ptr(base + row * row_bytes, row_bytes)  # every word of the row written
        consumed = 0
        for i, token in enumerate(drafts, 1):
            if m.is_stopped() or m.try_consume_tokens([token]) != 1:
                mask[row + i : row + 1 + len(drafts)] = mask[row + i - 1]
                break
            consumed += 1
            m.unsafe_compute_mask_ptr(base + (row + i) * row_bytes, row_bytes)
        if consumed:
            m.rollback(consumed)
        row += 1 + len(drafts)
    return mask
