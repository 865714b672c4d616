"""Top-p and typical-p without a host sync (issue 21): the native op (core/native nucleus) and every path of
`core.sampling.candidates.nucleus` against a float64 NumPy reference on flat, peaked, masked, tie-heavy and outlier
rows, and the lazy paths checked to leave their input unevaluated."""

from __future__ import annotations

import io

import mlx.core as mx
import numpy as np
import pytest

from mlxchat.core import native
from mlxchat.core.sampling.profile import SamplingProfile
from mlxchat.core.sampling.candidates import Candidates, nucleus, nucleus_path
from mlxchat.core.sampling.chain import Sampler, TopP, TypicalP
from tests.markers import needs_native

# How far the float32 exp of each token may move the mass ahead of a token (relative): the reference is bracketed by
# this much of p, so a row whose cut lies that close to p accepts either side.
SLACK = 2e-6


def reference(x: np.ndarray, p: float, typical: bool) -> np.ndarray:
    """The definition in float64: the smallest set of best-ranked finite tokens whose probability reaches p, tokens
    ranked equal to the last kept one kept too, at least one token."""
    x = x.astype(np.float64)
    finite = np.isfinite(x)
    shifted = np.where(finite, x - x[finite].max(), -np.inf)
    logp = shifted - np.log(np.exp(shifted).sum())
    probs = np.exp(logp)
    if typical:
        entropy = -(probs * np.where(finite, logp, 0.0)).sum()
        key = np.where(finite, np.abs(-logp - entropy), np.inf)
    else:
        key = np.where(finite, -x, np.inf)
    order = np.argsort(key, kind="stable")
    before = np.cumsum(probs[order]) - probs[order]
    last = key[order][max(int((before < p).sum()) - 1, 0)]
    return finite & (key <= last)


def assert_cut(x: np.ndarray, p: float, typical: bool, kept_logits: np.ndarray) -> None:
    kept = np.isfinite(kept_logits)
    lo, hi = reference(x, p * (1 - SLACK), typical), reference(x, min(p * (1 + SLACK), 1.0), typical)
    assert (lo & ~kept).sum() == 0, f"dropped {np.flatnonzero(lo & ~kept)[:10]} (kept {kept.sum()}, want {lo.sum()})"
    assert (kept & ~hi).sum() == 0, f"kept {np.flatnonzero(kept & ~hi)[:10]} (kept {kept.sum()}, want {hi.sum()})"
    assert kept.sum() >= 1
    np.testing.assert_array_equal(kept_logits[kept], x[kept])  # the kept logits pass through unchanged


