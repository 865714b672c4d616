"""What a generation streams out: prefill progress, token deltas with live metrics, and the final result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..sampling.trace import TokenTrace
from .tools import ToolCall

FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True)
class Metrics:
    """Speed and size of one generation. Live snapshots fill what is known so far."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the session's KV cache, not prefilled again
    disk_tokens: int = 0  # of those, how many were loaded from the KV cache saved on disk (core/cache/kv_store.py)
    completion_tokens: int = 0
    ttft_s: float = 0.0  # request accepted -> first token available (includes prefill)
    tpot_s: float = 0.0  # mean time between later tokens
    prefill_s: float = 0.0
    decode_s: float = 0.0
    peak_memory_bytes: int = 0
    context_tokens: int = 0  # tokens in the KV cache after this step
    context_limit: int = 0
    kv_window: int | None = None  # rotating window size, when the session uses one
    # With a response_format (core/sampling/constraint.py): the host time spent on token masks, how many steps the stage
    # decided, how many of those by checking the drawn token alone (the lazy order, no mask), and the compile.
    constraint_mask_s: float = 0.0
    constraint_masks: int = 0
    constraint_checks: int = 0
    constraint_compile_s: float = 0.0
    # Speculative decoding (core/decode/speculative.py): what ran ("off", "ngram", "draft", "auto"), the tokens guessed,
    # the guesses kept, and the decode forward passes (completion_tokens / decode_steps = tokens per step).
    speculative: str = "off"
    draft_tokens: int = 0
    accepted_tokens: int = 0
    decode_steps: int = 0
    # Thinking models (core/decode/reasoning.py): the reasoning's generated tokens (forced closing ids not counted), its
    # duration (first reasoning token to its close), and the time to the first token of the answer.
    reasoning_tokens: int = 0
    reasoning_s: float = 0.0
    answer_ttft_s: float = 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        done = self.prompt_tokens - self.cached_tokens
        return done / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return 1.0 / self.tpot_s if self.tpot_s > 0 else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.completion_tokens / self.decode_steps if self.decode_steps else 0.0

    def as_dict(self) -> dict[str, float | int | None]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["prefill_tokens_per_s"] = self.prefill_tokens_per_s
        d["decode_tokens_per_s"] = self.decode_tokens_per_s
        return d


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class PrefillProgress:
    done: int
    total: int

    @property
    def text(self) -> str:
        """No text: every event has a `text`, so `for e in stream: print(e.text, end="")` prints the reply."""
        return ""


@dataclass(frozen=True)
class TokenEvent:
    """A text delta and the token ids it came from; the deltas concatenate to the final text exactly.

    With ``trace=K`` each event's ``traces`` is aligned with its ``token_ids`` (the engine emits one event per
    token, so there is one trace; the closing flush of held-back text has no token and no trace)."""

    text: str
    token_ids: tuple[int, ...]
    metrics: Metrics
    logprobs: tuple[TokenLogprob, ...] = ()
    traces: tuple[TokenTrace, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()  # with tools: the calls that closed with this event's tokens
    reasoning: str = ""  # a thinking model's reasoning delta (core/decode/reasoning.py); `text` is the answer's

    @property
    def trace(self) -> TokenTrace | None:
        """The trace of the event's last token (None when not traced or when the event carries no token)."""
        return self.traces[-1] if self.traces else None


@dataclass(frozen=True)
class GenerationResult:
    text: str
    finish_reason: FinishReason
    metrics: Metrics
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    sampler: str = ""  # the printed chain that produced it
    seed: int | None = None
    profile: dict = field(default_factory=dict)
    traces: tuple[TokenTrace, ...] = ()  # with trace=K: one per token id, aligned with token_ids
    stop_sequence: str | None = None  # the stop string that ended the reply, when one did
    tool_calls: tuple[ToolCall, ...] = ()  # with tools: the calls the reply made (its text then holds none of them)
    reasoning: str = ""  # a thinking model's reasoning, without its markers; `text` is then the answer alone


@dataclass(frozen=True)
class Done:
    result: GenerationResult

    @property
    def text(self) -> str:
        """No delta (the whole reply is `result.text`): the TokenEvents' deltas already concatenate to it."""
        return ""


Event = PrefillProgress | TokenEvent | Done
