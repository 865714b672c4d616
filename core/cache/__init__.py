"""The KV cache, the second stage (on the model): `kv_cache` holds a conversation's keys and values (plain, rotating
or quantized; which ids they are) and prefills them in chunks; `kv_store` saves them to disk and finds them again by
prefix; `prefix` is the one KV-reuse service every path asks: the longest reusable prefix of a prompt, in memory (LRU,
a byte bound) and then on disk (docs/architecture.md §5, §14).

It imports only the model stage; sampling, beside it, is independent of it.
"""
