"""A batch's rows sampled as one op (core/sampling/batch_sampling.py) draw exactly the tokens each row's own
`Sampler.step` draws: greedy and seeded, for every chain shape that batches, with each row's own values, on random
logits with ties and masked tokens; and the report's log-probabilities are the same bits. The model-level check (rows of
mixed profiles through the batch scheduler) is in tests/test_server_batch.py."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxchat.core import SamplingProfile
from mlxchat.core.sampling.batch_sampling import chain_key, sample_rows
from mlxchat.core.sampling.candidates import log_softmax
from mlxchat.core.sampling.chain import Sampler

V = 3000


def _logits(rng: np.random.Generator, rows: int) -> mx.array:
    """Random logits with what breaks careless batching: ties (rounded values), masked tokens, a peaked row."""
    x = rng.normal(0, 3, (rows, V)).astype(np.float32)
    x[:, ::7] = np.round(x[:, ::7])  # ties
    x[0, rng.integers(0, V, 300)] = -np.inf  # masked tokens
    x[-1, rng.integers(0, V)] += 25  # one near-certain token
    return mx.array(x)


def _samplers(profiles: list[SamplingProfile]) -> list[Sampler]:
    return [Sampler(p, vocab_size=V, eos_ids=frozenset()) for p in profiles]


SHAPES = {
    "greedy": [dict(temperature=0)] * 2 + [dict(temperature=0, logit_bias={5: 30.0, 9: -100.0})] * 2,
    "sample": [dict(logit_bias={3: 4.0})] + [{}] * 3,
    "temperature": [dict(temperature=t) for t in (0.3, 0.7, 1.5, 2.0)],
    "top_k": [dict(top_k=20, temperature=t) for t in (0.5, 0.8, 1.2, 2.0)],
    "top_p": [dict(top_p=p, temperature=t) for p, t in ((0.5, 0.7), (0.9, 0.8), (0.95, 1.2), (0.99, 1.5))],
    "min_p": [dict(min_p=p, temperature=0.9) for p in (0.01, 0.05, 0.1, 0.3)],
    "hot": [dict(min_p=0.02, temperature=t) for t in (1.2, 1.5, 1.8, 2.0)],
    "chain": [dict(top_k=40, top_p=p, min_p=m, temperature=t)
              for p, m, t in ((0.9, 0.05, 0.8), (0.95, 0.02, 1.1), (0.8, 0.1, 0.6), (0.99, 0.01, 1.3))],
    "order": [dict(sampler_order=["temperature", "min_p", "top_p", "top_k"], top_k=50, top_p=p, min_p=0.02,
                   temperature=t) for p, t in ((0.9, 0.7), (0.8, 1.3), (0.95, 0.5), (0.7, 2.0))],
}


@pytest.mark.parametrize("shape", SHAPES)
def test_batched_rows_draw_what_each_row_draws_alone(shape: str) -> None:
    profiles = [SamplingProfile(seed=100 + i, **kw) for i, kw in enumerate(SHAPES[shape])]
    alone, batched = _samplers(profiles), _samplers(profiles)
    assert len({chain_key(s) for s in batched}) == 1 and chain_key(batched[0]) is not None
    rng = np.random.default_rng(len(shape))
    for _ in range(6):  # positions advance in step on both sides
        logits = _logits(rng, len(profiles))
        tokens, before = sample_rows(batched, logits)
        for i, s in enumerate(alone):
            token, lp = s.step(logits[i])
            assert tokens[i].item() == token.item(), (shape, i)
            assert mx.array_equal(log_softmax(before[i]), lp, equal_nan=True).item()
    assert [s.history.generated for s in batched] == [6] * len(profiles)


def test_rows_with_other_chains_get_other_keys_or_none() -> None:
    key = lambda **kw: chain_key(_samplers([SamplingProfile(**kw)])[0])  # noqa: E731
    assert key(top_k=20) != key(top_k=30)  # top-k's candidate sets must line up
    assert key(top_p=0.9, temperature=0.5) == key(top_p=0.5, temperature=2.0)  # values are per row
    assert key(top_p=0.9) != key(min_p=0.1) != key(temperature=0)
    for kw in (dict(repetition_penalty=1.1), dict(dry_multiplier=0.8), dict(typical_p=0.9),
               dict(dynatemp_range=0.5), dict(mirostat=2), dict(xtc_probability=0.5), dict(min_tokens=3)):
        assert key(**kw) is None, kw
