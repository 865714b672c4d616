"""The KV cache, the second stage (on the model): `kv_cache` holds a conversation's keys and values (plain, rotating
or quantized; which ids they are) and prefills them in chunks; `kv_store` saves them to disk and finds them again by
prefix (docs/architecture.md §5, §14).

It imports only the model stage; sampling, beside it, is independent of it.
"""
