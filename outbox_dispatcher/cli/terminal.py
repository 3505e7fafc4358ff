"""The CLI's terminal: results on stdout, one-line messages on stderr, JSON, the question the
widest commands ask, and a progress bar; and the exit codes."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator

import orjson
from tqdm import tqdm

from outbox_dispatcher.operate.actions import Advance

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2  # a usage error, or invalid settings
EXIT_CONFIG = EXIT_USAGE
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it


def out(line: str = "") -> None:
    sys.stdout.write(line + "\n")


def err(line: str) -> None:
    sys.stderr.write(f"outbox-dispatcher: {line}\n")


def warn(line: str) -> None:
    """A line of a report that is not a result (check's warnings and problems)."""
    sys.stderr.write(line + "\n")


def json(value: object) -> None:
    sys.stdout.write(orjson.dumps(value, option=orjson.OPT_INDENT_2).decode() + "\n")


def confirm(ns: argparse.Namespace, question: str) -> bool:
    """The widest commands ask on a terminal unless --yes; in a script (no terminal) they run."""
    if getattr(ns, "yes", False) or not sys.stdin.isatty():
        return True
    sys.stderr.write(f"outbox-dispatcher: {question} Type 'yes' to go on: ")
    sys.stderr.flush()
    return sys.stdin.readline().strip().lower() == "yes"


@contextlib.contextmanager
def progress(total: int | None, what: str) -> Iterator[Advance]:
    """A progress bar on stderr when it is a terminal; nothing otherwise."""
    bar = tqdm(
        total=total,
        desc=what,
        unit=" rows",
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
        leave=False,
        dynamic_ncols=True,
    )
    try:
        yield bar.update
    finally:
        bar.close()
