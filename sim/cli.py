"""The ``fedpate`` command line (its commands: docs/PRIVACY.md, "Command line").

Each subcommand lives in ``sim/commands/<name>.py`` and exposes ``register(subparsers)``, which adds its
parser and sets ``func`` (called with the parsed args; returns an exit status or None). Commands are
imported lazily so ``fedpate privacy ...`` does not pay for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import task.learning.phases  # noqa: F401  (first: its clock's zero is the process start, the cost table's "imports")

# Order is the order shown in --help.
COMMANDS = ("privacy", "data", "central", "simulate", "compare", "deploy", "predict", "evaluate", "demo")

#: what an interrupted command leaves, by command (the rest: what was written is kept)
RESUMABLE = {
    "compare": "finished cells are kept; run the same command again to resume",
    "demo": "finished cells are kept; run the same command again to resume",
}


def _user_error_types() -> tuple[type[BaseException], ...]:
    from privacy.errors import PrivacyError
    from task.errors import UserError

    return (UserError, PrivacyError)


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser, its errors one line (``fedpate compare: error: argument --task: invalid choice ...``)
    instead of the whole usage first: the usage is one ``--help`` away, and named in the line. Subcommands' parsers
    are of the same class (``add_subparsers`` makes them so)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="fedpate",
        description="Federated, privately trained brain-tumour segmentation (high-dimensional PATE, DP-SGD).",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"sim.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"sim.commands.{name}":
                continue  # not built yet
            raise
        module.register(subparsers)
    plain_choices(parser)
    return parser


def plain_choices(parser: argparse.ArgumentParser) -> None:
    """Every option's choices and default as the strings a user types: argparse names a bad value's choices by
    their ``repr``, which for an option enum is ``<CompareTask.SEGMENTATION: 'segmentation'>`` (the enums are
    ``StrEnum``s, so the commands compare the plain strings with their members alike)."""
    from enum import Enum

    def plain(value):
        return value.value if isinstance(value, Enum) else value

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                plain_choices(sub)
            continue
        if action.choices is not None:
            action.choices = tuple(plain(choice) for choice in action.choices)
        action.default = plain(action.default)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # this entry point is guarded (``if __name__ == "__main__"``, as a console script's is): spawned phantom
    # workers can import it safely, so worlds generate their phantoms on every core (task.world.phantom_workers)
    os.environ.setdefault("FEDPATE_PHANTOM_WORKERS", "auto")
    # the commit this command starts from labels every result it writes, however long it runs
    from task.reporting.provenance import pin_run_commit

    pin_run_commit()
    try:
        status = args.func(args)
    except _user_error_types() as exc:
        print(f"fedpate {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        kept = RESUMABLE.get(args.command, "everything written so far is kept")
        print(f"fedpate {args.command}: interrupted; {kept}", file=sys.stderr)
        return 130
    except OSError as exc:   # the machine, not the code: a full disk, a file another program removed, ...
        print(f"fedpate {args.command}: error: {exc}", file=sys.stderr)
        return 1
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
