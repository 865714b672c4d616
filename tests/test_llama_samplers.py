"""llama.cpp's samplers (DRY, top-nσ, dynamic temperature, with the penalties and the truncations around them) as
chain stages: `mlxchat.core.final_distribution` against a NumPy reference written here from llama.cpp's
definitions (always), and against llama.cpp's own samplers through llama-cpp-python's low-level bindings (where
they are installed): on random distributions with random histories, the kept set identical and the probabilities
within 1e-4. Mirostat and adaptive-p are stateful: they are checked through seeded draws."""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxchat.core import SamplingProfile, final_distribution
from mlxchat.core.sampling import dry
from mlxchat.core.sampling.chain import Sampler

TOLERANCE = 1e-4
UNDERFLOW = 1e-30
CASES = 1000


# --- the NumPy reference: llama.cpp's definitions, written plainly (float64 where llama.cpp's rounding is moot) ---

def ref_dry(x: np.ndarray, history: list[int], breakers: dry.Breakers, mult: float, base: float, allowed: int,
            last_n: int) -> np.ndarray:
    """DRY by brute force: for each earlier end position, the longest common suffix with the history (capped by
    the latest complete breaker), not the Z-algorithm."""
    h = history[-last_n:] if last_n > 0 else list(history)
    n = len(h)
    if n <= allowed:
        return x
    limit = n
    for i in range(n):  # i tokens back from the newest
        head = h[n - 1 - i]
        matches = [len(t) for t in breakers.tails.get(head, ()) if len(t) <= i
                   and all(t[o] == h[n - 1 - (i - o - 1)] for o in range(len(t)))]
        if matches:
            limit = i - max(matches)
            break
    if limit < allowed:
        return x
    longest: dict[int, int] = {}
    for end in range(n - 1):
        length = 0
        while length <= end and h[end - length] == h[n - 1 - length]:
            length += 1
        length = min(length, limit)
        if length >= allowed:
            longest[h[end + 1]] = max(longest.get(h[end + 1], 0), length)
    cap = int(88.7228391 / math.log(base)) if base > 1.000001 else 0
    y = x.copy()
    for token, length in longest.items():
        if () in breakers.tails.get(token, ()):
            continue
        e = length - allowed
        y[token] -= np.float32(mult * base ** (min(e, cap) if cap > 0 else e))
    return y


def ref_penalties(x: np.ndarray, history: list[int], rep: float, freq: float, pres: float) -> np.ndarray:
    y = x.copy()
    for token, count in zip(*np.unique(np.asarray(history, dtype=np.int64), return_counts=True)):
        v = y[token]
        v = v / rep if v > 0 else v * rep
        y[token] = v - freq * count - pres
    return y


def _softmax(x: np.ndarray) -> np.ndarray:
    """Probabilities as llama.cpp computes them (expf): a token far below the best underflows to 0, i.e. can never
    be drawn. Below float32's smallest normal number counts as 0 (MLX's CPU exp flushes subnormals to zero)."""
    live = np.isfinite(x)
    p = np.zeros_like(x, dtype=np.float64)
    e = np.exp((x[live] - x[live].max()).astype(np.float32))
    e = np.where(e < np.finfo(np.float32).tiny, 0, e).astype(np.float64)
    p[live] = e / e.sum()
    return p


