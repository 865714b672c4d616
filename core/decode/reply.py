"""One request from its validated settings to its result: `Request`, and `Reply`, the text layer and per-request
state every generation path shares.

The engine's solo path (`Engine.run_request`: one-off prompts, chat turns, the split engine and its server) and the
batched server (core/batch.py) both turn ids into a reply here, so they cannot disagree on:

* the sampler and, with ``trace=K``, the `Tracer` that wraps it (`Reply.sample` is what the token layer calls);
* text: ids become whole-character deltas (`IncrementalDetokenizer`) and text that may begin a stop string is held
  back (`StopStringFilter`); the deltas concatenate to the final text exactly;
* the layered stops, checked after each token in this order: an end-of-turn id (not part of the reply), a stop
  string (the text ends before it), `max_tokens` or a full context ("length"), a cancel;
* the end, whatever the reason: held-back text that turned out not to be a stop string is emitted, so a cancel keeps
  what was shown and the rest of what was generated (as a `max_tokens` cut does); a reply cut inside a multi-byte
  character leaves that incomplete character out of its text (its token id and logprob stay);
* the clock (`Metrics`), logprobs, traces, and the `GenerationResult`;
* tool calls (core/decode/tools.py), with a request's `ToolUse`: its grammar is the constraint, and a `CallStream` takes
  the calls out of the text (deltas and the result's text are what is not a call; each call goes out once, on the
  event whose token closed it, and in `GenerationResult.tool_calls`).

Per token, `Reply.accept` does what the engine's decode loop did before it: no extra allocation, one more compare.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from ..model.loader import LoadedModel
from ..sampling import dry
from ..sampling.batch_sampling import chain_key
from ..sampling.chain import Sample, Sampler
from ..sampling.constraint import Constraint, constraint_for
from ..sampling.profile import SamplingProfile
from ..sampling.response_format import ResponseFormat
from ..sampling.trace import TokenTrace
from ..sampling.tracing import Tracer, check_trace
from .events import Done, Event, FinishReason, GenerationResult, Metrics, TokenEvent, TokenLogprob
from .reasoning import Reasoning, ReplyReasoning, peek_text
from .speculative import Speculation, SpeculationStats
from .streaming import IncrementalDetokenizer, StopStringFilter
from .tools import CallStream, RepeatedCall, ToolCall, ToolUse

# The reply's length cap when neither the call nor the profile sets max_tokens: long enough for any ordinary answer
# (mlx-lm's generate defaults to 256, which cuts explanations and code short), short enough that a model stuck in
# a loop stops within minutes on a slow CPU instead of running to the end of the context.
DEFAULT_MAX_TOKENS = 1024


@dataclass(frozen=True)
class Request:
    """One validated generation request: the profile, the reply's length cap, every stop string, how many
    candidates to trace per token (0 = no trace; see core/sampling/tracing.py), how to speculate
    (core/decode/speculative.py), and the tools it may call (core/decode/tools.py; None: no tools)."""

    profile: SamplingProfile
    max_tokens: int
    stop: list[str]
    trace: int = 0
    speculative: Speculation = Speculation()
    tools: ToolUse | None = None
    reasoning: Reasoning = Reasoning()  # a thinking model's switch and budget (core/decode/reasoning.py)

    @classmethod
    def make(cls, profile: SamplingProfile | None = None, max_tokens: int | None = None,
             stop: Sequence[str] | None = None, trace: int = 0,
             speculative: str | Speculation | None = None, tools: ToolUse | None = None,
             reasoning: Reasoning | None = None) -> "Request":
        """Validate a request: `max_tokens` wins over the profile's, and with neither the reply is capped at
        DEFAULT_MAX_TOKENS (finish reason "length"); `stop` adds to the profile's stop strings; `trace` is the
        number of candidates to trace per token (0-100, 0 = off); `tools` that may be called constrain the reply,
        so they cannot come with the profile's own response_format."""
        check_trace(trace)
        profile = profile or SamplingProfile()
        if tools is not None and tools.calls and profile.response_format is not None:
            raise ValueError(f"response_format and tool_choice {tools.choice.mode!r} both constrain the reply: use "
                             "one (or tool_choice \"none\")")
        if profile.beam_size > 1:
            raise ValueError(f"beam search (beam_size {profile.beam_size}) does not stream: call "
                             "engine.beam_search(), or use beam_size 1 to sample")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        cap = max_tokens or profile.max_tokens or DEFAULT_MAX_TOKENS
        if profile.min_tokens > cap:
            raise ValueError(f"min_tokens ({profile.min_tokens}) must not exceed max_tokens ({cap})")
        spec = Speculation.make(speculative)
        reasoning = reasoning or Reasoning()
        if reasoning.budget is not None and spec.mode != "off":
            raise ValueError(f"reasoning_budget does not combine with speculative decoding ({spec.mode!r}) yet: use "
                             "speculative \"off\" with a budget")
        return cls(profile, cap, [*profile.stop, *(stop or [])], trace, spec, tools, reasoning)

    def response_format(self) -> ResponseFormat | None:
        """What constrains the reply (the sampler's constraint stage): the tools' grammar when they may be called,
        or the profile's format (tool_choice "none" without one: text without call markup), else None."""
        use, fmt = self.tools, self.profile.response_format
        if use is not None and (use.calls or fmt is None):
            return use.response_format()
        return fmt


