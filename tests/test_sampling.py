"""The sampler chain against NumPy references, statistically, and as properties (hypothesis)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxchat.core import native
from mlxchat.core.sampling.profile import SamplingProfile
from mlxchat.core.sampling.candidates import CANDIDATES, Candidates, log_softmax, top_index
from mlxchat.core.sampling.draw import gumbel_argmax, gumbel_positions, step_pair, step_words, uniform_at
from mlxchat.core.sampling.chain import (
    FLOAT_MAX, XTC, FrequencyPenalty, LogitBias, MinP, MinTokens, PresencePenalty, RepetitionPenalty,
    Sampler, Temperature, TokenHistory, TopK, TopP, TypicalP,
)

KEY = mx.random.key(0)
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- NumPy references (float64) -------------------------------------------------------------------------------------

def softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def ref_top_k(x: np.ndarray, k: int) -> np.ndarray:
    keep = np.zeros(x.size, bool)
    keep[np.argsort(-x, kind="stable")[:k]] = True
    return keep


def ref_top_p(x: np.ndarray, p: float) -> np.ndarray:
    probs = softmax(x)
    order = np.argsort(-probs, kind="stable")
    before = np.cumsum(probs[order]) - probs[order]
    keep = np.zeros(x.size, bool)
    keep[order[before < p]] = True
    return keep


def ref_min_p(x: np.ndarray, m: float) -> np.ndarray:
    probs = softmax(x)
    return probs >= m * probs.max()


def ref_typical(x: np.ndarray, p: float) -> np.ndarray:
    probs = softmax(x)
    logp = np.log(probs)
    entropy = -(probs * logp).sum()
    order = np.argsort(np.abs(-logp - entropy), kind="stable")
    before = np.cumsum(probs[order]) - probs[order]
    keep = np.zeros(x.size, bool)
    keep[order[before < p]] = True
    return keep


def ref_xtc(x: np.ndarray, threshold: float) -> np.ndarray:
    probs = softmax(x)
    above = probs >= threshold
    if above.sum() < 2:
        return np.ones(x.size, bool)
    return ~(above & (probs > probs[above].min()))


def dense_probs(c: Candidates, vocab: int) -> np.ndarray:
    """The candidate set's distribution spread back over the vocabulary."""
    probs = np.zeros(vocab)
    ids = np.arange(vocab) if c.ids is None else np.array(c.ids)
    probs[ids] = softmax(np.array(c.logits))
    return probs


def random_logits(vocab: int, seed: int, scale: float = 2.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(vocab) * scale).astype(np.float32)


def run(transform, x: np.ndarray) -> np.ndarray:
    return dense_probs(transform(Candidates(mx.array(x), None), KEY), x.size)


def check_against(x: np.ndarray, keep: np.ndarray, got: np.ndarray) -> None:
    assert np.array_equal(got > 0, keep), f"kept {np.flatnonzero(got > 0)}, expected {np.flatnonzero(keep)}"
    want = np.where(keep, softmax(x), 0)
    np.testing.assert_allclose(got, want / want.sum(), rtol=1e-4, atol=1e-7)


# --- each transform against its reference -------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("k", [1, 5, 40, 499, 500, 1000])
def test_top_k(seed: int, k: int) -> None:
    x = random_logits(500, seed)
    check_against(x, ref_top_k(x, k), run(TopK(k), x))


