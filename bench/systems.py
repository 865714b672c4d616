"""One runner per system. Each ``run(messages, ids, spec, max_tokens)`` returns one sample (see ``bench.stats``).

* ``EngineRunner``: mlxchat's public surface, ``engine.generate(messages, ...)``; its own metrics (TTFT counts from
  the request being accepted, so it includes rendering and tokenizing the chat, a few ms at 2048 tokens).
* ``MlxLmRunner``: mlx-lm's ``stream_generate`` on an engine's model object, on that engine's inference thread (MLX
  streams are per thread), fed the same prompt token ids, with mlx-lm's own
  defaults otherwise (``prefill_step_size`` 2048, its 20-token penalty window). The detokenizer is chosen the way
  ``mlx_lm.tokenizer_utils.load`` chooses it from tokenizer.json's decoder. Timed on that thread: TTFT is from the
  call to the first token, TPOT the mean gap between later tokens (the engine's definitions, docs/architecture.md §8).
* ``LlamaCppRunner``: llama.cpp through ``llama-cpp-python`` on the same GGUF file, 2 threads, fed the same ids
  (same vocabulary), its KV cache reset before each run so no prefix is reused. Only when importable.

Every system generates exactly ``max_tokens`` tokens: the end-of-turn ids are banned (mlxchat:
``SamplingProfile(min_tokens=N)``; mlx-lm: a logits processor that sets them to -inf; llama.cpp: the same as a
numpy logits processor), so no system stops early on a different token and decode rates cover the same count.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_LLAMA_THREADS = 2


@dataclass(frozen=True)
class SamplerSpec:
    """A sampler setting, the same for every system."""

    name: str
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    # DRY (mlxchat only: neither peer's runner takes it) and whether the penalties and DRY see the prompt too.
    dry_multiplier: float = 0.0
    dry_penalty_last_n: int = -1
    penalize_prompt: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


GREEDY = SamplerSpec("greedy")
# The full chain: the penalties, DRY over the last 1,024 tokens of prompt and reply (issue 39's target: <= 5 % TPOT
# over greedy with DRY in the row), top-k, top-p, min-p and temperature.
FULL = SamplerSpec("full", temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                   frequency_penalty=0.5, presence_penalty=0.3, seed=1234, dry_multiplier=0.8,
                   dry_penalty_last_n=1024, penalize_prompt=True)


def sample_record(*, ttft_s: float, tpot_s: float, prompt_tokens: int, completion_tokens: int,
                  prefill_tokens: int | None = None, prefill_s: float | None = None,
                  peak_memory_bytes: int | None = None, **extra: Any) -> dict[str, Any]:
    prefill_tokens = prompt_tokens if prefill_tokens is None else prefill_tokens
    prefill_s = ttft_s if prefill_s is None else prefill_s
    return {"ttft_s": ttft_s, "tpot_s": tpot_s,
            "prefill_tokens_per_s": prefill_tokens / prefill_s if prefill_s > 0 else None,
            "decode_tokens_per_s": 1 / tpot_s if tpot_s > 0 else None,
            "peak_memory_bytes": peak_memory_bytes, "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens, **extra}


def from_metrics(m: Any, **extra: Any) -> dict[str, Any]:
    """A sample from mlxchat's ``core.Metrics``."""
    return sample_record(ttft_s=m.ttft_s, tpot_s=m.tpot_s, prompt_tokens=m.prompt_tokens,
                         completion_tokens=m.completion_tokens, prefill_tokens=m.prompt_tokens - m.cached_tokens,
                         prefill_s=m.prefill_s, peak_memory_bytes=m.peak_memory_bytes, **extra)


def from_times(t0: float, times: list[float], prompt_tokens: int, peak: int | None) -> dict[str, Any]:
    """A sample from the call time and the arrival time of each token."""
    if not times:
        raise RuntimeError("no token was generated")
    n = len(times)
    tpot = (times[-1] - times[0]) / (n - 1) if n > 1 else 0.0
    return sample_record(ttft_s=times[0] - t0, tpot_s=tpot, prompt_tokens=prompt_tokens, completion_tokens=n,
                         peak_memory_bytes=peak)


