"""Thinking models: their reasoning apart from their answer, and a budget on it (issue 40).

Models such as Qwen3, the DeepSeek-R1 distills and SmolLM3 reason between two markers (``<think>`` ... ``</think>``)
before they answer; some templates already open the reasoning in the generation prompt. Three parts, all on the
text layer's side (core/decode/reply.py holds one `ReplyReasoning` per reply and calls it from a few hooks):

* `markers_for(tokenizer)`: the markers are the ones the model's chat template names, found from the template
  itself, not from a list of models: a tag pair ``<X>``/``</X>`` written in the template is the reasoning pair when
  the template renders a message's ``reasoning_content`` between them, or cuts old replies at the closing tag
  (``content.split('</X>')``, what Qwen3's and DeepSeek-R1's templates do), or ends its generation prompt with the
  opening tag. A marker that is one token of the vocabulary is known by its id too (a special token that a decode
  skips is put back as its text). ``enable_thinking`` in the template means it has a thinking switch. A one-line
  nudge written before the forced closing marker can be set by the template's author:
  ``{%- set reasoning_budget_message = "..." %}``.
* `ReasoningSplitter`: text in, (thinking, answer) deltas out, robust to chunks that split a marker anywhere. The
  reasoning opens with the prompt (the generation prompt ends in the opening marker) or with an opening marker at
  the very start of the reply (whitespace before it allowed), and ends at the first closing marker; neither marker is
  ever emitted, the whitespace around them is dropped (``<think>\\n...\\n</think>\\n\\n``), and everything after the
  close is the answer, as written. The deltas concatenate to the final fields exactly, however the text is cut.
* the budget (`ReplyReasoning.wrap`): after `budget` generated reasoning tokens the reply's sample function returns
  the closing marker's ids itself (the nudge's first), so the model and the KV cache see them as if the model had
  written them, and the answer follows. The token loops queue the next step before the previous token is read
  (core/decode/generate.py, core/batch.py), so near the budget the sample function reads the one token still in flight
  before it decides: the count is exact, and a model that closes on its own right at the budget is not closed twice.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

if TYPE_CHECKING:
    from ..sampling.chain import Sampler
    from .streaming import IncrementalDetokenizer
    from ..model.tokenizer import ChatTokenizer

# OpenAI's reasoning_effort as a budget of reasoning tokens (documented in README and docs/architecture.md).
EFFORT_BUDGETS: dict[str, int] = {"minimal": 0, "low": 512, "medium": 2048, "high": 8192}
# How the template author sets the nudge written before a forced closing marker.
NUDGE_VARIABLE = "reasoning_budget_message"

START, THINKING, ANSWER = "start", "thinking", "answer"


@dataclass(frozen=True)
class ReasoningMarkers:
    """A template's reasoning markers: their text, their ids (the tokenizer's encoding; one id each for models that
    have them as tokens), whether the template has a thinking switch (``enable_thinking``), and the nudge."""

    open: str
    close: str
    open_ids: tuple[int, ...] = ()
    close_ids: tuple[int, ...] = ()
    toggle: bool = False
    nudge: str = ""
    # Marker tokens a plain decode drops (special tokens): id -> their text, put back into the text stream.
    hidden: tuple[tuple[int, str], ...] = ()


_TAG = re.compile(r"<(/?)([^\s<>{}'\"/\\|%]+)>")


def find_markers(template: str | None, render: Callable[..., str] | None = None) -> tuple[str, str] | None:
    """The (opening, closing) reasoning markers a chat template names, or None. `render(messages,
    add_generation_prompt)` renders the template (to probe what it does with ``reasoning_content``)."""
    if not template:
        return None
    opens = {m.group(2) for m in _TAG.finditer(template) if not m.group(1)}
    pairs = [name for name in dict.fromkeys(m.group(2) for m in _TAG.finditer(template) if m.group(1))
             if name in opens]
    if not pairs:
        return None
    # 1. The template renders a reply's reasoning_content between the pair.
    if render is not None and "reasoning_content" in template:
        try:
            text = render([{"role": "user", "content": "u"},
                           {"role": "assistant", "content": "ANSWER-7f3", "reasoning_content": "REASON-7f3"}], False)
        except Exception:  # noqa: BLE001 - a template that cannot render the probe just gives no evidence
            text = ""
        for name in pairs:
            if re.search(f"<{re.escape(name)}>\\s*REASON-7f3\\s*</{re.escape(name)}>", text):
                return f"<{name}>", f"</{name}>"
    # 2. The template cuts replies at the closing tag (old thinking is stripped from the history).
    for name in pairs:
        if re.search(r"split\(\s*(['\"])" + re.escape(f"</{name}>") + r"\1", template):
            return f"<{name}>", f"</{name}>"
    # 3. The generation prompt ends in the opening tag.
    if render is not None:
        try:
            text = render([{"role": "user", "content": "u"}], True).rstrip()
        except Exception:  # noqa: BLE001
            text = ""
        for name in pairs:
            if text.endswith(f"<{name}>"):
                return f"<{name}>", f"</{name}>"
    return None


def markers_for(tokenizer: ChatTokenizer) -> ReasoningMarkers | None:
    """The tokenizer's reasoning markers (None: its template names none), worked out once per tokenizer."""
    cached = getattr(tokenizer, "_reasoning_markers", False)
    if cached is not False:
        return cached
    template = tokenizer.chat_template
    found = find_markers(template, lambda m, g: tokenizer.render(m, add_generation_prompt=g))
    markers = None
    if found is not None:
        open_, close = found
        vocab = tokenizer.hf.get_vocab()
        hidden = tuple((vocab[t], t) for t in found if t in vocab and tokenizer.decode([vocab[t]]) != t)
        nudge = re.search(NUDGE_VARIABLE + r"\s*=\s*(['\"])(.*?)\1", template or "")
        markers = ReasoningMarkers(open_, close, tuple(tokenizer.encode(open_)), tuple(tokenizer.encode(close)),
                                   "enable_thinking" in (template or ""),
                                   nudge.group(2).replace("\\n", "\n").strip() if nudge else "", hidden)
    try:
        tokenizer._reasoning_markers = markers  # type: ignore[attr-defined]
    except AttributeError:
        pass
    return markers


