"""``flashdsa`` command line: each subcommand lives in its own module and is imported on use.

A subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``. Only the chosen
subcommand's module is imported, so ``flashdsa --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("flashdsa.demo", "run the DSA ops on random data, every backend against the reference"),
    "finetune": ("flashdsa.train.finetune", "train a DSA model: dense warm-up of the indexer, then sparse training"),
    "serve": ("flashdsa.serve.command", "serve a model over an OpenAI-compatible HTTP API"),
    "make-tiny": ("flashdsa.models.tiny_cli", "write a tiny random DeepSeek-V3.2 checkpoint (HF layout, with tokenizer)"),
    "check": ("flashdsa.check.cli", "compare flashdsa with transformers layer by layer on a checkpoint"),
    "generate": ("flashdsa.generate", "generate text from a prompt through the paged caches"),
    "plan": ("flashdsa.runtime.parallel.plan_command", "per-rank memory plan of a checkpoint (config.json only, no GPU)"),
}


def build_parser(command: str | None) -> argparse.ArgumentParser:
    """The parser, with full arguments for ``command`` only (the others list their help line)."""
    parser = argparse.ArgumentParser(prog="flashdsa", description="flashdsa: DeepSeek Sparse Attention runtime")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if a in SUBCOMMANDS), None)
    args = build_parser(command).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return importlib.import_module(SUBCOMMANDS[args.command][0]).run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
