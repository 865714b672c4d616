"""A small MCP server built with the `mcp` SDK (its MCPServer, formerly FastMCP), for tests/test_mcp.py: tools that
answer, fail, hang, crash the server, and return a huge or a non-text result. Run over stdio
(`python tests/mcp_servers.py`) or streamable HTTP (`python tests/mcp_servers.py --http PORT`, on 127.0.0.1 only)."""

from __future__ import annotations

import base64
import os
import sys
import time

from mcp.server.mcpserver import MCPServer
from mcp_types import ImageContent

server = MCPServer("mlxchat-test")


@server.tool()
def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)


@server.tool()
def fail(reason: str = "no reason") -> str:
    """A tool that always fails."""
    raise ValueError(f"this tool fails: {reason}")


@server.tool()
def hang(seconds: float = 3600) -> str:
    """A tool that does not answer."""
    time.sleep(seconds)
    return "woke up"


@server.tool()
def crash() -> str:
    """A tool that kills its server mid-call."""
    os._exit(3)


@server.tool()
def huge(chars: int = 100_000) -> str:
    """A very long result."""
    return "x" * chars


@server.tool()
def picture() -> ImageContent:
    """A result that is not text."""
    return ImageContent(type="image", data=base64.b64encode(b"\x89PNG....").decode(), mime_type="image/png")


@server.tool()
def distinct(items: set[str]) -> str:
    """A schema the constraint cannot enforce (uniqueItems): left out, said."""
    return ", ".join(sorted(items))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
