"""``python -m mlxchat.app [chat] [--model X] [--max-tokens N]``: the full-screen chat (what ``mlxchat`` opens)."""

import argparse
import sys

from .app import run_tui


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m mlxchat.app", description="mlxchat's full-screen chat")
    p.add_argument("command", nargs="?", choices=["chat"], help="optional, as with `mlxchat chat`")
    p.add_argument("--model", help="GGUF file, MLX/HF folder or HF repo id (default: the embedded SmolLM2-135M)")
    p.add_argument("--max-tokens", type=int, help="cap each reply at N tokens")
    args = p.parse_args()
    return run_tui(args.model, max_tokens=args.max_tokens)


if __name__ == "__main__":
    sys.exit(main())
