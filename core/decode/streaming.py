"""Turning token ids into text deltas that are safe to show: whole UTF-8 characters, no stop strings.

Peers lost or duplicated text here (llama.cpp #9867, #10914; vLLM #3574). Two rules keep it exact:
decode a sliding window of ids and emit only what follows the previously decoded window (so merges
and SentencePiece's leading-space rule are applied consistently), and hold back text while it ends in
an incomplete character or in a prefix of a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..model.tokenizer import ChatTokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # window start: ids before it are settled
        self._read = 0  # ids up to here have been turned into emitted text

    def copy(self) -> "IncrementalDetokenizer":
        """An independent copy (to look at the text of ids ahead without taking them)."""
        other = IncrementalDetokenizer(self._tok)
        other._ids, other._prefix, other._read = list(self._ids), self._prefix, self._read
        return other

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        before = self._tok.decode(self._ids[self._prefix:self._read])
        after = self._tok.decode(self._ids[self._prefix:])
        if len(after) <= len(before) or after.endswith(_REPLACEMENT):
            return ""  # an incomplete UTF-8 sequence (or nothing printable) so far
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]

    def flush(self) -> str:
        """The rest at the end of generation, without an incomplete last character: a reply cut inside a
        multi-byte character (by max_tokens, a cancel) ends before it instead of in U+FFFD."""
        before = self._tok.decode(self._ids[self._prefix:self._read])
        after = self._tok.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return drop_incomplete(after[len(before):]) if len(after) > len(before) else ""


def drop_incomplete(text: str) -> str:
    """`text` without the incomplete character it may end in, which a decoder shows as U+FFFD."""
    return text.rstrip(_REPLACEMENT)


class StopStringFilter:
    """Holds back text that might begin a stop string; reports where the first stop string matched."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text (Anthropic's answer names it)

    def feed(self, text: str) -> str:
        """Text that can be emitted now. After a match, `stopped` is set and the rest is dropped."""
        if self.stopped:
            return ""
        buf = self._held + text
        hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            at, self.matched = min(hits)
            return buf[:at]
        keep = self._longest_pending_prefix(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_pending_prefix(self, buf: str) -> int:
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
