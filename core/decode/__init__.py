"""Decoding, the third stage (on sampling and the cache): one request from its settings to its tokens, its text and
its result (docs/architecture.md §3).

`reply` is the text layer (`Request`; `Reply`: one request's sampler, text, stops and metrics), `generate` the
token layer (`StepLoop`, the one decode loop over 1..N rows), `speculative` the drafters and their governor (§15),
`beam` beam search; `streaming` turns tokens into text and holds back stop strings, `reasoning` keeps a thinking
model's reasoning apart (§25), `tools` finds tool calls in a reply (§13); `events` is what a request emits and
`worker` the inference thread that runs it (§2).
"""
