"""DRY ("don't repeat yourself"): llama.cpp's sampler that penalises a token which would extend a sequence already
in the history (llama.cpp's port of koboldcpp's, by pi6am; p-e-w's design).

Per step, over the history's last ``dry_penalty_last_n`` ids (-1: all of them):

1. The most recent complete **sequence breaker** (llama.cpp's "restart sequence") limits how far back a repeat may
   reach. Breakers are strings, so they are found on the model's vocabulary once (`breakers_for`, as llama.cpp's
   ``get_overlapping_token_sequences``): a token whose text contains the string is a breaker alone; a token whose
   text ends with the string's start is the head of a breaker whose tail is the rest of the string, tokenised.
2. For each earlier position, the length of the history's suffix that also ends there (a reversed Z-algorithm,
   linear in the history), capped by the breaker's limit.
3. The token after each repeat of at least ``dry_allowed_length`` would extend it; each token keeps its longest.
4. Each such token, unless it is a breaker on its own, loses ``dry_multiplier × dry_base^(length − allowed)`` from
   its logit (the exponent clamped so that the power stays a finite float).

The native op (`core/native`, ``dry_penalty``) runs all four on the CPU as one lazy graph node, reading the history
from the device, so a pipelined decode never waits for it. Without the extension, `penalties` (the same algorithm in
Python) runs on the host, which waits for the step's history once.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

MAX_CHAR_LEN = 40  # llama.cpp truncates a breaker to 40 bytes
MAX_SEQ_LEN = 20  # and a breaker's tail to 20 tokens
FLOAT_MAX_LOG = 88.7228391  # log of float32's maximum: llama.cpp's clamp of the exponent


@dataclass(frozen=True)
class Breakers:
    """Sequence breakers on one vocabulary: head token id → the tails (token id tuples) that complete a breaker
    after it; an empty tail means the head alone is one."""

    tails: dict[int, tuple[tuple[int, ...], ...]]

    def single(self, token: int) -> bool:
        """Whether `token` is a breaker on its own (DRY never penalises those)."""
        return () in self.tails.get(token, ())

    def flat(self) -> tuple[list[int], list[int], list[int]]:
        """(heads, offsets, tails) for the native op: head i's tail is tails[offsets[i]:offsets[i + 1]]."""
        heads, offsets, flat = [], [0], []
        for head, tails in self.tails.items():
            for tail in tails:
                heads.append(head)
                flat.extend(tail)
                offsets.append(len(flat))
        return heads, offsets, flat


NO_BREAKERS = Breakers({})


def build_breakers(strings: Iterable[str], pieces: Sequence[str], encode: Callable[[str], list[int]]) -> Breakers:
    """The breakers of `strings` on a vocabulary whose token i reads `pieces[i]` (llama.cpp's
    ``get_overlapping_token_sequences``, on text rather than bytes: the same for the ASCII breakers people use)."""
    tails: dict[int, list[tuple[int, ...]]] = {}
    for s in strings:
        s = s.encode()[:MAX_CHAR_LEN].decode(errors="ignore")
        if not s:
            continue
        for token, word in enumerate(pieces):
            if s in word:
                _add(tails, token, ())
                continue
            pos = word.find(s[0])
            while pos != -1:
                overlap = len(word) - pos
                if overlap < len(s) and word[pos:] == s[:overlap]:
                    _add(tails, token, tuple(encode(s[overlap:])[:MAX_SEQ_LEN]))
                pos = word.find(s[0], pos + 1)
    return Breakers({k: tuple(v) for k, v in tails.items()})


def _add(tails: dict[int, list[tuple[int, ...]]], token: int, tail: tuple[int, ...]) -> None:
    known = tails.setdefault(token, [])
    if tail not in known:
        known.append(tail)


# Finding breakers reads every token's text (~0.5 s to decode a 49k vocabulary), so each tokenizer keeps its tokens'
# texts and its tables.
_PIECES: "weakref.WeakKeyDictionary[Any, list[str]]" = weakref.WeakKeyDictionary()
_CACHE: "weakref.WeakKeyDictionary[Any, dict[tuple[str, ...], Breakers]]" = weakref.WeakKeyDictionary()


def breakers_for(tokenizer: Any, strings: Sequence[str]) -> Breakers:
    """`strings` as breakers on `tokenizer`'s vocabulary, a ``core.model.tokenizer.ChatTokenizer`` (cached per
    tokenizer)."""
    known = _CACHE.setdefault(tokenizer, {})
    key = tuple(strings)
    if key not in known:
        if tokenizer not in _PIECES:
            ids = [[i] for i in range(tokenizer.vocab_size)]
            _PIECES[tokenizer] = tokenizer.hf.batch_decode(ids, skip_special_tokens=False)
        known[key] = build_breakers(key, _PIECES[tokenizer], tokenizer.encode)
    return known[key]


def repeats(history: Sequence[int], breakers: Breakers, allowed: int) -> dict[int, int]:
    """Token id → the length of the longest repeat that emitting it would extend (steps 1-3; only lengths of at
    least `allowed`). The native op's algorithm, for the path without it and for the inspector."""
    h, n = list(history), len(history)
    if n <= allowed:
        return {}
    rat = lambda i: h[n - 1 - i]  # noqa: E731  (llama.cpp's ring buffer, indexed from the newest)
    rep_limit = n
    for i in range(n):
        longest = -1
        for tail in breakers.tails.get(rat(i), ()):
            if longest < len(tail) <= i and all(tail[o] == rat(i - o - 1) for o in range(len(tail))):
                longest = len(tail)
        if longest >= 0:
            rep_limit = i - longest
            break
    if rep_limit < allowed:
        return {}
    count = [0] * n
    last, lt, rt = n - 1, 0, 0
    for k in range(1, n):
        if k > rt:
            m = 0
            while m + k < n and rat(m) == rat(m + k):
                m += 1
            count[last - k] = min(m, rep_limit)
            if m > 0:
                lt, rt = k, k + m - 1
        else:
            p, right = k - lt, rt - k + 1
            if count[last - p] < right:
                count[last - k] = min(count[last - p], rep_limit)
            else:
                i = rt + 1
                while i < n and rat(i) == rat(i - k):
                    i += 1
                count[last - k] = min(i - k, rep_limit)
                lt, rt = k, i - 1
    out: dict[int, int] = {}
    for i in range(n - 1):
        if count[i] >= allowed:
            token = rat(n - 2 - i)
            out[token] = max(out.get(token, 0), count[i])
    return out


def exponent_cap(base: float) -> int:
    """llama.cpp's largest exponent for `base` (0: no cap), so that base^exponent stays a finite float."""
    return int(FLOAT_MAX_LOG / math.log(base)) if base > 1.000001 else 0


def penalties(history: Sequence[int], breakers: Breakers, multiplier: float, base: float,
              allowed: int) -> dict[int, float]:
    """Token id → how much DRY lowers its logit after `history` (step 4 over `repeats`)."""
    cap = exponent_cap(base)
    out = {}
    for token, length in repeats(history, breakers, allowed).items():
        if breakers.single(token):
            continue
        exponent = length - allowed
        if cap > 0:
            exponent = min(exponent, cap)
        out[token] = multiplier * base ** exponent
    return out


def repeat_length(shift: float, multiplier: float, base: float, allowed: int) -> int:
    """The repeat length a DRY shift of `shift` (negative) stands for: the inverse of step 4, for the inspector."""
    return allowed + round(math.log(-shift / multiplier) / math.log(base))


__all__ = ["NO_BREAKERS", "Breakers", "breakers_for", "build_breakers", "penalties", "repeat_length", "repeats"]
