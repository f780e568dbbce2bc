"""Structured output: a request's generated text held to a JSON schema, a regular expression, a grammar or a list of
choices, through the llguidance grammar engine (the names are vLLM's).

``StructuredOutputsParams`` names the constraint; ``Grammars`` compiles it against a checkpoint's tokenizer (once per
distinct constraint) into one matcher per request. Each step the engine asks every constrained request's matcher for
its allowed tokens (a ``[ceil(V / 32)]`` int32 bitmask), applies it with ``deepinfer.ops.apply_token_bitmask``
before sampling, and feeds the sampled token back; a request whose grammar is complete can only end (its
end-of-sequence token). A step with constrained requests is not launched before the previous step's tokens are
known, since its masks depend on them.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import RequestError


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint. json: a JSON schema (a dict, or its JSON text), generated with the separators alone
    between tokens (llguidance's ``whitespace_flexible`` off, unless the schema's own ``x-guidance`` says
    otherwise); regex: the whole generated text matches it; grammar: a Lark or GBNF grammar; choice: the text is one
    of these strings."""

    json: dict | str | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        given = [n for n in ("json", "regex", "grammar", "choice") if getattr(self, n) is not None]
        if len(given) != 1:
            raise RequestError(
                f"StructuredOutputsParams: exactly one of json, regex, grammar, choice must be given, got {given}"
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise RequestError(f"StructuredOutputsParams: json must be a schema (dict or JSON text), got {self.json!r}")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise RequestError(f"StructuredOutputsParams: {name} must be a string, got {getattr(self, name)!r}")
        choice = self.choice
        if choice is not None and (
            not isinstance(choice, (list, tuple)) or not all(isinstance(c, str) for c in choice)
        ):
            choice = None
        if self.choice is not None and not choice:
            raise RequestError(
                f"StructuredOutputsParams: choice must be a non-empty list of strings, got {self.choice!r}"
            )

    def key(self) -> tuple[str, str]:
        """``(format, text)`` as llguidance's ``grammar_from`` takes them; also the compilation cache's key."""
        if self.json is not None:
            try:
                schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            except ValueError as e:
                raise RequestError(f"structured output: invalid json_schema: not JSON: {e}") from e
            if isinstance(schema, dict):  # no free whitespace (a model can wander off into it) unless the schema asks
                schema = {"x-guidance": {"whitespace_flexible": False}, **schema}
            return "json_schema", json.dumps(schema, sort_keys=True)
        if self.regex is not None:
            return "regex", self.regex
        if self.grammar is not None:
            return "grammar", self.grammar
        return "choice", json.dumps(list(self.choice))


class Grammars:
    """The grammar engine bound to one checkpoint's tokenizer (``tokenizer.json``) and vocabulary."""

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
    def _grammar(self, fmt: str, text: str) -> str:
        try:
            grammar = self._ll.grammar_from(fmt, text)
        except ValueError as e:
            raise RequestError(f"structured output: invalid {fmt}: {' '.join(str(e).split())}") from e
        error = self._ll.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:  # the engine's message spans lines (a caret under the fault): one line here
            raise RequestError(f"structured output: invalid {fmt}: {' '.join(error.split())}")
        return grammar

    def matcher(self, params: StructuredOutputsParams) -> Any:
        """A fresh matcher for one request; ``RequestError`` for a constraint the engine cannot compile."""
        m = self._ll.LLMatcher(self.tokenizer, self._grammar(*params.key()))
        if m.is_error():
            raise RequestError(f"structured output: {m.get_error()}")
        return m


def allowed_tokens(matchers: list[tuple[Any, list[int]]], vocab_size: int) -> torch.Tensor:
    """int32 on the host, ``ceil(vocab_size / 32)`` words a row, in the layout ``deepinfer.ops.apply_token_bitmask``
    takes: per ``(matcher, drafts)``, ``1 + len(drafts)`` rows, row ``i`` the tokens the matcher allows after
    ``drafts[:i]`` (speculative decoding verifies a row per draft). Past a draft the grammar refuses, rows repeat
    the last mask (no later draft can be accepted there). Each matcher is left as it was (drafts rolled back)."""
    from llguidance.torch import fill_next_token_bitmask

    mask = torch.zeros(sum(1 + len(d) for _, d in matchers), (vocab_size + 31) // 32, dtype=torch.int32)
    row = 0
    for m, drafts in matchers:
        fill_next_token_bitmask(m, mask, row)
        consumed = 0
        for i, token in enumerate(drafts, 1):
            if m.is_stopped() or m.try_consume_tokens([token]) != 1:
                mask[row + i : row + 1 + len(drafts)] = mask[row + i - 1]
                break
            consumed += 1
            fill_next_token_bitmask(m, mask, row + i)
        if consumed:
            m.rollback(consumed)
        row += 1 + len(drafts)
    return mask
