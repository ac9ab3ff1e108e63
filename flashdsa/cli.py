"""``flashdsa`` command line: each subcommand lives in its own module and is imported on use.

A subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``, and may set
``LOG_LEVEL`` (its default ``--log-level``). Only the chosen subcommand's module is imported, so
``flashdsa --help`` stays fast. A user error, caught by argparse or raised by ``run`` as an
:class:`~flashdsa.errors.ArgumentError`, prints one line naming the argument and exits 2;
``--debug`` prints its traceback too.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import traceback
from typing import NoReturn

from flashdsa.errors import ArgumentError

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("flashdsa.demo", "run the DSA ops on random data, every backend against the reference"),
    "finetune": ("flashdsa.train.finetune", "train a DSA model: dense warm-up of the indexer, then sparse training"),
    "serve": ("flashdsa.serve.command", "serve a model over an OpenAI-compatible HTTP API"),
    "make-tiny": ("flashdsa.models.tiny_cli", "write a tiny random DeepSeek-V3.2 checkpoint (HF layout, with tokenizer)"),
    "check": ("flashdsa.check.cli", "compare flashdsa with transformers layer by layer on a checkpoint"),
    "generate": ("flashdsa.generate", "generate text from a prompt through the paged caches"),
    "plan": ("flashdsa.runtime.parallel.plan_command", "per-rank memory plan of a checkpoint (config.json only, no GPU)"),
    "build-kernels": ("flashdsa.build_kernels", "build the native CUDA kernels ahead of first use (--compile-only: no GPU)"),
}
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
USAGE_ERROR = 2


class Parser(argparse.ArgumentParser):
    """Reports a bad command line in one line (no usage block) and exits 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message}\n")


def add_common_options(parser: argparse.ArgumentParser, subcommand: bool) -> None:
    """--log-level and --debug, accepted before and after the subcommand (the subcommand's copy
    leaves the value alone unless given)."""
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS,
                        default=argparse.SUPPRESS if subcommand else None,
                        help="logging level (default WARNING; serve: INFO)")
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS if subcommand else False,
                        help="print the traceback of an error too")


def build_parser(command: str | None) -> Parser:
    """The parser, with full arguments for ``command`` only (the others list their help line)."""
    parser = Parser(prog="flashdsa", description="flashdsa: DeepSeek Sparse Attention runtime")
    add_common_options(parser, subcommand=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_common_options(p, subcommand=True)
        if name == command:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if a in SUBCOMMANDS), None)
    args = build_parser(command).parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    level = args.log_level or getattr(module, "LOG_LEVEL", "WARNING")
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(level)
    try:
        return module.run(args) or 0
    except ArgumentError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"flashdsa {args.command}: error: argument {exc.flag}: {exc.message}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print(f"flashdsa {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
