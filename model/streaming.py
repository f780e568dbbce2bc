"""Incremental outputs: what one request has produced since it was last looked at, as text and tokens, with stop
strings applied.

``RequestStream`` follows one engine ``Sequence`` between steps. Each ``update`` returns a ``StreamDelta`` with the
tokens read back since the previous one (never a token still being sampled) and the text they add. Text is decoded
from all generated tokens each time, and characters that may still change are held back: a trailing incomplete
UTF-8 sequence (decoded as U+FFFD) and, while the request has stop strings, the last ``len(longest stop) - 1``
characters, which could be the start of a stop string. When a stop string appears (of several, the one the text
completes first), the text ends before it (or after it with ``include_stop_str_in_output``), the request's tokens
end with the one that completes it (a step that added more, under speculative decoding, has those dropped), and the
request is ended in the engine at once (its pages freed) with ``finish_reason="stop"`` and ``stop_reason`` the string,
as vLLM reports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import PENDING, Sequence, Status
from .tokenizer import Tokenizer


@dataclass
class StreamDelta:
    """What a request added since the previous delta. ``token_ids`` and ``logprobs``/``top_logprobs`` (when asked)
    are the new tokens; ``text`` the new text. ``finished``: the request is over; then ``finish_reason`` (``stop``,
    ``length``, ``abort`` or ``error``, as ``CompletionOutput``'s) and ``stop_reason`` (a stop token id, a stop string,
    the grammar error's message, or None) are set, and
    ``num_prompt_tokens``, ``num_generated`` and ``num_cached_tokens`` give its usage."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_generated: int = 0
    num_cached_tokens: int = 0


class RequestStream:
    """Follows ``seq`` and hands out its output piece by piece (see the module docstring). ``stop``: stop strings
    (an empty list for none). Without a tokenizer ``text`` stays empty and only tokens are reported. Call ``update``
    from the thread that steps ``engine``, between steps."""

    def __init__(
        self,
        seq: Sequence,
        tokenizer: Tokenizer | None,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ):
        self.seq, self.tokenizer = seq, tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.include_stop = include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # the text handed out so far
        self.sent_tokens = 0
        self.finished = False
        self._searched = 0  # stop strings were looked for in the text before this offset

    def update(self, engine) -> StreamDelta | None:
        """The next delta, or None when nothing new is ready. Ends the request in ``engine`` (``engine.abort``) when
        a stop string is found."""
        if self.finished:
            return None
        seq = self.seq
        ids = seq.generated_ids
        ready = ids.index(PENDING) if PENDING in ids else len(ids)
        done = seq.status is Status.FINISHED
        text = self._visible_text(ids[:ready], final=done)
        if self.stop and self.tokenizer is not None:
            hit = self._find_stop(text)
            if hit is not None:
                where, stop = hit
                text = text[: where + len(stop)] if self.include_stop else text[:where]
                ready = self._trim_after(ids[:ready], where + len(stop))
                if not done:
                    engine.abort(seq, "stop", stop)
                else:
                    seq.finish_reason, seq.stop_reason = "stop", stop
                done = True
            elif not done and self.hold:
                text = text[: max(len(text) - self.hold, len(self.text))]
        new_text = text[len(self.text) :] if text.startswith(self.text) else ""
        if len(text) > len(self.text):
            self.text = text
        new_ids = ids[self.sent_tokens : ready]
        if not new_ids and not new_text and not done:
            return None
        delta = StreamDelta(text=new_text, token_ids=new_ids, finished=done)
        if seq.params.logprobs is not None:
            delta.logprobs = seq.logprobs[self.sent_tokens : ready]
            if seq.params.logprobs:
                delta.top_logprobs = seq.top_logprobs[self.sent_tokens : ready]
        self.sent_tokens = ready
        if done:
            self.finished = True
            delta.finish_reason, delta.stop_reason = seq.finish_reason, seq.stop_reason
            delta.num_prompt_tokens = seq.num_prompt_tokens
            delta.num_generated = len(seq.generated_ids)
            delta.num_cached_tokens = seq.num_cached_tokens
        return delta

    def _trim_after(self, ids: list[int], end: int) -> int:
        """The fewest of ``ids`` (the tokens read back, past those already handed out) whose text reaches offset
        ``end``, where a stop string ends; the sequence's tokens (and log-probabilities) after them are dropped. A step
        that adds several tokens (speculative decoding) can add some after the one that completes the stop string;
        decoding one token a step, the request ends with that one."""
        keep = len(ids)
        for j in range(self.sent_tokens + 1, len(ids)):
            if len(self._visible_text(ids[:j], final=False)) >= end:
                keep = j
                break
        seq = self.seq
        del seq.token_ids[seq.num_prompt_tokens + keep :]
        del seq.logprobs[keep:]
        del seq.top_logprobs[keep:]
        return keep

    def _visible_text(self, ids: list[int], final: bool) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(ids, self.seq.params.skip_special_tokens)
        if not final:
            text = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence so far: wait for its next token
        return text

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The stop string of ``text`` that ends first (of two ending together, the one that starts first), looked
        for from the part already searched less the longest stop string (which may straddle it); with its offset.

        The one that ends first is the one the text met first, character by character: so the cut depends on the
        text alone, never on how many tokens a step added (one, or several with speculative decoding) nor on where
        the tokens' boundaries fall."""
        start = max(0, self._searched - self.hold)
        best = None
        for stop in self.stop:
            at = text.find(stop, start)
            if at >= 0 and (best is None or (at + len(stop), at) < (best[0] + len(best[1]), best[0])):
                best = (at, stop)
        self._searched = len(text)
        return best
