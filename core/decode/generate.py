"""The token layer: one step loop over 1..N rows, each row a `core.decode.reply.Reply`, for every path that decodes.

`Engine.run_request` (one-off prompts, chat turns, the split model's sequential scheduler) runs it with one row on
the conversation's own cache; the batched server (core/batch.py) runs it with the rows of its batch. It knows nothing
of text, stops, events or metrics: a row's `Reply` samples (`Reply.sample`), takes each token (`Reply.accept`, which
says when the row ends) and keeps the clock. A row may carry a drafter (core/decode/speculative.py): speculation is then
verify passes of that row in the same loop.

**A step.** Step n+1's graph is built over every row (one forward pass, `(rows, 1)` ids) while step n computes, and
queued with `mx.async_eval` as soon as step n's tokens are read (not before them, as mlx-lm does): until step n's
tasks finish MLX holds their buffers, and the fused decoder layer (core/native/layer.cpp) could then not write step
n+1's keys and values into the cache in place; it would copy the whole cache. Embedded model, 2,000 tokens of
context: 32 ms a token queued before, 16.7 queued after (as fast as no pipelining); at 32 tokens 9.0 against 6.9.
Hence a row's token is already in its cache when the row takes it (and in the row's `fed`), unless no step was queued
after it: the last token its reply allows, when it is the only row. While the caller has someone waiting to prefill
(`defer`, the server's newcomer), step n+1 stays built but unsubmitted until it is read: the newcomer's prefill and
first token then wait for step n only (1.1B model, 7 rows decoding: a newcomer's TTFT 293 -> 175 ms).
A step's rows are sampled by their own `Reply.sample`, except the rows whose chains share their steps (the same
`Reply.batch_key`, two or more): those are sampled as one set of ops over their rows (core/sampling/batch_sampling.py),
each row drawing the token it draws alone.

**Rows and caches.** One row decodes on its own cache, whatever its kind (plain, rotating, quantized). A second row
joining merges both into mlx-lm's `BatchKVCache` (left-padded, a per-row mask); a joining row's first token comes
from a one-row step on its own cache, so it goes out at once and is computed as the solo path computes it. Each row
then has a *slot*, its row of the batch caches. A row that ends leaves the loop at once (`on_end` gets it and a way
to take its cache, cut from its slot) but its slot stays, free: `BatchKVCache.filter` would copy every other row of
every layer, and so would `extend` for the next newcomer (embedded model, 7 rows decoding: the step after a join
47 ms, the step a row left in and the next 42 and 31, against 18). A free slot computes on, on junk input, harmless
(its attention covers only its own positions past its own padding, all finite) and never sampled; a newcomer whose
positions fit before the batch's index is written into it (`core.cache.kv_cache.fill_slot`: its row's keys and
values, in place, laid out as `extend` lays them out), a longer one extends the batch (its free slots dropped first,
so the batch never outgrows its rows). The free slots are dropped (`filter`, one copy of the rows left) once they are
as many as the rows, or at once for caches a row cannot be written into (rotating); when one row with a drafter is
left, its cache is taken out of the batch again so it can verify.

**Speculation** (core/decode/speculative.py has the drafters, the `Governor` and why the text is exact). A row that is
alone in the loop *peeks*: after each token its drafter guesses the next one, compared when the pipeline reads it, so
a wrong guess costs only the lookup. A confirmed guess starts verified steps: the pending token and up to k guesses
as one pass of k + 1 positions on the row's cache; the row's own sampler draws each position's token as a plain step
would, the guesses that differ from what it drew are trimmed off the cache. Verified steps go on while they keep
guesses; then plain steps resume. In a batch of several rows, rows do not draft: the batch shares one write position
(the left-padded cache cannot keep a different number of positions per row), and a verify pass for one row would
stall the others for less than a batched step returns. So `mlxchat serve` speculates when a request has the model to
itself, and a busy batch decodes plainly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from ..cache.kv_cache import fill_slot, fits_slot, prefill, slotted
from ..sampling.batch_sampling import sample_rows
from ..sampling.candidates import log_softmax
from ..sampling.constraint import fill_masks
from .speculative import Drafter, Governor, Speculation

if TYPE_CHECKING:
    from .events import FinishReason
    from .reply import Reply

# Rows whose chains allow it are sampled as one op over the batch (core/sampling/batch_sampling.py); off, every row
# samples alone (the tests' reference, and the bench's before).
BATCH_SAMPLING = True


def prefill_all_but_last(model: nn.Module, layers: list, prompt: Sequence[int], fed: list[int], prefill_step: int,
                         cancelled: Callable[[], bool], on_prefill: Callable[[int], None] | None) -> bool:
    """Prefill every prompt id but the last (the row's first step takes it), in chunks, appending each chunk to
    `fed` as the cache takes it. False when cancelled."""
    for chunk in prefill(model, layers, prompt[:-1], prefill_step, cancelled):
        fed.extend(chunk)
        if on_prefill:
            on_prefill(len(chunk))
    return not cancelled()


class Row:
    """One reply in the loop: its `Reply`, `fed` (the ids in its cache, extended as the cache takes them, so a caller
    that keeps the cache knows what it holds, including after an early end) and, to speculate, a drafter with its
    settings. `context` is every id before the reply (the drafter looks up its prompt); the loop appends each token
    the reply takes."""

    def __init__(self, reply: "Reply", fed: list[int], *, logprobs: bool = False, context: Sequence[int] = (),
                 drafter: Drafter | None = None, spec: Speculation = Speculation()) -> None:
        self.reply, self.fed, self.logprobs = reply, fed, logprobs
        self.drafter = drafter
        self.governor = Governor(spec, adaptive=spec.mode == "auto") if drafter is not None else None
        self.context: list[int] = list(context) if drafter is not None else []
        self.last = -1  # the last token taken
        self.guess: int | None = None  # the drafter's guess of the next token (peeking)
        self.reason: "FinishReason | None" = None
        self._began = 0.0  # when the last plain token was read (the governor times them)

    def take(self, token: int, logprobs: mx.array | None, steps: int = 1) -> bool:
        """Give the reply one token; True when the row ends here."""
        self.last = token
        if self.drafter is not None:
            self.context.append(token)
            self.reply.speculation.steps += steps
        self.reason = self.reply.accept(token, logprobs if self.logprobs else None)
        return self.reason is not None


OnEnd = Callable[[Row, Callable[[], list]], None]


class StepLoop:
    """The decode loop over its rows (see the module docstring). On the inference thread: `join` a prefilled row,
    `step` while `rows` is not empty; `on_end(row, cache)` is called once per row as it leaves (`row.reason` says
    why; `cache()` gives its KV cache, holding the ids in `row.fed`)."""

    def __init__(self, model: nn.Module, on_end: OnEnd = lambda row, cache: None,
                 defer: Callable[[], bool] = lambda: False) -> None:
        # `defer()`, asked when a step's tokens are read: whether to leave the next step (built already) unsubmitted
        # until it is read, so that work the caller queues meanwhile (a newcomer's prefill and first token) runs
        # first instead of after a whole step of every row.
        self.model, self.on_end, self.defer = model, on_end, defer
        self.rows: list[Row] = []
        self.layers: list | None = None  # one row: its own cache; several: a BatchKVCache per layer
        self._batched = False
        # Batched, each row's slot (its row of the batch caches; `_slots[i]` is `rows[i]`'s) and the free slots, left
        # by rows that ended and not yet taken or compacted away. One row: [0] and [].
        self._slots: list[int] = []
        self._free: list[int] = []
        self._inputs: mx.array | None = None  # each slot's next input id, (slots,), lazy
        self._pending: tuple[list[Row], mx.array, list[mx.array | None]] | None = None  # queued, not yet read
        self._verifying: Row | None = None  # the lone row in verified steps: its last token is not in its cache

    def run(self, row: Row, layers: list, last: int) -> "FinishReason":
        """One row alone, from its last prompt id to its end (the engine's solo path); the step queued past its end,
        if any, is left to finish (`mx.synchronize`)."""
        self.join(row, layers, last)
        while self.rows:
            self.step()
        assert row.reason is not None
        return row.reason

    # --- rows in and out ------------------------------------------------------------------------------------

    def join(self, row: Row, layers: list, last: int) -> None:
        """Add a row whose prompt is in `layers` but for its `last` id, which its first step runs."""
        if not self.rows:
            self.rows, self.layers, self._batched, self._slots, self._free = [row], layers, False, [0], []
            if row.drafter is not None and row.context[-1:] == [last]:
                self._verifying = row  # the prompt's end may already continue a run of the prompt
            else:
                self._queue_alone(row, last)
            return
        if self._verifying is not None:  # the lone row stops drafting: it has company
            self._plain_again(self._verifying)
        # Joining rows that decode: its first token from its own one-row step, at once (not after the batch's next
        # steps), computed as the solo path computes it.
        token, lp = row.reply.sample(self.model(mx.array([[last]]), cache=layers)[0, -1])
        mx.eval(token, lp) if row.logprobs else mx.eval(token)
        row.fed.append(last)
        first = token.item()
        if row.take(first, lp):
            self.on_end(row, lambda: layers)
            return
        if not self._batched:
            self.layers, self._batched = [c.merge([c]) for c in self.layers], True
        if self._free and all(fits_slot(mine, new) for mine, new in zip(self.layers, layers)):
            # Into a free slot: one row's keys and values written, the other rows' left where they are.
            slot = min(self._free)
            self._free.remove(slot)
            for mine, new in zip(self.layers, layers):
                fill_slot(mine, slot, new)
            self._inputs = mx.where(mx.arange(self._inputs.shape[0]) == slot, first, self._inputs)
        else:
            # A new slot: `extend` copies every row (and pads them all when the newcomer holds more positions). Free
            # slots are compacted away first, so that the batch never outgrows the rows it runs.
            if self._free:
                self._compact()
            for mine, new in zip(self.layers, (c.merge([c]) for c in layers)):
                mine.extend(new)
            slot = len(self._slots)
            following = mx.array([first], mx.int32)
            self._inputs = following if self._inputs is None else mx.concatenate([self._inputs, following])
        self.rows.append(row)
        self._slots.append(slot)
        row.fed.append(first)  # in its cache from the next step, which every row is in (`step` feeds the pending's)

    def _leave(self, ended: list[int]) -> None:
        """Remove ended rows (each handed to `on_end` with its cache) and keep the pending step's rows aligned.
        Batched, their slots are kept, free, until a newcomer takes one or they are compacted away (the module
        docstring says when)."""
        gone = set(ended)
        for i in ended:
            row = self.rows[i]
            if self._batched:
                self.on_end(row, lambda slot=self._slots[i]: [c.extract(slot) for c in self.layers])
            else:
                self.on_end(row, lambda: self.layers)
        keep = [i for i in range(len(self.rows)) if i not in gone]
        self.rows = [self.rows[i] for i in keep]
        self._free += [self._slots[i] for i in ended]
        self._slots = [self._slots[i] for i in keep]
        if not keep:
            self.layers, self._inputs, self._pending, self._batched = None, None, None, False
            self._slots, self._free = [], []
            return
        if self._pending is not None:
            rows, tokens, lps = self._pending
            here = [i for i in keep if i < len(rows)]
            self._pending = ([rows[i] for i in here], tokens[mx.array(here)] if here else tokens[:0],
                             [lps[i] for i in here])
        if not self._batched:
            return
        if len(self.rows) == 1 and self.rows[0].drafter is not None:
            # Alone again, a row that may draft gets its own cache back (a verify pass of several positions runs on
            # a plain cache); one copy of its keys and values.
            slot = self._slots[0]
            self.layers, self._batched = [c.extract(slot) for c in self.layers], False
            self._inputs, self._slots, self._free = self._inputs[slot:slot + 1], [0], []
        elif self._free and (len(self._free) >= len(self.rows) or not slotted(self.layers)):
            # Half the batch computes for nothing (or its caches are of a kind a newcomer cannot be written into).
            self._compact()

    def _compact(self) -> None:
        """Drop the free slots: the rows' keys and values gathered into a batch of theirs, in the rows' order."""
        for c in self.layers:
            c.filter(self._slots)
        self._inputs = self._inputs[mx.array(self._slots)]
        self._slots, self._free = list(range(len(self.rows))), []

    def _by_slot(self, tokens: mx.array) -> mx.array:
        """The next input of each slot, from the rows' `tokens` (in the rows' order); a free slot gets any row's."""
        if self._dense:
            return tokens
        at = [0] * (len(self._slots) + len(self._free))
        for i, slot in enumerate(self._slots):
            at[slot] = i
        return tokens[mx.array(at)]

    @property
    def _dense(self) -> bool:
        """Whether slot i is row i, for every slot (no free slots, no rows out of order): the step's ids and logits
        are the rows' as they are."""
        return not self._free and all(slot == i for i, slot in enumerate(self._slots))

    # --- plain steps ----------------------------------------------------------------------------------------

    def _forward(self, rows: list[Row], inputs: mx.array) -> tuple[mx.array, list[mx.array | None]]:
        """One step over `rows` (their input ids `(rows,)`), sampled and queued; lazy until read. Rows with the same
        batch key (two or more) are sampled as one op over their rows; the others row by row."""
        logits = self.model(inputs[:, None], cache=self.layers)[:, -1, :]
        if not self._dense:  # the rows' slots, in the rows' order
            logits = logits[mx.array(self._slots)]
        masked = [c for row in rows if (c := row.reply.full_mask) is not None]
        if len(masked) > 1:  # the constrained rows' masks in one call, not one per row
            fill_masks(masked, logits)
        groups: dict[tuple, list[int]] = {}
        if BATCH_SAMPLING and len(rows) > 1:
            for i, row in enumerate(rows):
                if row.reply.batch_key is not None:
                    groups.setdefault(row.reply.batch_key, []).append(i)
        pieces, order = [], []  # token arrays, and the rows they hold in that order
        lps: list[mx.array | None] = [None] * len(rows)
        for group in groups.values():
            if len(group) < 2:
                continue
            tokens, before = sample_rows([rows[i].reply.sampler for i in group],
                                         logits if len(group) == len(rows) else logits[mx.array(group)])
            pieces.append(tokens)
            order += group
            for j, i in enumerate(group):
                if rows[i].logprobs:
                    lps[i] = log_softmax(before[j])
        grouped = set(order)
        alone = [i for i in range(len(rows)) if i not in grouped]
        for i in alone:
            token, lp = rows[i].reply.sample(logits[i])
            pieces.append(token[None])
            lps[i] = lp if rows[i].logprobs else None
        order += alone
        tokens = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces)
        if order != list(range(len(rows))):  # back in the rows' order
            place = [0] * len(order)
            for at, i in enumerate(order):
                place[i] = at
            tokens = tokens[mx.array(place)]
        return tokens, lps

    def _queue_alone(self, row: Row, last: int) -> None:
        """Queue the first plain step of a row that is alone, from `last` (known, so it is in `fed` at once)."""
        tokens, lps = self._forward([row], mx.array([last], mx.int32))
        mx.async_eval(tokens, *(lp for lp in lps if lp is not None))
        row.fed.append(last)
        row._began = time.perf_counter()
        self._inputs, self._pending = tokens, ([row], tokens, lps)

    def step(self) -> None:
        """Read the pending step's tokens, with the next step built before and queued right after; rows that end
        leave. A lone row whose drafter guessed the token read goes on with verified steps, one per call."""
        if self._verifying is not None:
            self._verify_step(self._verifying)
            return
        pending = self._pending
        queued = None
        if self.rows and (pending is None or any(r.reply.room > 1 or r not in pending[0] for r in self.rows)):
            rows = list(self.rows)
            queued = (rows, *self._forward(rows, self._inputs))
            self._inputs = self._by_slot(queued[1])
        self._pending = queued
        if pending is None:
            if queued is not None:
                mx.async_eval(queued[1], *(lp for lp in queued[2] if lp is not None))
            return
        rows, tokens, lps = pending
        read = tokens.tolist()
        if queued is not None:
            if not self.defer():
                mx.async_eval(queued[1], *(lp for lp in queued[2] if lp is not None))
            for row in queued[0]:
                if row in rows:
                    row.fed.append(read[rows.index(row)])
                # (a row that joined after `pending` was queued has its input, its first token, fed at its join)
        verify = None
        ended = []
        for i, (row, token) in enumerate(zip(rows, read)):
            guessed = row.guess == token
            row.guess = None
            if row.take(token, lps[i]):
                ended.append(i)
                continue
            g = row.governor
            if g is None or len(self.rows) > 1 or self._batched:
                continue
            now = time.perf_counter()
            g.plain(now - row._began)
            row._began = now
            if guessed and queued is not None:
                verify = row
            elif g.peek():
                row.guess = (row.drafter.propose(row.context, 1) or [None])[0]
        if ended:
            self._leave(ended)  # the pending rows are the first len(rows) rows of the loop, in order
        if verify is not None and self.rows == [verify]:
            self._speculate(verify)

    # --- speculation ----------------------------------------------------------------------------------------

    def _speculate(self, row: Row) -> None:
        """The lone row's guess was right: read the token after it (already queued), left pending (not in the
        cache): verified steps go on from it."""
        _, tokens, lps = self._pending
        self._pending = self._inputs = None
        if row.take(tokens.item(), lps[0]):
            self._leave([0])
            return
        self._verifying = row

    def _plain_again(self, row: Row) -> None:
        """End the lone row's verified steps: queue a plain step from its pending token."""
        row.governor.episode_done()
        self._verifying = None
        self._queue_alone(row, row.context[-1])

    def _verify_step(self, row: Row) -> None:
        """One verified step of the lone row: its pending token and up to k guesses in one pass, each position's token
        drawn by its own sampler; the positions after the first token that differs from its guess are trimmed off.
        The steps go on while they keep guesses (a step that keeps none, or no guess, returns to plain steps)."""
        g, stats, layers = row.governor, row.reply.speculation, self.layers
        began = time.perf_counter()
        guess = row.drafter.propose(row.context, min(g.k, row.reply.room - 1))
        if not guess and not g.always:
            self._plain_again(row)
            return
        ids = [row.context[-1], *guess]
        logits = self.model(mx.array(ids)[None], cache=layers)[0]
        row.fed.extend(ids)
        stats.draft_tokens += len(guess)
        for i in range(len(ids)):
            token, lp = row.reply.sample(logits[i])
            mx.eval(token, lp) if row.logprobs else mx.eval(token)
            token = token.item()
            kept = i < len(guess) and token == guess[i]
            if kept:
                stats.accepted_tokens += 1
            else:
                if rejected := len(guess) - i:  # the positions after this one were computed for guesses that lost
                    for c in layers:
                        c.trim(rejected)
                    del row.fed[-rejected:]
                if guess:
                    g.verified(len(guess), i, time.perf_counter() - began)
            if row.take(token, lp, steps=i == 0):
                g.episode_done()
                self._verifying = None
                self._leave([0])
                return
            if not kept:
                break
        if guess and i == 0 and not g.always:
            self._plain_again(row)


__all__ = ["Row", "StepLoop", "prefill_all_but_last"]
