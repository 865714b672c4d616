"""Keep MLX's ring backend's socket errors off the user's terminal.

When a peer goes away, the ring's socket thread writes from C++ straight to the process's stderr (fd 2): "[ring]
Socket 5 was closed by the peer" ten times, then "[ring] Too many send/recv errors. Failing pending tasks...". That
is noise beside mlxchat's own one-line error naming the rank (and, in the TUI, it lands on the screen).
`quiet_ring_errors()` points fd 2 at a small filter process that drops those lines and passes on everything else;
Python's `sys.stderr` keeps writing to the terminal itself, so mlxchat's own lines do not go through the filter.

A process rather than a thread: it outlives this one, so what C code writes just before an abort or an `os._exit`
(a split model's fault path leaves that way) still reaches the terminal; it reads until every writer has gone.
"""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys

NOISE = b"[ring] "

# The filter: lines that start with NOISE are dropped; a line is held only while it could still be one, so
# progress output without a newline passes at once. It ignores SIGINT: a terminal's ctrl+c is for the app.
_FILTER = r"""
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
noise = sys.argv[1].encode()
held, passing = b"", False
while chunk := os.read(0, 65536):
    out = []
    for piece in chunk.splitlines(keepends=True):
        if passing:
            out.append(piece)
        else:
            held += piece
            if held.endswith(b"\n"):
                if not held.startswith(noise):
                    out.append(held)
                held = b""
            elif not (held.startswith(noise) or noise.startswith(held)):
                out.append(held)
                held, passing = b"", True
        if piece.endswith(b"\n"):
            passing = False
    os.write(1, b"".join(out))
"""


def quiet_ring_errors() -> None:
    """Route this process's fd 2 through the filter (once; again is a no-op). Call it before joining the ring."""
    if isinstance(sys.stderr, _DirectStderr):
        return
    sys.stderr.flush()
    try:
        terminal = os.dup(2)
    except OSError:  # no stderr at all (a daemon): nothing to keep clean
        return
    filter_proc = subprocess.Popen([sys.executable, "-S", "-c", _FILTER, NOISE.decode()], stdin=subprocess.PIPE,
                                   stdout=terminal, close_fds=True)
    assert filter_proc.stdin is not None
    os.dup2(filter_proc.stdin.fileno(), 2)
    filter_proc.stdin.close()  # fd 2 is now the only write end: the filter ends when this process does
    previous, sys.stderr = sys.stderr, _DirectStderr(terminal, sys.stderr)
    # Log handlers set up before (the server's) still write to fd 2, i.e. into the filter, where a log line could
    # land between the ring's "[ring]" and the rest of its line and carry the noise through: they move too.
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    for handler in (h for logger in loggers for h in logger.handlers):
        if isinstance(handler, logging.StreamHandler) and handler.stream is previous:
            handler.setStream(sys.stderr)


class _DirectStderr(io.TextIOWrapper):
    """`sys.stderr` on the terminal's own descriptor, with the encoding and error handling it had."""

    def __init__(self, fd: int, previous: io.TextIOBase) -> None:
        super().__init__(open(fd, "wb", buffering=0, closefd=True),  # noqa: SIM115 - lives as long as the process
                         encoding=getattr(previous, "encoding", None) or "utf-8",
                         errors=getattr(previous, "errors", None) or "backslashreplace", line_buffering=True,
                         write_through=True)