@dataclass(frozen=True)
class Reasoning:
    """A request's reasoning settings: `enable_thinking` for a template with a switch (None: the template's
    default), the budget of reasoning tokens (None: no budget), and whether the reasoning is reported at all
    (`hide`: the reply's text is only the answer either way)."""

    enable_thinking: bool | None = None
    budget: int | None = None
    apart: bool = True  # False: the reply's text as the model wrote it, markers and all (a raw completion)

    @classmethod
    def make(cls, enable_thinking: bool | None = None, budget: int | None = None,
             effort: str | None = None, field: str = "reasoning_budget") -> "Reasoning":
        """Validated settings: `budget` is a count of tokens (0 or more); `effort` (OpenAI's reasoning_effort) names
        one of EFFORT_BUDGETS when no budget is given."""
        if effort is not None and effort not in EFFORT_BUDGETS:
            raise ValueError(f"reasoning_effort must be one of {', '.join(EFFORT_BUDGETS)}, got {effort!r}")
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
                raise ValueError(f"{field} must be an integer of 0 or more (tokens), got {budget!r}")
        elif effort is not None:
            budget = EFFORT_BUDGETS[effort]
        if enable_thinking is not None and not isinstance(enable_thinking, bool):
            raise ValueError(f"enable_thinking must be true or false, got {enable_thinking!r}")
        return cls(enable_thinking, budget)

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template is given: ``enable_thinking`` when it was set."""
        return {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}


def opens_in_prompt(markers: ReasoningMarkers, tokenizer: ChatTokenizer, prompt: Sequence[int]) -> bool:
    """Whether the prompt's generation prompt leaves the reasoning open (it ends in the opening marker)."""
    tail = tokenizer.hf.decode(list(prompt[-16:]), skip_special_tokens=False).rstrip()
    return tail.endswith(markers.open)


def _pending_prefix(buf: str, marker: str) -> int:
    """The length of the longest end of `buf` that is a proper beginning of `marker`."""
    for n in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:n]):
            return n
    return 0