def ref_chain(profile: SamplingProfile, logits: np.ndarray, history: list[int],
              breakers: dry.Breakers) -> np.ndarray:
    p = profile
    x = logits.astype(np.float64)
    size = int(np.isfinite(x).sum())  # llama.cpp's array: top-nσ masks without removing, the other cuts remove
    if p.active("repetition_penalty") or p.active("frequency_penalty") or p.active("presence_penalty"):
        x = ref_penalties(x, history, p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
    if p.active("dry"):
        x = ref_dry(x, history, breakers, p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n)
    for stage in p.order():
        if not p.active(stage):
            continue
        live = np.isfinite(x)
        if stage == "top_n_sigma":
            v = x[live]
            x = np.where(x >= v.max() - p.top_n_sigma * v.std(), x, -np.inf)
            continue
        elif stage == "top_k":
            order = np.argsort(-x, kind="stable")
            x = np.where(np.isin(np.arange(x.size), order[:p.top_k]), x, -np.inf)
            size = min(size, p.top_k)
            continue
        elif stage in ("top_p", "typical_p"):
            probs = _softmax(x)
            if stage == "top_p":
                rank = -x
            else:
                entropy = -np.sum(probs[probs > 0] * np.log(probs[probs > 0]))
                rank = np.where(probs > 0, np.abs(-np.log(np.where(probs > 0, probs, 1)) - entropy), np.inf)
            order = np.argsort(rank, kind="stable")
            before = np.cumsum(probs[order]) - probs[order]
            keep = order[:max(1, int(np.sum(before < (p.top_p if stage == "top_p" else p.typical_p))))]
            x = np.where(np.isin(np.arange(x.size), keep), x, -np.inf)
        elif stage == "min_p":
            x = np.where(x >= x[live].max() + math.log(p.min_p), x, -np.inf)
        elif stage == "temperature":
            if p.dynatemp_range > 0:
                n = size
                if n > 1:
                    probs = _softmax(x)
                    entropy = -np.sum(probs[probs > 0] * np.log(probs[probs > 0]))
                    lo, hi = max(0.0, p.temperature - p.dynatemp_range), p.temperature + p.dynatemp_range
                    t = lo + (hi - lo) * (entropy / math.log(n)) ** p.dynatemp_exponent
                    x = x / t if t > 0 else np.where(x == x[live].max(), 0.0, -np.inf)
            else:
                x = x / p.temperature
        else:
            raise AssertionError(f"the reference has no {stage}")
        size = int(np.isfinite(x).sum())
    return _softmax(x)


# --- random cases ---------------------------------------------------------------------------------------------------

@dataclass
class Case:
    profile: SamplingProfile
    logits: np.ndarray  # over the whole vocabulary; -inf outside the case's candidates
    ids: np.ndarray  # the candidates (what llama.cpp's token array holds)
    history: list[int]


# A few breaker sets (each is found on the vocabulary once): llama.cpp's default, one, and multi-token strings.
BREAKER_SETS = (["\n", ":", "\"", "*"], ["\n"], [".", " the", "ing"], ["*", "ing", ":"])


def random_case(rng: np.random.Generator, vocab: int, breaker_ids: list[int], typical: bool = True) -> Case:
    n = int(rng.choice([2, 5, 30, 200, 1000, 3000]))
    ids = rng.choice(vocab, size=n, replace=False)
    logits = np.full(vocab, -np.inf, np.float32)
    logits[ids] = (rng.normal(0, rng.uniform(0.5, 4), n)).astype(np.float32)
    # A history with repeats (so that DRY finds sequences) from the candidates and a few breaker tokens.
    alphabet = list(rng.choice(ids, size=min(n, int(rng.integers(2, 12))), replace=False))
    alphabet += list(rng.choice(breaker_ids, size=2)) if rng.random() < 0.5 else []
    history = [int(t) for t in rng.choice(alphabet, size=int(rng.integers(0, 40)))]
    for _ in range(int(rng.integers(0, 6))):
        if len(history) > 2:
            start = int(rng.integers(0, len(history) - 1))
            history += history[start:start + int(rng.integers(1, 12))]
    kw: dict[str, Any] = {"temperature": float(rng.choice([1.0, rng.uniform(0.3, 1.6)]))}
    on = lambda q: rng.random() < q  # noqa: E731
    if on(0.4):
        kw["top_n_sigma"] = float(rng.uniform(0.3, 3))
    if on(0.25):
        kw["top_k"] = int(rng.integers(1, 80))
    if on(0.25):
        kw["top_p"] = float(rng.uniform(0.3, 0.99))
    if on(0.25):
        kw["min_p"] = float(rng.uniform(0.01, 0.3))
    # llama.cpp's typical-p sums -p·log p over its whole array: a token whose p underflowed to 0 (top-nσ's masked
    # ones, or one DRY pushed far down) makes its entropy NaN and its cut arbitrary. Typical-p is no new stage: it is
    # left out of the comparison with llama.cpp (`typical`) and checked against the reference.
    if on(0.1) and typical:
        kw["typical_p"] = float(rng.uniform(0.3, 0.99))
    if on(0.35):
        kw["dynatemp_range"] = float(rng.uniform(0.05, 1.0))
        kw["dynatemp_exponent"] = float(rng.uniform(0.5, 2.0))
    if on(0.3):
        kw["repetition_penalty"] = float(rng.uniform(1.0, 1.5))
    if on(0.3):
        kw["frequency_penalty"] = float(rng.uniform(0, 1))
        kw["presence_penalty"] = float(rng.uniform(0, 1))
    if on(0.6):
        kw |= {"dry_multiplier": float(rng.uniform(0.1, 2)), "dry_base": float(rng.uniform(1.1, 3)),
               "dry_allowed_length": int(rng.integers(1, 5)),
               "dry_penalty_last_n": int(rng.choice([-1, int(rng.integers(1, 60))])),
               "dry_sequence_breakers": BREAKER_SETS[int(rng.integers(len(BREAKER_SETS)))]}
    return Case(SamplingProfile(**kw), logits, ids, history)


def check(got: np.ndarray, want: np.ndarray, case: Case) -> float:
    what = f"{case.profile.describe_chain()} history={case.history}"
    # Kept: every token the chain left a probability. A token whose probability underflows float32's exp (below
    # 1e-30: a logit ~70 below the best) is kept by one side and not the other when the two round its logit apart
    # by one ulp; it can never be drawn either way, so only those may differ.
    differ = np.flatnonzero((got > 0) != (want > 0))
    assert np.all(np.maximum(got, want)[differ] < UNDERFLOW), (
        f"kept sets differ at {differ[:5].tolist()} (probabilities {got[differ[:5]]} vs {want[differ[:5]]}): {what}")
    diff = float(np.max(np.abs(got - want)))
    assert diff <= TOLERANCE, f"probabilities differ by {diff}: {what}"
    return diff


# --- against the reference (always) ---------------------------------------------------------------------------------

def test_against_numpy_reference() -> None:
    rng = np.random.default_rng(39)
    vocab = 4000
    # A synthetic vocabulary's breakers: tokens 0-3 are breakers alone, 4 starts one that 5, 6 complete.
    breakers = dry.Breakers({0: ((),), 1: ((),), 2: ((),), 3: ((),), 4: ((5, 6),)})
    worst, with_dry = 0.0, 0
    for _ in range(CASES):
        case = random_case(rng, vocab, [0, 1, 2, 3, 4, 5, 6])
        got = final_distribution(case.profile, case.logits, case.history, breakers=breakers)
        want = ref_chain(case.profile, case.logits, case.history, breakers)
        worst = max(worst, check(got, want, case))
        with_dry += case.profile.active("dry") and bool(dry.penalties(
            case.history[-case.profile.dry_penalty_last_n:] if case.profile.dry_penalty_last_n > 0 else case.history,
            breakers, 1, 2, case.profile.dry_allowed_length))
    assert with_dry > CASES // 5, "too few cases where DRY penalised something: the test would prove little"


def test_dry_native_matches_the_host_algorithm() -> None:
    """The native op and core.sampling.dry's Python algorithm (the path without the extension) give the same logits."""
    from mlxchat.core import native
    if not native.available():
        pytest.skip(native.unavailable_reason())
    rng = np.random.default_rng(1)
    breakers = dry.Breakers({0: ((),), 3: ((1, 2), (1,))})
    for _ in range(200):
        history = [int(t) for t in rng.integers(0, 6, int(rng.integers(0, 300)))]
        x = rng.normal(size=8).astype(np.float32)
        # float32 parameters, as the op (and llama.cpp) take them
        mult, base = float(np.float32(rng.uniform(0.1, 2))), float(np.float32(rng.uniform(1.01, 4)))
        allowed = int(rng.integers(1, 4))
        got = np.asarray(native.dry_penalty(mx.array(x), mx.array(history, mx.int32),
                                            native.dry_breakers(*breakers.flat()), multiplier=mult, base=base,
                                            allowed_length=allowed))
        want = x.copy()
        for token, shift in dry.penalties(history, breakers, mult, base, allowed).items():
            want[token] -= np.float32(shift)
        np.testing.assert_array_equal(got, want)


def test_a_stage_that_cuts_nothing_changes_no_seeded_draw() -> None:
    """top-nσ wide enough to keep every token, and DRY with no repeat in the history: the same seeded tokens."""
    rng = np.random.default_rng(5)
    rows = [mx.array(rng.normal(0, 2, 300).astype(np.float32)) for _ in range(40)]
    plain = SamplingProfile(temperature=0.9, seed=3)
    wide = plain.model_copy(update={"top_n_sigma": 1000.0, "dry_multiplier": 0.8, "dry_allowed_length": 50})

    def draw(profile: SamplingProfile) -> list[int]:
        s = Sampler(profile, vocab_size=300, eos_ids=frozenset())
        return [int(s.step(r)[0].item()) for r in rows]

    assert draw(plain) == draw(wide)


def test_dry_breakers_from_strings() -> None:
    """llama.cpp's overlapping token sequences: a token holding the string is a breaker alone; a token ending with
    the string's start heads one whose tail is the rest, tokenised."""
    pieces = ["a", "b:", "x\n", "Hel", "lo", "c", "He"]
    encode = {"lo": [4], "llo": [3, 4]}
    b = dry.build_breakers(["\n", "Hello"], pieces, lambda s: encode.get(s, [5]))
    assert b.tails[2] == ((),)  # "x\n" contains "\n"
    assert b.tails[3] == ((4,),)  # "Hel" + tokens of "lo"
    assert b.tails[6] == ((3, 4),)  # "He" + tokens of "llo"
    assert 0 not in b.tails and 1 not in b.tails


def test_mirostat_steers_surprise_to_tau() -> None:
    """Mirostat v2 (and v1) keep the chosen tokens' mean surprise near tau over a seeded run on a fixed Zipf-like
    distribution; seeded runs repeat exactly."""
    x = mx.array((-1.1 * np.log(np.arange(1, 2001))).astype(np.float32))
    for version in (1, 2):
        profile = SamplingProfile(mirostat=version, mirostat_tau=4.0, mirostat_eta=0.2, seed=11)

        def run() -> tuple[list[int], float]:
            s = Sampler(profile, vocab_size=2000, eos_ids=frozenset())
            lp = np.asarray(x - mx.logsumexp(x))
            tokens = [int(s.step(x)[0].item()) for _ in range(400)]
            return tokens, float(np.mean([-lp[t] / math.log(2) for t in tokens[100:]]))

        tokens, surprise = run()
        assert run()[0] == tokens
        assert abs(surprise - 4.0) < 1.0, f"mirostat {version}: mean surprise {surprise:.2f} bits, tau 4"


def test_adaptive_p_steers_chosen_probability_to_target() -> None:
    """adaptive-p's moving average of the chosen tokens' probabilities tends to the target (llama.cpp's aim)."""
    rng = np.random.default_rng(2)
    rows = [mx.array(rng.normal(0, 2.5, 50).astype(np.float32)) for _ in range(300)]
    for target in (0.1, 0.35):
        s = Sampler(SamplingProfile(adaptive_p_target=target, adaptive_p_decay=0.9, seed=4), vocab_size=50,
                    eos_ids=frozenset())
        chosen = []
        for r in rows:
            t = int(s.step(r)[0].item())
            chosen.append(float(np.asarray(mx.softmax(r))[t]))
        assert abs(np.mean(chosen[50:]) - target) < 0.12, f"target {target}: mean {np.mean(chosen[50:]):.2f}"


# --- against llama.cpp (where llama-cpp-python is installed) --------------------------------------------------------

class LlamaChain:
    """llama.cpp's samplers for one case, through llama-cpp-python's ctypes bindings, on the embedded model's
    vocabulary (loaded alone: DRY tokenises its breakers on it)."""

    def __init__(self, ll: Any, vocab: Any) -> None:
        self.ll, self.vocab = ll, vocab
        self.dtype = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])

    def final(self, case: Case) -> np.ndarray:
        ll, p = self.ll, case.profile
        chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        keep: list[Any] = []
        if p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty:
            # mlxchat's window 0 is the whole reply: llama.cpp's last n set to the history's length.
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_penalties(
                ll.llama_vocab_n_tokens(self.vocab), max(1, len(case.history)), p.repetition_penalty,
                p.frequency_penalty, p.presence_penalty))
        if p.active("dry"):
            strings = (ctypes.c_char_p * len(p.dry_sequence_breakers))(*[s.encode() for s in p.dry_sequence_breakers])
            keep.append(strings)
            # -1 is "the context" in llama.cpp's server; here the history is all there is.
            last_n = p.dry_penalty_last_n if p.dry_penalty_last_n > 0 else max(1, len(case.history))
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_dry(
                self.vocab, p.dry_multiplier, p.dry_base, p.dry_allowed_length, last_n, strings,
                len(p.dry_sequence_breakers)))
        for stage in p.order():
            if not p.active(stage):
                continue
            make = {"top_n_sigma": lambda: ll.llama_sampler_init_top_n_sigma(p.top_n_sigma),
                    "top_k": lambda: ll.llama_sampler_init_top_k(p.top_k),
                    "typical_p": lambda: ll.llama_sampler_init_typical(p.typical_p, 1),
                    "top_p": lambda: ll.llama_sampler_init_top_p(p.top_p, 1),
                    "min_p": lambda: ll.llama_sampler_init_min_p(p.min_p, 1),
                    "temperature": lambda: ll.llama_sampler_init_temp_ext(p.temperature, p.dynatemp_range,
                                                                          p.dynatemp_exponent)}[stage]
            ll.llama_sampler_chain_add(chain, make())
        for token in case.history:
            ll.llama_sampler_accept(chain, token)
        arr = np.zeros(case.ids.size, self.dtype)
        arr["id"], arr["logit"] = case.ids, case.logits[case.ids]
        cur = ll.llama_token_data_array(data=arr.ctypes.data_as(ctypes.POINTER(ll.llama_token_data)),
                                        size=arr.size, selected=-1, sorted=False)
        ll.llama_sampler_apply(chain, ctypes.byref(cur))
        out_ids = np.array([cur.data[i].id for i in range(cur.size)])
        out_logits = np.array([cur.data[i].logit for i in range(cur.size)], np.float64)
        ll.llama_sampler_free(chain)
        x = np.full(case.logits.size, -np.inf)
        x[out_ids] = out_logits
        return _softmax(x)


