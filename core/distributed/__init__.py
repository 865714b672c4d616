"""One model across several machines: pipeline-parallel inference over MLX's ring backend (docs/architecture.md §10).

`leader.SplitEngine.start(hosts_file, model)` is rank 0 (an `Engine` for the app, the CLI and scripts);
`worker.run(hosts, rank)` is `mlxchat worker`. The hosts file, its checks and its error are what the CLI needs first.
"""

from .hosts import Hosts, HostsError, read_hosts

__all__ = ["Hosts", "HostsError", "read_hosts"]