def rows(vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(vocab)
    normal = rng.standard_normal(vocab)
    masked = (normal * 3).astype(np.float32)
    masked[rng.random(vocab) < 0.3] = -np.inf
    masked[np.argmax(masked)] = -np.inf  # the most likely token masked: never kept
    outlier = (normal * 3).astype(np.float32)
    outlier[0] = -3e38  # one finite token so far off that the rest share one bucket of the key range
    return {
        "flat": (normal * 0.5).astype(np.float32),
        "normal": (normal * 2).astype(np.float32),
        "peaked": (normal * 6).astype(np.float32),
        "spike": np.where(np.arange(vocab) == 7, 30.0, normal).astype(np.float32),
        "masked": masked,
        "ties": rng.integers(-4, 4, vocab).astype(np.float32),  # eight distinct values: every cut is in a tie group
        "outlier": outlier,
        # One likely token, then 2000 tied: the best 1024 hold p=0.5, but the cut's tie group reaches past them.
        "straddle": np.select([np.arange(vocab) == 3, np.arange(vocab) < 2001], [10.0, 5.0], -20.0).astype(np.float32),
    }


ROWS = [(vocab, name) for vocab in (500, 49152) for name in rows(500)]
PS = (0.05, 0.5, 0.9, 0.99)


@needs_native
@pytest.mark.parametrize("typical", [False, True])
@pytest.mark.parametrize(("vocab", "name"), ROWS)
def test_the_op_matches_a_float64_reference(vocab: int, name: str, typical: bool) -> None:
    x = rows(vocab)[name]
    for p in PS:
        assert_cut(x, p, typical, np.array(native.nucleus(mx.array(x), p, typical=typical)))


@needs_native
@pytest.mark.parametrize("typical", [False, True])
def test_the_op_keeps_one_token_at_p_zero_and_every_finite_token_at_p_one(typical: bool) -> None:
    x = rows(500)["masked"]
    best = reference(x, 1e-12, typical)
    assert best.sum() == 1
    assert np.array_equal(np.isfinite(np.array(native.nucleus(mx.array(x), 0.0, typical=typical))), best)
    assert np.array_equal(np.isfinite(np.array(native.nucleus(mx.array(x), 1.0, typical=typical))), np.isfinite(x))


@needs_native
def test_the_op_cuts_each_row_of_a_batch_and_reads_strided_input() -> None:
    batch = np.stack([rows(500)[name] for name in ("flat", "peaked", "masked", "ties")])
    got = np.array(native.nucleus(mx.array(batch), 0.9))
    for row, out in zip(batch, got, strict=True):
        assert_cut(row, 0.9, False, out)
    strided = mx.array(batch).T  # [500, 4]: each logits row is a column of the array, 4 floats apart
    np.testing.assert_array_equal(np.array(native.nucleus(strided.T, 0.9)), got)


@needs_native
def test_the_op_keeps_nothing_of_an_all_masked_row_and_rejects_bad_input() -> None:
    assert not np.isfinite(np.array(native.nucleus(mx.full((9,), -np.inf), 0.9))).any()
    with pytest.raises(ValueError, match="float32"):
        native.nucleus(mx.zeros((9,), mx.float16), 0.9)
    with pytest.raises(ValueError, match="p must be"):
        native.nucleus(mx.zeros((9,)), float("nan"))


def dense(c: Candidates, vocab: int) -> np.ndarray:
    """The candidates' logits over the vocabulary (-inf outside the set): the narrow path returns a narrowed set."""
    out = np.full(vocab, -np.inf, np.float32)
    out[np.arange(vocab) if c.ids is None else np.array(c.ids)] = np.array(c.logits)
    return out


def paths() -> list:
    return [pytest.param("native", marks=needs_native), "sort", "narrow"]


@pytest.mark.parametrize("path", paths())
@pytest.mark.parametrize("typical", [False, True])
@pytest.mark.parametrize("name", ["flat", "peaked", "masked", "ties", "straddle"])
def test_every_path_cuts_the_same_set(path: str, typical: bool, name: str) -> None:
    x = rows(49152)[name]
    for p in (0.5, 0.9):
        c = nucleus(Candidates(mx.array(x), None), p, typical=typical, path=path)
        assert_cut(x, p, typical, dense(c, x.size))


@pytest.mark.parametrize("path", paths())
def test_a_narrowed_candidate_set_is_cut_by_its_own_mass(path: str) -> None:
    x = rows(500)["normal"]
    ids = np.argsort(-x)[:40]
    c = nucleus(Candidates(mx.array(x[ids]), mx.array(ids)), 0.5, typical=False, path=path)
    assert_cut(x[ids], 0.5, False, np.array(c.logits))
    assert np.array_equal(np.array(c.ids), ids)


def evaluated(x: mx.array, out: mx.array) -> bool:
    """Whether building `out` evaluated the lazy matmul that makes `x` (it leaves the graph once computed)."""
    buf = io.StringIO()
    mx.export_to_dot(buf, out)
    return "Matmul" not in buf.getvalue()


def lazy_logits(vocab: int = 4096) -> mx.array:
    a = mx.random.normal((2, vocab), key=mx.random.key(1))
    mx.eval(a)
    return (mx.ones((1, 2)) @ a)[0] * 4  # not evaluated until something asks


@pytest.mark.parametrize("transform", [TopP(0.9), TypicalP(0.9)], ids=repr)
def test_top_p_and_typical_p_wait_on_the_device_only_without_the_native_op(transform) -> None:
    x = lazy_logits()
    out = transform(Candidates(x, None), mx.zeros(2, mx.uint32)).logits
    assert evaluated(x, out) == (nucleus_path() == "narrow")


def test_the_chat_presets_step_is_lazy_where_the_native_op_runs() -> None:
    x = lazy_logits()
    sampler = Sampler(SamplingProfile.preset("chat").model_copy(update={"seed": 1}), vocab_size=x.size, eos_ids=set())
    token, _ = sampler.step(x)
    assert evaluated(x, token) == (nucleus_path() == "narrow")