@pytest.fixture(scope="module")
def llama() -> tuple[LlamaChain, Any]:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (it is never a dependency)")
    from model_files import embedded_metadata

    from mlxchat.core.model.loader import embedded_model_path
    from mlxchat.core.model.tokenizer import from_gguf_metadata

    ll = llama_cpp.llama_cpp
    ll.llama_backend_init()
    params = ll.llama_model_default_params()
    params.vocab_only = True
    model = ll.llama_model_load_from_file(str(embedded_model_path()).encode(), params)
    assert model, "llama.cpp could not read the embedded model's vocabulary"
    return LlamaChain(ll, ll.llama_model_get_vocab(model)), from_gguf_metadata(embedded_metadata())


def test_against_llama_cpp(llama: tuple[LlamaChain, Any]) -> None:
    chain, tokenizer = llama
    rng = np.random.default_rng(2026)
    vocab = tokenizer.vocab_size
    newline = tokenizer.encode("\n")[0]
    worst, stages = 0.0, set()
    for _ in range(CASES):
        case = random_case(rng, vocab, [newline, *tokenizer.encode(": \"*.")], typical=False)
        breakers = dry.breakers_for(tokenizer, case.profile.dry_sequence_breakers)
        got = final_distribution(case.profile, case.logits, case.history, breakers=breakers)
        worst = max(worst, check(got, chain.final(case), case))
        stages.update(s for s in ("dry", "top_n_sigma") if case.profile.active(s))
        stages.update(["dynatemp"] if case.profile.dynatemp_range > 0 else [])
    assert stages == {"dry", "top_n_sigma", "dynatemp"}


