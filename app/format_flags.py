"""`mlxchat generate`'s constrained-decoding flags: --json-schema FILE|-, --json-object, --regex PATTERN and
--grammar FILE.

Each gives the profile's ``response_format`` (core/sampling/response_format.py); at most one may be given. A file that
cannot be read, is not JSON, or a schema, regex or grammar that does not compile is one line naming the flag.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any


def add_format_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument("--json-schema", metavar="FILE", help="reply with JSON valid under this JSON Schema file "
                                                             "(- reads it from stdin)")
    group.add_argument("--json-object", action="store_true", help="reply with one JSON object")
    group.add_argument("--regex", metavar="PATTERN", help="reply with text matching this regular expression")
    group.add_argument("--grammar", metavar="FILE", help="reply with text in this Lark (or GBNF) grammar")


def response_format(args: argparse.Namespace) -> dict[str, Any] | None:
    """The response format the flags ask for, validated, as the profile's field takes it; None without one."""
    from pydantic import ValidationError

    from mlxchat.core.sampling.response_format import ResponseFormat

    if args.json_schema == "-" and args.prompt == "-":
        raise ValueError("--json-schema - and the prompt - both read stdin: give the schema as a file")
    if args.json_schema is not None:
        flag, text = f"--json-schema {args.json_schema}", _read(args.json_schema, "--json-schema")
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
        name = "schema" if args.json_schema == "-" else re.sub(r"[^\w-]", "_", Path(args.json_schema).stem)[:64]
        fmt: dict[str, Any] = {"type": "json_schema", "json_schema": {"name": name or "schema", "schema": schema,
                                                                      "strict": True}}
    elif args.json_object:
        flag, fmt = "--json-object", {"type": "json_object"}
    elif args.regex is not None:
        flag, fmt = "--regex", {"type": "regex", "regex": args.regex}
    elif args.grammar is not None:
        flag, fmt = f"--grammar {args.grammar}", {"type": "grammar", "grammar": _read(args.grammar, "--grammar")}
    else:
        return None
    try:
        ResponseFormat.model_validate(fmt)
    except ValidationError as e:
        # The flag stands for the field: "--regex: invalid regex ...", "--json-schema f.json: properties.a.type: ...".
        msg = re.sub(r"^response_format(\.json_schema\.schema|\.regex|\.grammar)?(: |\.)", "", e.errors()[0]["msg"])
        raise ValueError(f"{flag}: {msg}") from None
    return fmt


def _read(path: str, flag: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag} {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None


__all__ = ["add_format_flags", "response_format"]
