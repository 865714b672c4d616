"""Chat, the fourth stage (on decoding): `chat_session.ChatSession` keeps a conversation and its KV cache between
turns, `messages` its messages and their tree of replies; `tool_loop` runs a turn with tools (§26), `mcp` brings the
tools of MCP servers.

The engine (core/engine.py) sits above this stage and builds the session, which sees it only through the protocol
`chat_session.Host`: nothing here imports it.
"""