class ReasoningSplitter:
    """Streaming text -> (thinking delta, answer delta); see the module docstring for the rules."""

    def __init__(self, open_: str, close: str, thinking: bool = False) -> None:
        self.open, self.close = open_, close
        self.state = THINKING if thinking else START
        self.closed = False  # the closing marker was seen (or forced)
        self._held = ""
        self._lead = True  # at the start of the thinking or of the answer after it: whitespace is dropped

    def copy(self) -> "ReasoningSplitter":
        other = ReasoningSplitter(self.open, self.close)
        other.state, other.closed, other._held, other._lead = self.state, self.closed, self._held, self._lead
        return other

    @property
    def held(self) -> str:
        return self._held

    def feed(self, text: str) -> tuple[str, str]:
        buf = self._held + text
        self._held = ""
        thinking: list[str] = []
        answer: list[str] = []
        while True:
            if self.state == START:
                s = buf.lstrip()
                if s.startswith(self.open):
                    self.state, self._lead, buf = THINKING, True, s[len(self.open):]
                    continue
                if self.open.startswith(s):  # whitespace or a beginning of the marker so far: wait
                    self._held = buf
                    break
                self.state, self._lead = ANSWER, False  # an answer without reasoning, kept as written
                continue
            if self.state == THINKING:
                if self._lead:
                    buf = buf.lstrip()
                    if not buf:
                        break
                    self._lead = False
                at = buf.find(self.close)
                if at >= 0:
                    thinking.append(buf[:at].rstrip())
                    self.state, self.closed, self._lead, buf = ANSWER, True, True, buf[at + len(self.close):]
                    continue
                keep = _pending_prefix(buf, self.close)
                out = buf[:len(buf) - keep]
                body = out.rstrip()  # trailing whitespace waits: it is dropped if the close follows
                self._held = out[len(body):] + buf[len(buf) - keep:]
                thinking.append(body)
                break
            if self._lead:
                buf = buf.lstrip()
                if not buf:
                    break
                self._lead = False
            answer.append(buf)
            break
        return "".join(thinking), "".join(answer)

    def flush(self) -> tuple[str, str]:
        """What is held at the end: a beginning of a marker that never completed is text (thinking or answer)."""
        held, self._held = self._held, ""
        if self.state == THINKING:
            return held.rstrip(), ""
        if self.state == START:
            return "", held
        return "", "" if self._lead else held


def split_text(text: str, markers: tuple[str, str], thinking: bool = False) -> tuple[str, str]:
    """A whole reply as (reasoning, answer): the splitter fed at once (e.g. a stored message)."""
    s = ReasoningSplitter(*markers, thinking=thinking)
    t1, a1 = s.feed(text)
    t2, a2 = s.flush()
    return t1 + t2, a1 + a2