def test_the_trace_names_the_sequence_dry_matched() -> None:
    """The inspector's DRY column: a traced step records DRY's shift per candidate and the repeated sequence the
    candidate would extend; the new transforms are stages of their own, with the reason for each cut."""
    from mlxchat.app import inspector
    from mlxchat.core.sampling.tracing import Tracer

    words = ["the", " cat", " sat", " on", " mat", "."]
    profile = SamplingProfile(temperature=0.8, seed=1, dry_multiplier=1.0, top_n_sigma=1.0)
    sampler = Sampler(profile, vocab_size=6, eos_ids=frozenset())
    sampler.replay([0, 1, 2, 3, 0, 1])  # "the cat sat on the cat": " sat" would extend "the cat"
    tracer = Tracer(sampler, 6, lambda i: words[i])
    token, _ = tracer.step(mx.array([1.0, 0.5, 2.0, 0.1, 0.2, -3.0]))
    trace = tracer.take(int(token.item()))
    sat = next(c for c in trace.candidates if c.token_id == 2)
    assert sat.shifts["DRY(1, 1.75, 2, -1)"] == pytest.approx(-1.0)
    assert sat.notes == {"DRY(1, 1.75, 2, -1)": "repeats 'the cat sat' (2 tokens + this one)"}
    assert trace.stages == ("processed", "TopNSigma(1)", "Temperature(0.8)")
    row = next(r for r in inspector.rows(trace) if r.token_id == 2)
    assert row.dry == pytest.approx(-1.0) and "repeats 'the cat sat'" in row.why
    assert "DRY" in inspector.columns(trace)
    cut = next(r for r in inspector.rows(trace) if r.removed_by == "TopNSigma(1)")
    assert cut.why.endswith("more than nσ below the best logit")
