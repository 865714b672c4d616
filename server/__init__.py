"""`mlxchat serve`: an OpenAI-compatible HTTP server over the engine, with continuous batching and a prefix cache."""