class EngineRunner:
    name = "mlxchat"

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def profile(self, spec: SamplerSpec, max_tokens: int) -> Any:
        from mlxchat.core import SamplingProfile
        from mlxchat.core.sampling.sampler_params import PARAMS

        # The spec's sampler parameters by their profile names (core/sampling/sampler_params.py); no end before
        # max_tokens (min_tokens is max_tokens).
        settings = {k: v for k, v in spec.as_dict().items() if k in PARAMS}
        return SamplingProfile(**settings, seed=spec.seed, min_tokens=max_tokens)

    def run(self, messages: list[dict[str, str]], ids: list[int], spec: SamplerSpec, max_tokens: int) -> dict:
        result = self.engine.generate(messages, profile=self.profile(spec, max_tokens), max_tokens=max_tokens)
        m = result.metrics
        if m.prompt_tokens != len(ids):
            raise RuntimeError(f"the engine saw {m.prompt_tokens} prompt tokens, the bench built {len(ids)}")
        return from_metrics(m)

    def describe(self, spec: SamplerSpec, max_tokens: int) -> str:
        """The chain the engine prints for this setting (built on the inference thread: it makes MLX arrays)."""
        from mlxchat.core.sampling.chain import Sampler

        m = self.engine.model
        profile = self.profile(spec, max_tokens)
        return self.engine.run(
            lambda: Sampler(profile, vocab_size=vocab_size(m), eos_ids=m.tokenizer.eos_ids).describe())


def vocab_size(m: Any) -> int:
    """The length of the model's logits (``core.model.loader.LoadedModel``)."""
    v = getattr(m, "vocab_size", None)
    if isinstance(v, int) and v > 0:
        return v
    inner = getattr(m.model, "model", None)
    if inner is not None and hasattr(inner, "embed_tokens"):
        return int(inner.embed_tokens.weight.shape[0])
    return int(m.tokenizer.vocab_size)


def _mlx_lm_detokenizer(hf: Any) -> Any:
    from mlx_lm import tokenizer_utils as tu

    try:
        decoder = json.loads(hf.backend_tokenizer.to_str()).get("decoder")
    except (AttributeError, ValueError):
        decoder = None
    if decoder:
        if tu._is_spm_decoder(decoder):
            return tu.SPMStreamingDetokenizer
        if tu._is_spm_decoder_no_space(decoder):
            from functools import partial

            return partial(tu.SPMStreamingDetokenizer, trim_space=False)
        if tu._is_bpe_decoder(decoder):
            return tu.BPEStreamingDetokenizer
    return tu.NaiveStreamingDetokenizer


class MlxLmRunner:
    name = "mlx-lm"

    def __init__(self, engine: Any) -> None:
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        self.engine = engine
        tok = engine.model.tokenizer
        self.detokenizer_class = _mlx_lm_detokenizer(tok.hf)
        self.tokenizer = TokenizerWrapper(tok.hf, detokenizer_class=self.detokenizer_class,
                                          eos_token_ids=sorted(tok.eos_ids))
        self.eos_ids = sorted(tok.eos_ids)

    def _job(self, ids: list[int], spec: SamplerSpec, max_tokens: int) -> dict:
        import mlx.core as mx
        import numpy as np
        from mlx_lm.generate import stream_generate
        from mlx_lm.sample_utils import make_logits_processors, make_sampler

        model = self.engine.model.model
        mask = np.zeros(vocab_size(self.engine.model), bool)
        mask[self.eos_ids] = True
        eos = mx.array(mask)

        def ban_eos(tokens: mx.array, logits: mx.array) -> mx.array:
            return mx.where(eos, float("-inf"), logits)

        if spec.greedy:
            sampler, processors = make_sampler(0.0), []
        else:
            sampler = make_sampler(temp=spec.temperature, top_p=spec.top_p, min_p=spec.min_p, top_k=spec.top_k)
            processors = make_logits_processors(repetition_penalty=spec.repetition_penalty,
                                                presence_penalty=spec.presence_penalty,
                                                frequency_penalty=spec.frequency_penalty)
            if spec.seed is not None:
                mx.random.seed(spec.seed)
        processors = [*processors, ban_eos]
        mx.reset_peak_memory()
        times = []
        t0 = time.perf_counter()
        for _ in stream_generate(model, self.tokenizer, mx.array(ids), max_tokens=max_tokens, sampler=sampler,
                                 logits_processors=processors):
            times.append(time.perf_counter())
        return from_times(t0, times, len(ids), mx.get_peak_memory())

    def run(self, messages: list[dict[str, str]], ids: list[int], spec: SamplerSpec, max_tokens: int) -> dict:
        return self.engine.run(lambda: self._job(ids, spec, max_tokens))


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def llama_cpp_version() -> str | None:
    if not llama_cpp_available():
        return None
    try:
        from importlib.metadata import version

        return version("llama_cpp_python")
    except Exception:  # noqa: BLE001 - only informative
        return "unknown"


