"""Pure metric functions over output texts (formulas in docs/lab.md). Texts are split into words with `words`, so
the numbers do not depend on the model's tokenizer and two models can be compared."""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Fewer prompts (or judged pairs, or votes) than this: an interval or a kappa says little, and the lab says so.
SMALL_N = 10
_WORD = re.compile(r"\w+|[^\w\s]")
# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom; beyond 30 the normal 1.96 is close enough.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def words(text: str) -> list[str]:
    """Lower-cased words and punctuation marks: "Hi, Bob!" -> ["hi", ",", "bob", "!"]."""
    return _WORD.findall(text.lower())


def ngrams(tokens: Sequence[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


def distinct_n(text: str, n: int) -> float:
    """Distinct-n (Li et al. 2016): unique n-grams / n-grams in one output; 0 when it has no n-gram."""
    grams = ngrams(words(text), n)
    return len(set(grams)) / len(grams) if grams else 0.0


def seq_rep_n(text: str, n: int = 4) -> float:
    """seq-rep-n (Welleck et al. 2019): 1 - unique n-grams / n-grams; 0 = no repeated n-gram, near 1 = a loop."""
    grams = ngrams(words(text), n)
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def bleu(hypothesis: str, references: Sequence[str], max_n: int = 4) -> float:
    """Sentence BLEU (Papineni et al. 2002) with add-one smoothing of the 2..4-gram precisions (Lin & Och 2004), so
    short texts without a shared 4-gram do not all score 0. Identical texts score 1."""
    hyp = words(hypothesis)
    refs = [words(r) for r in references]
    if not hyp or not refs:
        return 0.0
    log_p = 0.0
    for n in range(1, max_n + 1):
        counts = Counter(ngrams(hyp, n))
        max_ref: Counter = Counter()
        for r in refs:
            max_ref |= Counter(ngrams(r, n))
        clipped = sum(min(c, max_ref[g]) for g, c in counts.items())
        total = sum(counts.values())
        if n == 1:
            if clipped == 0:
                return 0.0
            p = clipped / total
        else:
            p = (clipped + 1) / (total + 1)
        log_p += math.log(p) / max_n
    ref_len = min((len(r) for r in refs), key=lambda length: (abs(length - len(hyp)), length))
    bp = 1.0 if len(hyp) > ref_len else math.exp(1 - ref_len / len(hyp))
    return bp * math.exp(log_p)


def self_bleu(texts: Sequence[str]) -> float | None:
    """Self-BLEU (Zhu et al. 2018): mean BLEU of each text against the others; 1 = all the same. None for < 2."""
    if len(texts) < 2:
        return None
    return sum(bleu(t, [o for j, o in enumerate(texts) if j != i]) for i, t in enumerate(texts)) / len(texts)


def mean_logprob(logprobs: Sequence[float]) -> float | None:
    return sum(logprobs) / len(logprobs) if logprobs else None


@dataclass(frozen=True)
class Estimate:
    """A mean with its 95% interval [low, high] and the number of values behind it."""

    mean: float
    low: float
    high: float
    n: int

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def as_dict(self) -> dict[str, float | int]:
        return {"mean": self.mean, "low": self.low, "high": self.high, "n": self.n}


def mean_interval(values: Sequence[float]) -> Estimate | None:
    """Mean ± t(0.975, n-1)·s/√n; the interval is the mean itself for one value. None for no values."""
    n = len(values)
    if n == 0:
        return None
    m = sum(values) / n
    if n == 1:
        return Estimate(m, m, m, 1)
    s = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    h = (_T975[n - 2] if n - 1 <= len(_T975) else 1.96) * s / math.sqrt(n)
    return Estimate(m, m - h, m + h, n)


def wilson(successes: float, n: int, z: float = 1.96) -> Estimate | None:
    """Wilson score interval (Wilson 1927) for a proportion; better than p ± z·√(p(1-p)/n) at small n or p near 0/1."""
    if n == 0:
        return None
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return Estimate(p, max(0.0, centre - h), min(1.0, centre + h), n)


# --- comparing two settings fairly (issue 39, point 5) --------------------------------------------------------------
# A comparison's outcomes are paired: each (prompt, seed) gives one score for A (1 a win, 0.5 a tie, 0 a loss).

def bootstrap_mean(scores: Sequence[float], resamples: int = 2000, seed: int = 0) -> Estimate | None:
    """The mean score with a 95% percentile-bootstrap interval (pairs resampled with replacement; a fixed seed, so
    a report reads the same each time). Unlike Wilson's, it makes no assumption about ties."""
    n = len(scores)
    if n == 0:
        return None
    rng = random.Random(seed)
    means = sorted(sum(rng.choice(scores) for _ in range(n)) / n for _ in range(resamples))
    return Estimate(sum(scores) / n, means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1], n)


def sign_test(wins: int, losses: int) -> float | None:
    """The paired test: a two-sided exact sign test (binomial, p = 1/2) of wins against losses, ties left out.
    The p-value, or None when every pair tied."""
    n = wins + losses
    if n == 0:
        return None
    k = min(wins, losses)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def length_controlled(scores: Sequence[float], length_diffs: Sequence[float]) -> float | None:
    """A's win rate with the length difference regressed out (AlpacaEval's length-controlled win rate): a logistic
    fit score ~ σ(b0 + b1·tanh(Δ / sd(Δ))) by Newton's method (ties as half a win, a small ridge so that a clean
    sweep stays finite), read at Δ = 0. None with fewer than two pairs."""
    n = len(scores)
    if n < 2 or len(length_diffs) != n:
        return None
    sd = math.sqrt(sum(d * d for d in length_diffs) / n) or 1.0
    xs = [math.tanh(d / sd) for d in length_diffs]
    b0 = b1 = 0.0
    ridge = 1e-2
    for _ in range(50):
        ps = [1 / (1 + math.exp(-(b0 + b1 * x))) for x in xs]
        g0 = sum(y - p for y, p in zip(scores, ps)) - ridge * b0
        g1 = sum((y - p) * x for y, p, x in zip(scores, ps, xs)) - ridge * b1
        w = [p * (1 - p) for p in ps]
        h00 = sum(w) + ridge
        h01 = sum(wi * x for wi, x in zip(w, xs))
        h11 = sum(wi * x * x for wi, x in zip(w, xs)) + ridge
        det = h00 * h11 - h01 * h01
        if det <= 0:
            break
        d0, d1 = (h11 * g0 - h01 * g1) / det, (h00 * g1 - h01 * g0) / det
        b0, b1 = b0 + d0, b1 + d1
        if abs(d0) + abs(d1) < 1e-10:
            break
    return 1 / (1 + math.exp(-b0))


def paired_comparison(scores: Sequence[float], length_diffs: Sequence[float] | None = None) -> dict[str, Any]:
    """What every comparison of two settings reports: n, the win rate with its bootstrap interval, the sign test's
    p-value, and (given each pair's length difference A − B) the length-controlled win rate next to the raw one."""
    boot = bootstrap_mean(scores)
    wins, losses = sum(s == 1 for s in scores), sum(s == 0 for s in scores)
    return {"n": len(scores), "win_rate_bootstrap": boot.as_dict() if boot else None,
            "sign_test_p": sign_test(wins, losses),
            "lc_win_rate": length_controlled(scores, length_diffs) if length_diffs is not None else None}
