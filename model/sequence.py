"""``Sequence``: the state of one request inside the engine."""

from __future__ import annotations

import enum
from typing import Any

from .sampling_params import SamplingParams

PENDING = -1  # in ``Sequence.token_ids``: a token sampled by a step that is still running on the device


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted by recomputation
    RUNNING = "running"  # holds cache blocks; prefilling or decoding
    SWAPPED = "swapped"  # preempted: its cache blocks wait in host memory
    FINISHED = "finished"


class Sequence:
    """One request: its tokens (prompt then generated), how many of them are in the cache (``num_computed``),
    its cache pages (``block_table``) and what it has produced so far.

    The model must compute tokens ``[num_computed, len(token_ids))`` before it can sample the next one. Prompt
    tokens go through prefill (in chunks), a short prompt's through decode rows (``PrefillChunk.short``); generated
    tokens always go through decode: one at a time, or after preemption by recomputation several in one step, one
    row each (``PrefillChunk.decode_rows``).
    """

    def __init__(
        self,
        request_id: str,
        arrival: int,
        prompt_ids: list[int],
        params: SamplingParams,
        seed: int,
        prompt: str | None = None,
    ):
        self.request_id, self.arrival, self.params, self.seed, self.prompt = request_id, arrival, params, seed, prompt
        self.token_ids: list[int] = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.num_computed = 0
        self.block_table: list[int] = []
        self.status = Status.WAITING
        self.swapped: Any = None  # host copy of the cache pages while SWAPPED
        self.swapped_pages = 0
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] = []
        self.prompt_logprobs: list[float | None] = [None] if params.prompt_logprobs is not None else []
        self.prompt_top_logprobs: list[dict[int, float] | None] = [None] if params.prompt_logprobs else []
        self.finish_reason: str | None = None
        self.stop_reason: int | None = None
        self.num_preemptions = 0
        self.matcher: Any = None  # the grammar matcher of a structured-output request (structured_output.py)
        # prefix caching (block_manager.py): the keys of its full pages so far, how many of its pages are registered,
        # and how many prompt tokens it found cached when it was first admitted (not prefilled)
        self.page_keys: list[tuple] = []
        self.num_registered_pages = 0
        self.num_cached_tokens = 0
        # Speculative decoding (speculative.py): the drafts this step verifies; the MTP layer's draft of the token
        # after the last one, with its probability (None without a confidence threshold), and the MTP state behind
        # it (on the device); counts.
        self.drafts: list[int] = []
        self.max_drafts = 0  # the scheduler's room for drafts this step
        self.drafts_in_flight = 0  # drafts of the step still running, whose acceptance the host learns after it
        self.next_draft: tuple[int, float | None] | None = None
        self.draft_state: Any = None
        self.num_drafted = self.num_accepted = 0
        # None until first scheduled; False when that step held at least ``disable_by_batch_size`` sequences: it
        # never drafts, and a decode step of only such sequences skips the MTP layer (``MTPDrafter.admit``)
        self.speculates: bool | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_decode(self) -> bool:
        """The next step decodes one generated token (else it prefills a chunk)."""
        return self.num_pending == 1 and self.num_computed >= self.num_prompt_tokens

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt log-probabilities were asked and some are still to be computed."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed}, blocks={len(self.block_table)})"
        )
