"""Sampling, the second stage (on the model): one position's logits to one token (docs/architecture.md §4).

`sampler_params` declares each parameter once and `profile` is the validated `SamplingProfile` (its presets too);
`chain` builds what a profile asks for into a `Sampler`, a chain of processors and transforms over `candidates`,
drawn by `draw` (seeded); `dry` is DRY's penalty, `batch_sampling` a batch's rows sampled as one set of ops;
`response_format` and `constraint` mask what a JSON Schema, a regex or a grammar forbids; `trace` and `tracing`
record what each step did to each token.

It imports only the model stage (the tokenizer, for constraints); the cache, beside it, is independent of it.
"""
