"""The one entry point: `mmtrain COMMAND ...`.

Each command lives in its own module of `mmtrain.commands` exposing `register(subparsers)`, which
adds its parser and sets `func` (args -> exit code); `ORDER` (an int) places it in `--help`. The CLI owns the console; library code only logs.
Exit codes: 0 success, 2 bad usage or bad input (the message names the file or field), 1 other.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pkgutil
import sys

from mmtrain import __version__
from mmtrain.structured import FieldError


def command_modules(only: str | None = None) -> list:
    """Every command module, or just `only`'s when a module of that name exists: a command then
    starts without importing what the others need (torch, for instance)."""
    import mmtrain.commands as package

    # `_name` modules are helpers the commands share (argument types), not commands.
    names = [m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_")]
    if only in names:
        names = [only]
    modules = [importlib.import_module(f"{package.__name__}.{name}") for name in names]
    return sorted(modules, key=lambda m: (getattr(m, "ORDER", 100), m.__name__))


class UsageError(Exception):
    """Bad input from the user: printed without a traceback, exit code 2."""


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; given `argv`, only the command it names is registered (see command_modules)."""
    parser = argparse.ArgumentParser(prog="mmtrain", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"mmtrain {__version__}")
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log debug messages, and other libraries' info messages",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    command = next((a for a in argv or [] if not a.startswith("-")), None)
    for module in command_modules(command):
        module.register(sub)
    return parser


def configure_logging(verbose: bool) -> None:
    """mmtrain's loggers at INFO (DEBUG with -v); everyone else's at WARNING (INFO with -v).

    Libraries log their own INFO lines (botocore's "Found credentials in environment
    variables", httpx's requests) that would otherwise interleave with mmtrain's output; a user
    debugging with -v wants them back. The root logger's level is what third-party loggers
    inherit; mmtrain's own tree gets its level on the `mmtrain` logger."""
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")  # a no-op if set already
    logging.getLogger().setLevel(logging.INFO if verbose else logging.WARNING)
    logging.getLogger("mmtrain").setLevel(logging.DEBUG if verbose else logging.INFO)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    try:
        code = int(args.func(args) or 0)
    except (UsageError, FieldError, FileNotFoundError) as err:
        print(f"mmtrain {args.command}: error: {err}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        return 130
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A rank of a torchrun job: leave without Python's finalization, which can abort while
        # gloo's threads still release collectives (mmtrain.distributed.end_rank_process).
        from mmtrain.distributed import end_rank_process

        end_rank_process(code)
    return code