class ReplyReasoning:
    """One reply's reasoning on the inference thread: its splitter, its budget, its counts and clock.

    The text layer (core/decode/reply.py) calls `wrap` once (the sample function), `take` for each token it accepts (was
    it forced?), `feed` with each text delta, `flush` at the end."""

    def __init__(self, markers: ReasoningMarkers, tokenizer: ChatTokenizer, settings: Reasoning,
                 prompt: Sequence[int]) -> None:
        self.markers = markers
        self._tok = tokenizer
        self.budget = settings.budget
        self.splitter = ReasoningSplitter(markers.open, markers.close, opens_in_prompt(markers, tokenizer, prompt))
        self.tokens = 0  # generated tokens of the reasoning (forced ones not counted)
        self.cut = False  # the budget closed the reasoning
        self._forcing: list[int] = []
        self._pending: list[tuple[mx.array, bool]] = []  # sampled, not yet accepted: (token, forced)
        self._hidden = dict(markers.hidden)
        self._held_at_cut = ""
        self.started: float | None = None  # the clock: the first reasoning token, the close
        self.ended: float | None = None
        self.answer_at: float | None = None  # the first answer text

    @classmethod
    def make(cls, tokenizer: ChatTokenizer, settings: Reasoning, prompt: Sequence[int]) -> "ReplyReasoning | None":
        markers = markers_for(tokenizer) if settings.apart else None
        return cls(markers, tokenizer, settings, prompt) if markers is not None else None

    # --- the sample function (called once per token, before the previous token is read) ---------------------

    def wrap(self, sample: Callable[[mx.array], tuple[mx.array, mx.array]], sampler: Sampler,
             peek: Callable[[Sequence[int]], str]) -> Callable[[mx.array], tuple[mx.array, mx.array]]:
        """`sample` with the budget: it returns the closing marker's ids itself once the reasoning reaches the budget.
        `peek(ids)` is the text the accepted tokens' detokenizer would give for `ids` next (without taking them)."""
        if self.budget is None:
            return sample  # nothing is forced: no token is tracked (speculation samples rows it then rejects)

        def step(logits: mx.array) -> tuple[mx.array, mx.array]:
            if not self._forcing and not self.cut and self._due(peek):
                self._forcing = self._closing_ids()
                self.cut = True
            if self._forcing:
                tid = self._forcing.pop(0)
                sampler.replay([tid])  # penalties, the draw's position and a constraint count it as drawn
                token = mx.array(tid, mx.int32)
                self._pending.append((token, True))
                return token, logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32))
            token, lp = sample(logits)
            self._pending.append((token, False))
            return token, lp

        return step

    def _due(self, peek: Callable[[Sequence[int]], str]) -> bool:
        """Whether the reasoning has reached the budget with the tokens sampled so far (read if still in flight)."""
        state = self.splitter.state
        if state == ANSWER:
            return False
        unread = len(self._pending)
        if state == THINKING and self.tokens + unread < self.budget:
            return False  # not there even if every token in flight is reasoning
        if state == START and self.budget > 0:
            return False  # a reasoning that opens now starts at 0 tokens: below the budget
        self._held_at_cut = self.splitter.held
        if unread == 0:
            return state == THINKING and self.tokens >= self.budget
        # The tokens in flight decide (one of them may close or open the reasoning): read them, on a copy.
        probe = self.splitter.copy()
        tokens = self.tokens
        ids = [int(t.item()) for t, _ in self._pending]
        forced = [f for _, f in self._pending]
        text = peek(ids)
        before = probe.state
        probe.feed(self._restore(text, ids))
        if probe.state == THINKING:
            counted = sum(1 for f in forced if not f)
            tokens += counted if before == THINKING else max(0, counted - 1)
        self._held_at_cut = probe.held
        return probe.state == THINKING and tokens >= self.budget

    def _closing_ids(self) -> list[int]:
        """The ids forced at the budget: the nudge (its own line), then the rest of the closing marker (its beginning
        may already be written)."""
        held = self._held_at_cut
        done = _pending_prefix(held, self.markers.close) if held else 0
        ids: list[int] = []
        if self.markers.nudge and not done:
            ids += self._tok.encode("\n" + self.markers.nudge + "\n")
        rest = self.markers.close[done:]
        ids += list(self.markers.close_ids) if not done else self._tok.encode(rest)
        return ids

    # --- the text layer ----------------------------------------------------------------------------------------

    def take(self) -> bool:
        """The next accepted token was forced (by the budget)."""
        return self._pending.pop(0)[1] if self._pending else False

    def feed(self, text: str, ids: Sequence[int], forced: bool, now: float) -> tuple[str, str]:
        """The text delta of `ids` (already past the stop strings) as (thinking, answer): one generated token, or a
        branch's kept ids, or none (the end's flush)."""
        before = self.splitter.state
        if before != ANSWER:  # after the close, the answer is as the decode writes it
            text = self._restore(text, ids)
        thinking, answer = self.splitter.feed(text)
        after = self.splitter.state
        if not forced and before == THINKING and after == THINKING:
            self.tokens += len(ids)
        if after == THINKING and self.started is None:
            self.started = now
        if after == ANSWER and before != ANSWER and self.started is not None and self.ended is None:
            self.ended = now
            if not forced and not self.cut:  # closed by the model: the closing marker's own tokens are not reasoning
                self.tokens = max(0, self.tokens - max(0, len(self.markers.close_ids) - 1))
        if answer and self.answer_at is None:
            self.answer_at = now
        return thinking, answer

    def _restore(self, text: str, ids: Sequence[int]) -> str:
        """`text` with the marker tokens a decode skipped (special tokens) put back."""
        if not self._hidden:
            return text
        return text + "".join(self._hidden[i] for i in ids if i in self._hidden)

    def flush(self, now: float) -> tuple[str, str]:
        thinking, answer = self.splitter.flush()
        if self.started is not None and self.ended is None:
            self.ended = now
        if answer and self.answer_at is None:
            self.answer_at = now
        return thinking, answer

    @property
    def seconds(self) -> float:
        return (self.ended - self.started) if self.started is not None and self.ended is not None else 0.0


def peek_text(detok: IncrementalDetokenizer) -> Callable[[Sequence[int]], str]:
    """What `detok` would give next for some ids, without changing it."""
    def peek(ids: Sequence[int]) -> str:
        probe = detok.copy()
        return "".join(probe.add(i) for i in ids)
    return peek


__all__ = ["EFFORT_BUDGETS", "Reasoning", "ReasoningMarkers", "ReasoningSplitter", "ReplyReasoning", "find_markers",
           "markers_for", "split_text"]