@dataclass
class LlamaCppRunner:
    """llama.cpp on the same GGUF. Created only when ``llama_cpp`` is importable and the model is a GGUF file."""

    path: str
    eos_ids: list[int]
    n_ctx: int
    threads: int = DEFAULT_LLAMA_THREADS
    name: str = "llama.cpp"
    llm: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=self.path, n_ctx=self.n_ctx, n_batch=512, n_threads=self.threads,
                         n_threads_batch=self.threads, verbose=False)

    def run(self, messages: list[dict[str, str]], ids: list[int], spec: SamplerSpec, max_tokens: int) -> dict:
        import numpy as np
        from llama_cpp import LogitsProcessorList

        eos = np.asarray(self.eos_ids)

        def ban_eos(input_ids: Any, scores: Any) -> Any:
            scores[eos] = -np.inf
            return scores

        llm = self.llm
        llm.reset()  # forget the last prompt: no prefix of it may be reused
        if spec.seed is not None:
            llm.set_seed(spec.seed)
        kw: dict[str, Any] = {"temp": spec.temperature, "repeat_penalty": spec.repetition_penalty,
                              "frequency_penalty": spec.frequency_penalty, "presence_penalty": spec.presence_penalty}
        if spec.greedy:
            kw.update(top_k=1, top_p=1.0, min_p=0.0)
        else:
            kw.update(top_k=spec.top_k, top_p=spec.top_p, min_p=spec.min_p)
        times, tokens = [], []
        t0 = time.perf_counter()
        for token in llm.generate(ids, reset=True, logits_processor=LogitsProcessorList([ban_eos]), **kw):
            times.append(time.perf_counter())
            tokens.append(token)
            if len(times) >= max_tokens:
                break
        if set(tokens) & set(self.eos_ids):
            raise RuntimeError("llama.cpp generated an end-of-turn token although it was banned")
        return from_times(t0, times, len(ids), None)

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()
            self.llm = None


# Loads the file and evaluates a prompt and one more token: the prefill's and the decode's matmul paths.
_SMOKE = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=64, n_batch=64, n_threads=1, verbose=False)
ids = llm.tokenize(b"Hello there, how are you?")
llm.eval(ids)
llm.eval(ids[:1])
"""


@functools.lru_cache(maxsize=None)
def llama_cpp_crash(path: str) -> str | None:
    """None when llama.cpp loads ``path`` and evaluates tokens in a child process; else why not. A build whose
    kernels fault on this machine kills its process (a GGML_NATIVE build on a VM that lists AMX but faults on its
    tile instructions died of SIGSEGV in ggml_backend_amx_mul_mat), so it is tried where that costs only a child."""
    try:
        child = subprocess.run([sys.executable, "-c", _SMOKE, path], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return "llama.cpp did not evaluate a prompt within 600 s in a child process"
    if child.returncode == 0:
        return None
    how = f"died of {signal.Signals(-child.returncode).name}" if child.returncode < 0 else \
        f"failed ({(child.stderr.strip().splitlines() or ['no output'])[-1]})"
    return f"llama.cpp {how} evaluating a prompt in a child process: its build does not run on this machine"


def make_llama_cpp(model_source: str, eos_ids: list[int], n_ctx: int,
                   threads: int = DEFAULT_LLAMA_THREADS) -> tuple[LlamaCppRunner | None, str]:
    """A llama.cpp runner, or None and why not."""
    if not llama_cpp_available():
        return None, "llama-cpp-python is not installed (optional: see bench/README.md)"
    if not (model_source.lower().endswith(".gguf") and os.path.isfile(model_source)):
        return None, f"the model is not a GGUF file ({model_source})"
    if crash := llama_cpp_crash(model_source):
        return None, crash
    try:
        return LlamaCppRunner(model_source, eos_ids, n_ctx, threads), ""
    except Exception as e:  # noqa: BLE001 - the comparison is optional; say why it is missing
        return None, f"llama.cpp could not load the model: {type(e).__name__}: {e}"