class Reply:
    """One request's state while it runs, on the inference thread: sampler, text, stops, clock, logprobs, traces.

    `emit` receives the TokenEvents and the final Done; `cancelled()` is checked after each token. `prompt` is what
    the reply answers (the sampler may penalise it); with a non-rotating cache, prompt and reply together end at the
    model's context. `context()` is the number of positions in the KV cache now, and `kv_window` its rotating
    window, for `Metrics`."""

    def __init__(self, model: LoadedModel, request: Request, prompt: Sequence[int], emit: Callable[[Event], None],
                 cancelled: Callable[[], bool], *, accepted: float, context: Callable[[], int],
                 rotating: bool = False, kv_window: int | None = None) -> None:
        tok = model.tokenizer
        self._request = request
        self._again = lambda emit: Reply(model, request, prompt, emit, cancelled, accepted=accepted, context=context,
                                         rotating=rotating, kv_window=kv_window)
        calling = request.tools is not None and request.tools.calls
        self._constraint = constraint_for(request.response_format(), tok, model.vocab_size,
                                          RepeatedCall() if calling else None)
        self._calls = CallStream() if calling else None
        profile = request.profile
        # DRY's sequence breakers are strings, found on the model's vocabulary once per tokenizer
        # (core/sampling/dry.py).
        breakers = dry.breakers_for(tok, profile.dry_sequence_breakers) if profile.active("dry") else dry.NO_BREAKERS
        self._sampler = Sampler(profile, vocab_size=model.vocab_size, eos_ids=tok.eos_ids,
                               prompt_ids=list(prompt), constraint=self._constraint, dry_breakers=breakers)
        self._tracer = Tracer(self._sampler, request.trace, lambda i: tok.decode([i])) if request.trace else None
        # Untraced requests call Sampler.step directly: tracing adds nothing to their decode step.
        self.sample: Sample = self._tracer.step if self._tracer else self._sampler.step
        self._ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self._traces: list[TokenTrace] = []
        self._text: list[str] = []
        self._thought = ""  # the reasoning of the delta being emitted
        self._eos = tok.eos_ids
        self._emit, self._cancelled = emit, cancelled
        self._detok = IncrementalDetokenizer(tok)
        # A thinking model's reasoning apart, and its budget (core/decode/reasoning.py); None for other models.
        # With a response_format the grammar holds the whole reply: it is the answer, as the model writes it.
        self._reasoning = (ReplyReasoning.make(tok, request.reasoning, prompt)
                           if request.profile.response_format is None else None)
        self._thinking: list[str] = []
        if self._reasoning is not None:
            self.sample = self._reasoning.wrap(self.sample, self._sampler, peek_text(self._detok))
        # Rows that sample with the plain `Sampler.step` and share this key are sampled as one op (the batch's step,
        # core/sampling/batch_sampling.py); a traced reply or one whose reasoning budget may force tokens samples alone.
        self.batch_key = chain_key(self._sampler) if self.sample == self._sampler.step else None
        self._stops = StopStringFilter(request.stop)
        self._top = request.profile.top_logprobs if request.profile.logprobs else None
        self._cap = request.max_tokens if rotating else min(request.max_tokens, model.context_length - len(prompt))
        # The clock: accepted -> prefill started -> first token -> last token.
        self._accepted, self._started = accepted, time.perf_counter()
        self._first: float | None = None
        self._last: float | None = None
        self._generated = 0  # tokens drawn, forced ones not counted
        self._prompt_tokens, self._cached, self._disk = len(prompt), 0, 0
        self._context, self._limit, self._window = context, model.context_length, kv_window
        # Filled by the token layer when the reply speculates (core/decode/speculative.py); "off" otherwise.
        self.speculative = "off"
        self.speculation = SpeculationStats()

    @property
    def sampler(self) -> Sampler:
        return self._sampler

    @property
    def full_mask(self) -> Constraint | None:
        """The constraint, when its stage computes a full mask every step (not the sampler's lazy order, or a traced
        reply): the batch fills such rows' masks together (`core.sampling.constraint.fill_masks`)."""
        c = self._constraint
        return c if c is not None and (self._tracer is not None or not self._sampler.lazy) else None

    @property
    def room(self) -> int:
        """How many more tokens the reply may take (at least one, even after a branch forced past the cap)."""
        return max(1, self._cap - len(self._ids))

    def begin_prefill(self, total: int, cached: int, disk: int = 0) -> None:
        """The prefill starts now: `total` ids to answer (prompt and forced ids), `cached` of them already cached,
        `disk` of those loaded from disk."""
        self._started, self._prompt_tokens, self._cached, self._disk = time.perf_counter(), total, cached, disk

    def force(self, ids: Sequence[int], traces: Sequence[TokenTrace] = ()) -> FinishReason | None:
        """Start the reply with tokens already decided (a branch): the sampler counts them as drawn, and they go out
        in one event with no tick of the clock. `traces` is aligned with `ids`, or empty. Returns "stop" when they
        end the reply (the end token forced, or a stop string in their text), else None."""
        self._sampler.replay(ids)
        ends = bool(ids) and ids[-1] in self._eos
        kept = tuple(ids[:-1] if ends else ids)
        if kept:
            shown = tuple(traces[:len(kept)])
            shown = shown if len(shown) == len(kept) else ()
            self._ids.extend(kept)
            self._traces.extend(shown)
            # Token by token through the text layer (a thinking model counts its reasoning per token), one event.
            texts, thoughts, calls = [], [], ()
            for t in kept:
                text, closed = self._split(self._stops.feed(self._detok.add(t)), (t,))
                texts.append(text)
                thoughts.append(self._thought)
                calls += closed
            self._emit(TokenEvent("".join(texts), kept, self.metrics(), (), shown, calls, "".join(thoughts)))
        return "stop" if ends or self._stops.stopped else None

    def fork(self, emit: Callable[[Event], None]) -> "Reply":
        """Another reply to the same request that has taken the same tokens so far (its sampler's history and
        constraint, its text and stops; emitted to `emit`, as `force` does): a beam's continuation
        (core/decode/beam.py)."""
        other = self._again(emit)
        other.force(self._ids)
        return other

    def scores(self, logits: mx.array) -> mx.array:
        """Every next token's log-probability under this reply's processors and constraint, nothing drawn."""
        return self._sampler.scores(logits)

    def take(self, token: int, logprobs: mx.array | None = None) -> FinishReason | None:
        """`accept` a token chosen outside the sampler (by beam search): the sampler counts it as drawn first."""
        self._sampler.replay([token])
        return self.accept(token, logprobs)

    def accept(self, token: int, logprobs: mx.array | None = None) -> FinishReason | None:
        """Record one generated token and emit its delta; return why the reply ends here, or None to go on.
        `logprobs` is the step's (vocab,) array, read only when the request asked for logprobs."""
        now = time.perf_counter()
        if self._first is None:
            self._first = now  # an end token drawn first still ends the prefill: TTFT is the time to it, never 0
        forced = self._reasoning.take() if self._reasoning is not None else False
        if token in self._eos:
            return "stop"
        self._last = now
        self._generated += 1
        self._ids.append(token)
        token_lp: tuple[TokenLogprob, ...] = ()
        if self._top is not None:
            chosen, top = Sampler.top_logprobs(logprobs, token, self._top)
            token_lp = (TokenLogprob(token, chosen, tuple(top)),)
            self._logprobs.append(token_lp[0])
        traces: tuple[TokenTrace, ...] = ()
        if self._tracer is not None and not forced:  # a token the budget forced was not drawn: no trace
            traces = (self._tracer.take(token),)
            self._traces.append(traces[0])
        delta, calls = self._split(self._stops.feed(self._detok.add(token)), (token,), forced)
        self._emit(TokenEvent(delta, (token,), self.metrics(), token_lp, traces, calls, self._thought))
        if self._stops.stopped:
            return "stop"
        if len(self._ids) >= self._cap:
            return "length"
        if self._cancelled():
            return "cancelled"
        return None

    def finish(self, reason: FinishReason,
               before_done: Callable[[GenerationResult], None] | None = None) -> GenerationResult:
        """End the reply: emit what was held back (see the module docstring), then the Done with the result.
        `before_done(result)` runs first: a chat session records the reply there, so whoever reads the
        conversation on Done finds it."""
        if self._first is None:
            self._first = time.perf_counter()  # no token at all (cancelled in prefill): TTFT is the time to the end
        if not self._stops.stopped:
            tail, calls = self._split(self._stops.feed(self._detok.flush()) + self._stops.flush(), end=True)
            if tail or calls or self._thought:
                self._emit(TokenEvent(tail, (), self.metrics(), tool_calls=calls, reasoning=self._thought))
        elif self._reasoning is not None:
            tail, calls = self._split("", end=True)
            if tail or calls or self._thought:
                self._emit(TokenEvent(tail, (), self.metrics(), tool_calls=calls, reasoning=self._thought))
        # Traces stay aligned with token_ids or are left out (a branch forced a token its trace did not hold).
        traces = tuple(self._traces) if len(self._traces) == len(self._ids) else ()
        result = GenerationResult("".join(self._text), reason, self.metrics(), tuple(self._ids), tuple(self._logprobs),
                                  self._sampler.describe(), self._sampler.seed,
                                  self._request.profile.model_dump(mode="json"), traces,
                                  stop_sequence=self._stops.matched,
                                  tool_calls=tuple(self._calls.calls) if self._calls is not None else (),
                                  reasoning="".join(self._thinking))
        if before_done is not None:
            before_done(result)
        self._emit(Done(result))
        return result

    def _split(self, delta: str, ids: Sequence[int] = (), forced: bool = False,
               end: bool = False) -> tuple[str, tuple[ToolCall, ...]]:
        """A text delta as the reply's text and the calls it closed (all text without tools), recorded. A thinking
        model's reasoning is taken out first (into `_thought`, this delta's reasoning; core/decode/reasoning.py)."""
        self._thought = ""
        if self._reasoning is not None:
            now = time.perf_counter()
            self._thought, delta = self._reasoning.feed(delta, ids, forced, now)
            if end:
                thought, tail = self._reasoning.flush(now)
                self._thought, delta = self._thought + thought, delta + tail
            self._thinking.append(self._thought)
        if self._calls is None:
            self._text.append(delta)
            return delta, ()
        pieces = self._calls.feed(delta)
        text = "".join(p for p in pieces if isinstance(p, str))
        self._text.append(text)
        return text, tuple(p for p in pieces if isinstance(p, ToolCall))

    def metrics(self) -> Metrics:
        """A snapshot of the clock and the sizes now."""
        first, last, n = self._first, self._last, self._generated
        spec = self.speculation
        return Metrics(
            prompt_tokens=self._prompt_tokens, cached_tokens=self._cached, disk_tokens=self._disk,
            completion_tokens=n,
            ttft_s=first - self._accepted if first else 0.0,
            tpot_s=(last - first) / (n - 1) if first and last and n > 1 else 0.0,
            prefill_s=(first or time.perf_counter()) - self._started,
            decode_s=last - first if first and last else 0.0,
            peak_memory_bytes=mx.get_peak_memory(),
            context_tokens=self._context(), context_limit=self._limit, kv_window=self._window,
            **({"constraint_mask_s": self._constraint.mask_s, "constraint_masks": self._constraint.masks,
                "constraint_checks": self._constraint.checks,
                "constraint_compile_s": self._constraint.compile_s} if self._constraint is not None else {}),
            speculative=self.speculative, draft_tokens=spec.draft_tokens, accepted_tokens=spec.accepted_tokens,
            decode_steps=spec.steps if self.speculative != "off" else n,
            **(self._reasoning_metrics() if self._reasoning is not None else {}),
        )

    def _reasoning_metrics(self) -> dict[str, float | int]:
        r = self._reasoning
        return {"reasoning_tokens": r.tokens, "reasoning_s": r.seconds,
                "answer_ttft_s": r.answer_at - self._accepted if r.answer_at is not None else 0.0}


__all__ = ["DEFAULT_MAX_TOKENS", "Reply", "Request"]
