"""One model across several machines: pipeline-parallel inference over MLX's ring backend (docs/architecture.md §9).

`SplitEngine.start(hosts_file, model)` is rank 0 (an `Engine` for the app, the CLI and scripts); `run_worker` is
`mlxchat worker`. Only the hosts file, its checks and the errors are imported here, so the CLI can check its flags
before MLX loads."""

from .hosts import Hosts, HostsError, read_hosts

__all__ = ["Hosts", "HostsError", "read_hosts"]