@pytest.mark.parametrize("path", ["native", "partial sorts"])
def test_top_k_over_a_large_vocabulary_keeps_the_k_largest_with_ties_and_a_tail(
        path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Both of top_index's paths: the native op where it runs, and the partial sorts by blocks (Metal, or no extension).
    if path == "native" and not native.available():
        pytest.skip(f"native extension unavailable: {native.unavailable_reason()}")
    if path == "partial sorts":
        monkeypatch.setenv("MLXCHAT_NATIVE", "0")
    rng = np.random.default_rng(7)
    for n, k in ((49157, 1), (49157, 40), (49152, 40), (30000, 100)):
        x = np.round(rng.normal(0, 3, n)).astype(np.float32)  # many ties, also at the k-th value
        x[rng.random(n) < 0.3] = -np.inf
        x[-1] = 50.0  # the largest value sits in the tail past the last whole block
        idx = np.array(top_index(mx.array(x), k))
        assert len(set(idx.tolist())) == k and n - 1 in idx
        np.testing.assert_array_equal(np.sort(x[idx]), np.sort(x)[-k:])


def test_native_uniform_numbers_are_the_mlx_ops_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    # The seeded draw must not depend on whether the extension runs: the same (seed, position) gives the same noise.
    if not native.available():
        pytest.skip(f"native extension unavailable: {native.unavailable_reason()}")
    ids = mx.concatenate([mx.arange(49152, dtype=mx.uint32), mx.array([2**32 - 1, 2**31], mx.uint32)])
    for position in range(8):
        words = step_words(99, position, position % 2)
        fast = uniform_at(ids, words)
        with monkeypatch.context() as m:
            m.setenv("MLXCHAT_NATIVE", "0")
            composed = uniform_at(ids, words)
        assert mx.array_equal(fast, composed).item()


def test_native_draw_is_the_mlx_ops_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    """The native Gumbel-max draw (`draw.gumbel_positions`: no noise for masked tokens) picks the position MLX's
    composed ops pick, and a batch's per-row words give each row its own draw: rows of the vocabulary's size with
    ties, masked tokens, a fully masked row and a NaN, vocabulary ids shared or candidate ids per row."""
    if not native.available():
        pytest.skip(f"native extension unavailable: {native.unavailable_reason()}")
    rng = np.random.default_rng(5)
    x = rng.normal(0, 2, (4, 49152)).astype(np.float32)
    x[:, ::3] = np.round(x[:, ::3])
    x[rng.random(x.shape) < 0.9] = -np.inf
    x[1] = -np.inf
    x[2, 77] = np.nan
    ids = [mx.arange(49152, dtype=mx.uint32), mx.array(rng.permutation(4 * 49152).reshape(4, -1).astype(np.uint32))]
    words = mx.array([step_pair(3, p, 0) for p in range(4)], mx.uint32)
    for i in ids:
        fast = gumbel_positions(mx.array(x), i, words)
        alone = [gumbel_positions(mx.array(x[r]), i if i.ndim == 1 else i[r], words[r]).item() for r in range(4)]
        with monkeypatch.context() as m:
            m.setenv("MLXCHAT_NATIVE", "0")
            composed = gumbel_positions(mx.array(x), i, words)
        assert fast.tolist() == composed.tolist() == alone
        assert fast[1].item() == 0 and fast[2].item() == 77


def test_native_top_k_takes_the_lowest_positions_of_a_tie() -> None:
    if not native.available():
        pytest.skip(f"native extension unavailable: {native.unavailable_reason()}")
    x = mx.array([1.0, 3.0, 3.0, 2.0, 3.0, -np.inf])
    assert np.array(native.top_k_index(x, 2)).tolist() == [1, 2]
    assert np.array(native.top_k_index(mx.array([-np.inf] * 5 + [0.5]), 3)).tolist() == [0, 1, 5]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.99])
def test_top_p(seed: int, p: float) -> None:
    x = random_logits(800, seed)
    check_against(x, ref_top_p(x, p), run(TopP(p), x))


def test_top_p_partial_sort_is_exact_when_nucleus_fits() -> None:
    # A vocabulary larger than CANDIDATES, peaked enough that the nucleus holds a few hundred tokens.
    x = random_logits(20_000, 7, scale=4.0)
    keep = ref_top_p(x, 0.9)
    assert 10 < keep.sum() < CANDIDATES
    check_against(x, keep, run(TopP(0.9), x))


def test_top_p_and_typical_p_are_exact_beyond_the_candidate_cap() -> None:
    # A flat distribution: the exact nucleus holds most of the vocabulary (was: cut to the 1024 most likely).
    x = random_logits(20_000, 8, scale=0.5)
    assert ref_top_p(x, 0.9).sum() > CANDIDATES
    check_against(x, ref_top_p(x, 0.9), run(TopP(0.9), x))
    assert ref_typical(x, 0.9).sum() > CANDIDATES
    check_against(x, ref_typical(x, 0.9), run(TypicalP(0.9), x))


