"""The `rserve` console script: the same command line (and axum server) as the native binary,
run in-process. `serve` and `generate` also accept a Hugging Face hub id for MODEL, downloaded
into the local cache first (with progress bars) so the engine finds it there.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable, Sequence

__all__ = ["main", "prepare_argv"]

#: Subcommands whose first positional argument is MODEL.
_MODEL_COMMANDS = frozenset({"serve", "generate"})
#: Options that take no value (every other `--option` takes one, unless written `--option=value`).
_BOOL_FLAGS = frozenset(
    {
        "-h",
        "--help",
        "-V",
        "--version",
        "--ignore-eos",
        "--json",
        "--enforce-eager",
        "--no-async-scheduling",
        "--enable-tokenizer-info-endpoint",
        "--isq-lm-head",
        "--enable-lora",
        "--enable-prefix-caching",
    }
)


def _positionals(args: Sequence[str], start: int) -> list[int]:
    """Indexes of the positional arguments in `args[start:]`."""
    found: list[int] = []
    i = start
    while i < len(args):
        a = args[i]
        if a == "--":
            found.extend(range(i + 1, len(args)))
            break
        if a.startswith("-") and a != "-":
            i += 1 if (a in _BOOL_FLAGS or "=" in a) else 2
            continue
        found.append(i)
        i += 1
    return found


def prepare_argv(argv: Sequence[str], resolve: Callable[[str], str] | None = None) -> list[str]:
    """Rewrites a hub id given as MODEL to its local snapshot directory.

    Under `serve`, the served model name stays the hub id unless `--served-model-name` is given.
    Other arguments pass through untouched; `--help` never triggers a download.
    """
    args = list(argv)
    if any(a in ("-h", "--help", "-V", "--version") for a in args):
        return args
    pos = _positionals(args, 0)
    if not pos or args[pos[0]] not in _MODEL_COMMANDS:
        return args
    command = args[pos[0]]
    if len(pos) < 2:
        return args
    at = pos[1]
    spec = args[at]
    from rserve.llm import is_hub_id, resolve_model

    if os.path.isdir(os.path.expanduser(spec)) or not is_hub_id(spec):
        return args
    args[at] = (resolve or resolve_model)(spec)
    named = any(a == "--served-model-name" or a.startswith("--served-model-name=") for a in args)
    if command == "serve" and not named:
        args += ["--served-model-name", spec]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `rserve` console script; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        args = prepare_argv(args)
    except Exception as e:  # noqa: BLE001 - shown as a one-line CLI error
        print(f"rserve: error: {e}", file=sys.stderr)
        return 1
    from rserve import _core

    if threading.current_thread() is threading.main_thread():
        # Let the server's own SIGINT handling (graceful shutdown) run instead of Python's.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        _core.serve(args)
    except RuntimeError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
