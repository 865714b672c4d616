"""The hosts file: MLX's own ring format (what MLX_HOSTFILE reads), checked with errors that name the flag.

A JSON list with one entry per rank, each a list of "host:port" strings (the ring backend's addresses for that
rank; more than one address means more than one connection). Rank 0 is the app; mlxchat's control channel (requests,
heartbeats) listens on rank 0's host, one port above the highest port the file lists for that host, unless
`--control-port` says otherwise.
"""

from __future__ import annotations

import json
import random
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class HostsError(ValueError):
    """A hosts file or rank that cannot work; the message names the flag and what to do."""


@dataclass(frozen=True)
class Hosts:
    path: Path
    ranks: tuple[tuple[str, ...], ...]

    @property
    def size(self) -> int:
        return len(self.ranks)

    def address(self, rank: int) -> str:
        """The rank's first ring address, to name it in messages ("rank 1 (10.0.0.2:5000)")."""
        return self.ranks[rank][0]

    def host(self, rank: int) -> str:
        return self.address(rank).rsplit(":", 1)[0]

    def control_address(self, port: int | None = None) -> tuple[str, int]:
        host = self.host(0)
        if port is None:
            port = 1 + max(int(a.rsplit(":", 1)[1]) for r in self.ranks for a in r if a.rsplit(":", 1)[0] == host)
        return host, port

    def check_rank(self, rank: int) -> None:
        if not 1 <= rank < self.size:
            allowed = "1" if self.size == 2 else f"1 to {self.size - 1}"
            raise HostsError(f"--rank {rank}: a worker's rank must be {allowed} for the {self.size} "
                             f"ranks of {self.path} (rank 0 is the app: `mlxchat chat --hosts {self.path}`)")


def read_hosts(path: str | Path) -> Hosts:
    """Read and check a hosts file; every problem is one `HostsError` line starting with `--hosts FILE:`."""
    path = Path(path).expanduser()

    def bad(problem: str) -> HostsError:
        return HostsError(f"--hosts {path}: {problem}")

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise bad("no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise bad(f"cannot read it ({getattr(e, 'strerror', None) or e})") from None
    except json.JSONDecodeError as e:
        raise bad(f"not JSON ({e.msg} at line {e.lineno}); write a list like "
                  '[["10.0.0.1:5000"], ["10.0.0.2:5000"]]') from None
    if not isinstance(data, list) or len(data) < 2:
        raise bad('needs a JSON list of at least 2 ranks, each a list of "host:port", e.g. '
                  '[["10.0.0.1:5000"], ["10.0.0.2:5000"]]')
    ranks = []
    for rank, entry in enumerate(data):
        if not isinstance(entry, list) or not entry:
            raise bad(f'rank {rank} must be a non-empty list of "host:port" strings, got {json.dumps(entry)}')
        for address in entry:
            _check_address(address, rank, bad)
        ranks.append(tuple(entry))
    return Hosts(path, tuple(ranks))


def _check_address(address: object, rank: int, bad: Callable[[str], HostsError]) -> None:
    host, sep, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not (host and sep and port.isdigit() and 0 < int(port) < 65536):
        raise bad(f'rank {rank} has {json.dumps(address)}, not "host:port" with a port from 1 to 65535')


def write_loopback_hosts(path: str | Path, ranks: int, spare: int = 0) -> Hosts:
    """A hosts file for `ranks` processes on this machine, on consecutive free ports: the ranks' ring ports, rank 0's
    control port just above them, then `spare` more (for a server, say), so none of them collide."""
    ports = _free_block(ranks + 1 + spare)
    path = Path(path)
    path.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports[:ranks]]))
    return read_hosts(path)


def _free_block(n: int) -> list[int]:
    while True:
        base = random.randrange(20000, 60000 - n)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", port))
            return list(range(base, base + n))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