def test_temperature_first_then_top_p_matches_numpy_on_flattish_logits() -> None:
    """Issue #12 item 19: sampler_order temperature -> top_p, T=1.5, p=0.9 capped 370 of 479 real rows."""
    x = random_logits(49_152, 11, scale=1.5)
    s = Sampler(SamplingProfile(temperature=1.5, top_p=0.9, sampler_order=["temperature", "top_p"], seed=0),
                vocab_size=x.size, eos_ids=set())
    c = Candidates(mx.array(x), None)
    for t in s.transforms:
        c = t(c, KEY)
    tempered = x / 1.5
    assert ref_top_p(tempered, 0.9).sum() > CANDIDATES
    check_against(tempered, ref_top_p(tempered, 0.9), dense_probs(c, x.size))


def test_top_p_normaliser_is_accurate_over_a_large_vocabulary() -> None:
    """Issue #12 item 18: a sequential float32 sum put this cut at the wrong token."""
    x = np.random.default_rng(0).uniform(-.01, .01, 49152).astype(np.float32)
    x[1] = 9
    x[0] = 10.9552412
    assert set(np.flatnonzero(ref_top_p(x, 0.5))) == {0, 1}
    assert set(np.flatnonzero(run(TopP(0.5), x) > 0)) == {0, 1}


def test_xtc_threshold_zero_keeps_only_the_least_likely_even_when_probabilities_underflow() -> None:
    """Issue #12 item 20: two tokens whose probabilities underflow to 0 in float32 both survived."""
    x = np.array([0.0, -200.0, -300.0, 50.0], np.float32)
    kept = np.flatnonzero(run(XTC(0.0, 1.0), x) > 0)
    assert list(kept) == [2]


def test_logprobs_near_the_float32_maximum_are_finite_and_normalised() -> None:
    """Issue #12 item 21: `x - logsumexp(x)` lost the normaliser (0, 0) or gave NaN near float32's maximum."""
    big = float(np.finfo(np.float32).max)
    x = np.array([big, big, 0.0, 1.0], np.float32)
    s = Sampler(SamplingProfile(temperature=0), vocab_size=4, eos_ids=set())
    _, lp = s.step(mx.array(x))
    lp = np.array(lp)
    assert np.isfinite(lp[:2]).all()
    np.testing.assert_allclose(lp[:2], [math.log(0.5)] * 2, rtol=1e-6)
    # A penalty that overflows to +inf (repetition_penalty < 1 on a huge logit) must not make NaN either.
    r = Sampler(SamplingProfile(temperature=0, repetition_penalty=0.5, penalize_prompt=True), vocab_size=4,
                eos_ids=set(), prompt_ids=[0])
    token, lp = r.step(mx.array(x))
    assert token.item() == 0 and not np.isnan(np.array(lp)).any()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("m", [0.01, 0.1, 0.5, 1.0])
def test_min_p(seed: int, m: float) -> None:
    x = random_logits(500, seed)
    check_against(x, ref_min_p(x, m), run(MinP(m), x))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("p", [0.2, 0.5, 0.9])
def test_typical_p(seed: int, p: float) -> None:
    x = random_logits(600, seed)
    check_against(x, ref_typical(x, p), run(TypicalP(p), x))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("threshold", [0.01, 0.05, 0.1, 0.6])
def test_xtc_when_it_fires(seed: int, threshold: float) -> None:
    x = random_logits(100, seed, scale=3.0)
    check_against(x, ref_xtc(x, threshold), run(XTC(threshold, 1.0), x))


def test_xtc_never_fires_with_probability_zero() -> None:
    x = random_logits(100, 0, scale=3.0)
    check_against(x, np.ones(100, bool), run(XTC(0.01, 0.0), x))


@pytest.mark.parametrize("t", [0.3, 1.0, 1.7])
def test_temperature(t: float) -> None:
    x = random_logits(300, 1)
    np.testing.assert_allclose(run(Temperature(t), x), softmax(x / t), rtol=1e-4, atol=1e-8)


def test_chain_order_matters_and_is_followed() -> None:
    x = random_logits(400, 3)
    profile = dict(temperature=1.8, top_p=0.5, seed=1)
    default = Sampler(SamplingProfile(**profile), vocab_size=400, eos_ids=set())
    first = Sampler(SamplingProfile(**profile, sampler_order=["temperature", "top_p"]), vocab_size=400, eos_ids=set())
    assert default.describe() == "TopP(0.5) → Temperature(1.8) → sample"
    assert first.describe() == "Temperature(1.8) → TopP(0.5) → sample"
    c = Candidates(mx.array(x), None)
    for t in first.transforms:
        c = t(c, KEY)
    check_against(x / 1.8, ref_top_p(x / 1.8, 0.5), dense_probs(c, 400))
    assert ref_top_p(x / 1.8, 0.5).sum() > ref_top_p(x, 0.5).sum()


