"""`mlxchat serve`: an OpenAI-compatible HTTP server over the engine, with continuous batching and a prefix cache.

Endpoints: POST /v1/chat/completions and /v1/completions (streaming as SSE ending in `data: [DONE]`, or not),
GET /v1/models, /v1/models/{id}, /health (the only route that needs no API key: liveness probes carry none); Ollama's
/api routes (server/ollama.py) and Anthropic's /v1/messages (server/anthropic.py) on the same model and batch.

Notes for clients:
* `user` is accepted and ignored by design: it is an abuse-monitoring tag on OpenAI's platform.
* `n` > 1: choice i samples with seed + i (the response's `seed` is the base), so the choices differ but replay.
* The extra sampler fields (top_k, min_p, typical_p, repetition_penalty, xtc_threshold, xtc_probability,
  min_tokens, sampler_order, penalty_window, penalize_prompt, and `profile`: a preset or saved profile name) are
  accepted at the top level, as vLLM accepts `extra_body`.
* Fields of OpenAI's API that are not implemented (tools, response_format, functions, audio, ...) are a 400 that
  names the field, unless they carry their neutral value (e.g. `tools: []`, `response_format: {"type": "text"}`).
* Streams end each choice with a chunk carrying `finish_reason`, the choice's `seed` and llama.cpp-style `timings`;
  `stream_options.include_usage` adds the usage chunk (empty `choices`) before `[DONE]`.
"""
