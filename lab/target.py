"""`lab run --target URL`: the same experiment against any OpenAI-compatible server, so mlxchat's sampler can be
compared with llama.cpp's or Ollama's on the same prompts, settings and seeds. Each setting goes out as request
fields (lab/endpoint.py's `request_body`); what a server ignores it ignores silently, as its API does."""

from __future__ import annotations

from mlxchat.core import SamplingProfile

from .endpoint import Endpoint, request_body
from .prompts import Prompt
from .runner import Output, scored_output


class Target:
    """A server in an engine's place in `Experiment.run` (a `runner.Remote`): `name` for the run's record,
    `generate` for one output."""

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None) -> None:
        self.endpoint = Endpoint(url, api_key)
        self.model = model or self.endpoint.default_model()

    @property
    def name(self) -> str:
        return f"{self.model} at {self.endpoint.base}"

    def generate(self, cell: int, prompt: Prompt, profile: SamplingProfile, max_tokens: int) -> Output:
        messages = ([{"role": "system", "content": prompt.system}] if prompt.system else []) + \
            [{"role": "user", "content": prompt.text}]
        done = self.endpoint.chat(self.model, messages,
                                  request_body(profile, max_tokens, [prompt.stop] if prompt.stop else None))
        return scored_output(cell, prompt, profile.seed or 0, done.text, done.finish_reason, done.completion_tokens,
                             done.logprobs or [], done.ttft_s, done.tpot_s)

    def close(self) -> None:
        self.endpoint.close()