# --- processors ----------------------------------------------------------------------------------------------------

def history(vocab: int, tokens: list[int], window: int = 0, prompt: list[int] | None = None) -> TokenHistory:
    h = TokenHistory(vocab, window, prompt or [], track=True)
    for t in tokens:
        h.accept(mx.array(t, mx.int32))
    return h


def test_penalties_match_openai_and_ctrl_formulas() -> None:
    x = random_logits(50, 4)
    tokens = [3, 3, 7, 10, 3, 7]
    counts = np.bincount(tokens, minlength=50).astype(np.float64)
    h = history(50, tokens)
    np.testing.assert_allclose(np.array(FrequencyPenalty(0.5)(mx.array(x), h)), x - 0.5 * counts, rtol=1e-6)
    np.testing.assert_allclose(np.array(PresencePenalty(-0.7)(mx.array(x), h)), x + 0.7 * (counts > 0), rtol=1e-6)
    rep = np.where(counts > 0, np.where(x > 0, x / 1.3, x * 1.3), x)
    np.testing.assert_allclose(np.array(RepetitionPenalty(1.3)(mx.array(x), h)), rep, rtol=1e-6)


def test_penalty_window_and_prompt() -> None:
    h = history(20, [1, 2, 2, 3, 4], window=3)
    np.testing.assert_array_equal(np.array(h.counts), np.bincount([2, 3, 4], minlength=20))
    h = history(20, [5], window=3, prompt=[9, 8, 7, 6])
    np.testing.assert_array_equal(np.array(h.counts), np.bincount([7, 6, 5], minlength=20))
    h = history(20, [5], prompt=[9, 9])
    np.testing.assert_array_equal(np.array(h.counts), np.bincount([9, 9, 5], minlength=20))
    assert np.array(h.ids).tolist() == [9, 9, 5]


def test_the_penalties_in_one_scatter_equal_each_processor_in_turn_bit_for_bit() -> None:
    x = mx.array(random_logits(300, 9) * 4)
    profile = SamplingProfile(temperature=0, repetition_penalty=0.7, frequency_penalty=0.4, presence_penalty=-0.3,
                              logit_bias={3: 2.5}, min_tokens=10, penalty_window=6, penalize_prompt=True)
    s = Sampler(profile, vocab_size=300, eos_ids={0, 1}, prompt_ids=[7, 7, 8])
    s.replay([7, 10, 10, 11, 12, 12, 7])
    dense = x
    for proc in s.processors:  # what traced_step runs, one processor after the other
        dense = proc(dense, s.history)
    assert np.array(s.history.ids).tolist() == [10, 10, 11, 12, 12, 7]
    dense = mx.array(np.array(dense))  # evaluated before `step` counts its token
    np.testing.assert_array_equal(np.array(s.step(x)[1]), np.array(log_softmax(mx.minimum(dense, FLOAT_MAX))))
    want = np.array(x)
    counts = np.bincount([10, 10, 11, 12, 12, 7], minlength=300)  # the window: the last 6 ids, prompt and reply
    want = np.where(counts > 0, np.where(want > 0, want / np.float32(0.7), want * np.float32(0.7)), want)
    want = want - np.float32(0.4) * counts - np.where(counts > 0, np.float32(-0.3), 0)
    want[3] += 2.5
    want[[0, 1]] = -np.inf
    np.testing.assert_allclose(np.array(dense), want, rtol=1e-6)


def test_prompt_counts_only_when_asked() -> None:
    x = mx.zeros(10)
    x[4] = 1.0
    for penalize, expected in ((False, 4), (True, 3)):
        s = Sampler(SamplingProfile(temperature=0, presence_penalty=2, penalize_prompt=penalize), vocab_size=10,
                    eos_ids=set(), prompt_ids=[4, 4, 4])
        x3 = x.at[3].add(0.5)
        assert s.step(x3)[0].item() == expected


