"""The sampler flags of `mlxchat chat` and `generate`: one per sampler parameter of core/sampler_params.py, named after
it (--top-p for top_p; a list's flag is repeatable: --dry-sequence-breaker), with its help. The ranges are
SamplingProfile's, checked when the profile is built, so a bad value reads as it does in a profile file.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

_DECLARATIONS = "mlxchat.core.sampler_params"


def _declarations() -> ModuleType:
    """core/sampler_params.py, loaded without core's package: its __init__ loads MLX (about a second), which the
    parser must not (`mlxchat --help` stays fast). The module imports only the standard library. It is registered
    under its own name, so core, when it loads later in the process, uses this same module (but core's package then
    has no `sampler_params` attribute: import names from it, as every module does)."""
    if _DECLARATIONS not in sys.modules:
        core = importlib.util.find_spec("mlxchat.core")  # imports `mlxchat` only, not core's __init__
        assert core is not None and core.submodule_search_locations, "mlxchat.core is installed with mlxchat"
        path = Path(core.submodule_search_locations[0]) / "sampler_params.py"
        spec = importlib.util.spec_from_file_location(_DECLARATIONS, path)
        assert spec is not None and spec.loader is not None, path
        module = importlib.util.module_from_spec(spec)
        sys.modules[_DECLARATIONS] = module
        spec.loader.exec_module(module)
    return sys.modules[_DECLARATIONS]


def add_sampler_flags(p: argparse.ArgumentParser) -> None:
    for param in _declarations().PARAMS.values():
        if param.type is list:
            p.add_argument(param.flag, dest=param.name, action="append", help=param.help)
        elif param.type is bool:
            p.add_argument(param.flag, action=argparse.BooleanOptionalAction, help=param.help)
        else:
            p.add_argument(param.flag, type=param.type, help=param.help)


def sampler_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The sampler flags given, by their profile names: they override the profile's settings."""
    names = _declarations().PARAMS
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}
