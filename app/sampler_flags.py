"""The sampler flags of `mlxchat chat` and `generate`: one per sampler parameter of core/sampling/sampler_params.py,
named after it (--top-p for top_p; a list's flag is repeatable: --dry-sequence-breaker), with its help. The ranges are
SamplingProfile's, checked when the profile is built, so a bad value reads as it does in a profile file.
"""

from __future__ import annotations

import argparse
from typing import Any

# No MLX: core's package loads its engine only when asked (PEP 562).
from mlxchat.core.sampling.sampler_params import PARAMS


def add_sampler_flags(p: argparse.ArgumentParser) -> None:
    for param in PARAMS.values():
        if param.type is list:
            p.add_argument(param.flag, dest=param.name, action="append", help=param.help)
        elif param.type is bool:
            p.add_argument(param.flag, action=argparse.BooleanOptionalAction, help=param.help)
        else:
            p.add_argument(param.flag, type=param.type, help=param.help)


def sampler_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The sampler flags given, by their profile names: they override the profile's settings."""
    return {name: getattr(args, name) for name in PARAMS if getattr(args, name) is not None}