def test_logit_bias_and_logprobs_of_processed_logits() -> None:
    x = random_logits(30, 5)
    s = Sampler(SamplingProfile(temperature=0, logit_bias={2: 100, 5: -100}), vocab_size=30, eos_ids=set())
    token, logprobs = s.step(mx.array(x))
    assert token.item() == 2
    processed = x.astype(np.float64)
    processed[2] += 100
    processed[5] -= 100
    np.testing.assert_allclose(np.array(logprobs), np.log(softmax(processed)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(LogitBias({1: 3.0}, 30)(mx.array(x), history(30, []))) - x,
                               np.eye(30)[1] * 3, atol=1e-6)


def test_min_tokens_bans_eos_until_reached() -> None:
    x = mx.array(np.r_[10.0, 0.0, 1.0, 9.0].astype(np.float32))  # EOS ids 0 and 3 are the two best
    s = Sampler(SamplingProfile(temperature=0, min_tokens=3), vocab_size=4, eos_ids={0, 3})
    assert [s.step(x)[0].item() for _ in range(4)] == [2, 2, 2, 0]
    banned = MinTokens(1, {0})(x, history(4, []))
    assert np.array(banned)[0] == -np.inf


@given(st.integers(2, 40), st.integers(0, 2**32 - 1), st.lists(st.integers(0, 39), max_size=30),
       st.integers(0, 5), st.booleans())
@SETTINGS
def test_zero_strength_penalties_change_nothing(vocab: int, seed: int, tokens: list[int], window: int,
                                                 prompt: bool) -> None:
    x = mx.array(random_logits(vocab, seed))
    h = history(vocab, [t % vocab for t in tokens], window, [t % vocab for t in tokens] if prompt else None)
    for proc in (FrequencyPenalty(0.0), PresencePenalty(0.0), RepetitionPenalty(1.0)):
        assert np.array_equal(np.array(proc(x, h)), np.array(x))
    zero = SamplingProfile(temperature=0.9, frequency_penalty=0, presence_penalty=0, repetition_penalty=1, seed=seed)
    assert Sampler(zero, vocab_size=vocab, eos_ids=set()).processors == []


# --- the sampler end to end ----------------------------------------------------------------------------------------

def test_greedy_is_argmax() -> None:
    for seed in range(5):
        x = mx.array(random_logits(49152, seed))
        s = Sampler(SamplingProfile(temperature=0), vocab_size=49152, eos_ids={2})
        token, logprobs = s.step(x)
        assert token.dtype == mx.int32 and token.shape == ()
        assert token.item() == mx.argmax(x).item()
        assert logprobs.shape == (49152,) and logprobs.dtype == mx.float32
        assert s.describe() == "greedy"


def tokens_of(profile: SamplingProfile, x: np.ndarray, n: int) -> list[int]:
    s = Sampler(profile, vocab_size=x.size, eos_ids=set())
    out = [s.step(mx.array(x))[0] for _ in range(n)]
    mx.eval(out)
    return [t.item() for t in out]


def test_seeded_sampling_is_reproducible_and_seeds_differ() -> None:
    x = random_logits(1000, 6, scale=1.0)
    profile = SamplingProfile(temperature=1.2, top_p=0.95, frequency_penalty=0.3, seed=1234)
    first = tokens_of(profile, x, 40)
    assert tokens_of(profile, x, 40) == first
    assert tokens_of(profile.model_copy(update={"seed": 1235}), x, 40) != first
    unseeded = Sampler(profile.model_copy(update={"seed": None}), vocab_size=1000, eos_ids=set())
    assert isinstance(unseeded.seed, int)
    again = tokens_of(profile.model_copy(update={"seed": unseeded.seed}), x, 10)
    assert [unseeded.step(mx.array(x))[0].item() for _ in range(10)] == again


def ref_uniform(token_id: int, words: list[int]) -> float:
    """`uniform_at` in plain Python integers: MurmurHash3's finaliser twice, the top 23 bits, centred."""
    def fmix(h: int) -> int:
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        return h ^ (h >> 16)
    return ((fmix(fmix(token_id ^ words[0]) ^ words[1]) >> 9) + 0.5) / (1 << 23)


def test_the_noise_is_the_same_integer_hash_on_every_backend() -> None:
    words = step_words(2**64 - 5, 17, 0)
    ids = [0, 1, 2, 49151, 2**31 + 7, 2**32 - 1]
    got = uniform_at(mx.array(ids, mx.uint32), words).tolist()
    assert got == [ref_uniform(i, words.tolist()) for i in ids]
    assert step_words(1, 0, 0).tolist() != step_words(1, 1, 0).tolist() != step_words(2, 0, 0).tolist()
    assert step_words(1, 0, 0).tolist() != step_words(1, 0, 1).tolist()


def test_the_draw_does_not_depend_on_the_candidates_order() -> None:
    x = mx.array(random_logits(5000, 21, scale=1.0))
    perm = mx.array(np.random.default_rng(0).permutation(5000).astype(np.uint32))
    vocab = mx.arange(5000, dtype=mx.uint32)
    for position in range(50):
        words = step_words(7, position, 0)
        whole = gumbel_argmax(Candidates(x, None), words, vocab).item()
        assert gumbel_argmax(Candidates(x[perm], perm), words, vocab).item() == whole


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_stage_that_cuts_nothing_the_rest_keeps_does_not_change_the_draw(seed: int) -> None:
    """The issue's case: top_k 1000 cuts nothing top_p 0.9 keeps, so the final distribution and the tokens match."""
    x = random_logits(49152, seed, scale=6.0)
    top = ref_top_k(x, 1000)
    assert (ref_top_p(np.where(top, x, -np.inf), 0.9) == ref_top_p(x, 0.9)).all()  # the same final distribution
    plain = SamplingProfile(temperature=0.8, top_p=0.9, seed=seed)
    assert tokens_of(plain.model_copy(update={"top_k": 1000}), x, 40) == tokens_of(plain, x, 40)
    assert tokens_of(plain.model_copy(update={"top_k": 1000, "sampler_order": ["top_p", "top_k", "temperature"]}),
                     x, 40) == tokens_of(plain, x, 40)


def test_last_bit_logit_noise_moves_the_draw_only_at_near_ties() -> None:
    """A cached prefix and a fresh prefill, or a GEMM and a GEMV, differ in the last bits of the logits: the draw
    follows the distribution, not those bits."""
    x = random_logits(49152, 5, scale=3.0)
    nudged = x * (1 + np.random.default_rng(1).uniform(-2e-7, 2e-7, x.size)).astype(np.float32)
    profile = SamplingProfile(temperature=1.0, top_p=0.95, seed=11)
    a, b = tokens_of(profile, x, 200), tokens_of(profile, nudged, 200)
    assert sum(i != j for i, j in zip(a, b)) <= 1


def test_replayed_tokens_keep_the_positions_of_the_draw() -> None:
    x = random_logits(300, 2)
    profile = SamplingProfile(temperature=1.0, seed=4)
    whole = tokens_of(profile, x, 12)
    resumed = Sampler(profile, vocab_size=300, eos_ids=set())
    resumed.replay(whole[:5])
    assert [resumed.step(mx.array(x))[0].item() for _ in range(7)] == whole[5:]


def test_global_random_state_is_untouched() -> None:
    mx.random.seed(99)
    expected = mx.random.uniform().item()
    mx.random.seed(99)
    tokens_of(SamplingProfile(temperature=1.0, xtc_probability=0.5, seed=3), random_logits(50, 0), 5)
    assert mx.random.uniform().item() == expected


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """Wilson–Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("settings_, ref", [
    (dict(temperature=0.7, top_k=8), lambda x: np.where(ref_top_k(x, 8), softmax(x / 0.7), 0)),
    (dict(temperature=1.3, top_p=0.8), lambda x: np.where(ref_top_p(x, 0.8), softmax(x / 1.3), 0)),
    (dict(temperature=1.0, min_p=0.1), lambda x: np.where(ref_min_p(x, 0.1), softmax(x), 0)),
])
def test_sampled_frequencies_match_the_transformed_distribution(settings_: dict, ref) -> None:
    x = random_logits(24, 11, scale=1.5)
    expected = ref(x)
    expected /= expected.sum()
    n = 6000
    counts = np.bincount(tokens_of(SamplingProfile(**settings_, seed=2024), x, n), minlength=x.size)
    assert counts[expected == 0].sum() == 0
    # Pool the rare outcomes so that every bin expects at least 5 draws.
    e, o = n * expected[expected > 0], counts[expected > 0]
    rare = e < 5
    if rare.any():
        e, o = np.r_[e[~rare], e[rare].sum()], np.r_[o[~rare], o[rare].sum()]
    stat = ((o - e) ** 2 / e).sum()
    assert stat < chi_square_critical(len(e) - 1), f"chi-square {stat:.1f} over {len(e) - 1} dof"


def test_top_logprobs_helper() -> None:
    x = random_logits(100, 9)
    s = Sampler(SamplingProfile(temperature=0.5, seed=5, logprobs=True, top_logprobs=5), vocab_size=100,
                eos_ids=set())
    token, logprobs = s.step(mx.array(x))
    mx.eval(token, logprobs)
    chosen, top = s.top_logprobs(logprobs, token, 5)
    ref = np.log(softmax(x))
    assert chosen == pytest.approx(ref[token.item()], abs=1e-5)
    assert [i for i, _ in top] == list(np.argsort(-ref)[:5])
    assert all(lp == pytest.approx(ref[i], abs=1e-5) for i, lp in top)
    assert s.top_logprobs(logprobs, token.item(), 0)[1] == []


def test_out_of_vocabulary_ids_are_rejected() -> None:
    with pytest.raises(ValueError, match="logit_bias has token id 10"):
        Sampler(SamplingProfile(logit_bias={10: 1.0}), vocab_size=10, eos_ids=set())
    with pytest.raises(ValueError, match="eos_ids"):
        Sampler(SamplingProfile(), vocab_size=10, eos_ids={12})


# --- properties ----------------------------------------------------------------------------------------------------

@st.composite
def masked_logits(draw, max_vocab: int = 48) -> np.ndarray:
    vocab = draw(st.integers(2, max_vocab))
    values = draw(st.lists(st.floats(-30, 30, width=32), min_size=vocab, max_size=vocab))
    mask = draw(st.lists(st.booleans(), min_size=vocab, max_size=vocab))
    x = np.where(mask, -np.inf, np.array(values, np.float32)).astype(np.float32)
    x[draw(st.integers(1, vocab - 1))] = values[0]  # at least one token (not the EOS id 0) stays in play
    return x


def valid_profiles(vocab: int) -> st.SearchStrategy[SamplingProfile]:
    unit_open = st.floats(0.01, 1.0)
    return st.builds(
        SamplingProfile,
        temperature=st.one_of(st.just(0.0), st.floats(1e-6, 2.0)),
        top_k=st.integers(0, vocab + 2),
        top_p=unit_open, min_p=st.floats(0.0, 1.0), typical_p=unit_open,
        xtc_threshold=st.floats(0.0, 1.0), xtc_probability=st.floats(0.0, 1.0),
        frequency_penalty=st.floats(-2, 2), presence_penalty=st.floats(-2, 2),
        repetition_penalty=st.floats(0.1, 3.0),
        logit_bias=st.dictionaries(st.integers(0, vocab - 1), st.floats(-100, 100), max_size=3),
        min_tokens=st.integers(0, 3), penalty_window=st.integers(0, 4), penalize_prompt=st.booleans(),
        seed=st.integers(0, 2**64 - 1),
        sampler_order=st.one_of(st.none(), st.permutations(
            ["top_k", "typical_p", "top_p", "min_p", "xtc", "temperature"]).map(list)),
    )


@given(st.data())
@SETTINGS
def test_any_logits_and_profile_give_a_valid_unmasked_token(data) -> None:
    x = data.draw(masked_logits())
    profile = data.draw(valid_profiles(x.size))
    s = Sampler(profile, vocab_size=x.size, eos_ids={0}, prompt_ids=[1, 1, 0])
    assert s.describe() == profile.describe_chain()
    for _ in range(3):
        token, logprobs = s.step(mx.array(x))
        t = token.item()
        assert 0 <= t < x.size and np.isfinite(x[t]), f"token {t} for logits {x} with {s.describe()}"
        if profile.min_tokens and s.history.generated <= profile.min_tokens:
            assert t != 0
        lp = np.array(logprobs)
        assert np.exp(lp.astype(np.float64)).sum() == pytest.approx(1.0, abs=1e-4)


TRANSFORMS = st.one_of(
    st.integers(1, 60).map(TopK), st.floats(0.01, 1.0).map(TopP), st.floats(0.0, 1.0).map(MinP),
    st.floats(0.01, 1.0).map(TypicalP), st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 1.0)).map(lambda a: XTC(*a)),
    st.floats(1e-3, 2.0).map(Temperature),
)


@given(masked_logits(), st.lists(TRANSFORMS, min_size=1, max_size=4), st.integers(0, 2**32 - 1))
@SETTINGS
def test_masked_tokens_stay_masked_and_probabilities_sum_to_one(x: np.ndarray, chain: list, seed: int) -> None:
    c = Candidates(mx.array(x), None)
    key = mx.random.key(seed)
    for t in chain:
        c = t(c, key)
    probs = dense_probs(c, x.size)
    assert probs.sum() == pytest.approx(1.0, abs=1e-6)
    assert (probs[~np.isfinite(x)] == 0).all()
    assert (probs > 0).sum() >= 1
    token = mx.random.categorical(c.logits, key=key)
    token = (token if c.ids is None else c.ids[token]).item()
    assert np.isfinite(x[token])


@given(masked_logits(), st.floats(1e-6, 1.0))
@SETTINGS
def test_top_p_keeps_at_least_one_token_and_matches_reference(x: np.ndarray, p: float) -> None:
    kept = run(TopP(p), x) > 0
    assert kept.sum() >= 1
    # float32 cumulative sums may differ from float64 right at the boundary: bracket by a nudge of p.
    lo, hi = ref_top_p(x, max(p - 1e-5, 1e-9)), ref_top_p(x, min(p + 1e-5, 1.0))
    # Tokens tied with the last kept one are kept together, so the reference is widened to ties.
    finite = x[kept & np.isfinite(x)]
    # Equally likely tokens with different logits (0 and 2e-41: exp rounds both to 1) are interchangeable at the
    # cut: the sampler ranks them by logit, the reference by its stable sort (found by Hypothesis).
    probs = softmax(x)
    interchangeable = probs == probs[kept].min()
    assert (lo & ~kept & ~interchangeable).sum() == 0 and (kept & ~(hi | (x >= finite.min()))).sum() == 0


@given(masked_logits(), st.integers(0, 2**32 - 1))
@SETTINGS
def test_temperature_towards_zero_is_greedy(x: np.ndarray, seed: int) -> None:
    finite = np.sort(x[np.isfinite(x)])
    if finite.size > 1 and finite[-1] - finite[-2] < 1e-3:
        x = x.copy()
        x[np.argmax(x)] += 1e-2  # a unique best token, so that greedy is well defined
    best = int(np.argmax(x))
    greedy = Sampler(SamplingProfile(temperature=0), vocab_size=x.size, eos_ids=set()).step(mx.array(x))[0].item()
    cold = Sampler(SamplingProfile(temperature=1e-6, seed=seed), vocab_size=x.size, eos_ids=set())
    assert greedy == best == cold.step(mx.array(x))[0].item()


def test_native_penalties_are_the_graphs_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    # The penalties' one op must give what the composed graph gives, so a seed draws alike with or without the
    # extension: repeated ids, a count of zero at an id, negative, zero, -inf and huge logits, each penalty alone.
    if not native.available():
        pytest.skip(f"native extension unavailable: {native.unavailable_reason()}")
    rng = np.random.default_rng(5)
    vocab = 4096
    x = (rng.standard_normal(vocab) * 4).astype(np.float32)
    x[:4] = [0.0, -np.inf, 3e38, -0.0]
    prompt = [int(t) for t in rng.integers(0, 64, 300)] + [0, 1, 2, 3, 3]
    logits = mx.array(x)
    for r, f, p in [(1.3, 0.5, 0.3), (0.7, 0.0, 0.0), (1.0, 1.5, 0.0), (1.0, 0.0, 2.0), (1.1, -0.4, -0.2)]:
        profile = SamplingProfile(temperature=0, repetition_penalty=r, frequency_penalty=f, presence_penalty=p,
                                  penalize_prompt=True)
        results = []
        for flag in ("1", "0"):
            with monkeypatch.context() as m:
                m.setenv("MLXCHAT_NATIVE", flag)
                sampler = Sampler(profile, vocab_size=vocab, eos_ids=frozenset(), prompt_ids=prompt)
                results.append(np.array(sampler._distribution(logits)[2]))
        np.testing.assert_array_equal(results[0].view(np.uint32), results[1].view(np.uint32))
        assert not np.array_equal(results[0], np.minimum(x, np.finfo(np.float32).max))  # the penalties did act
