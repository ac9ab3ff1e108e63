"""Training files that survive a kill at any moment.

Whole files (weights, configs, trainer state, the rewritten log, the plot) are written under a
temporary name in the same directory and renamed over the target, so a reader sees the old file
or the new one, never a torn one. The JSONL log is appended a line per step; a line torn by a kill
is skipped with a warning when read, and dropped when the log is rewritten on resume.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

PARTIAL = ".partial-"  # prefix of a file or directory being written


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path next to ``path`` to write to; renamed over ``path`` when the block ends
    without an error, removed when it raises."""
    path = Path(path)
    temporary = path.with_name(PARTIAL + path.name)
    try:
        yield temporary
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def write_text(path: str | Path, text: str) -> None:
    """Replace ``path``'s content with ``text`` in one rename."""
    with atomic_path(path) as temporary:
        temporary.write_text(text, encoding="utf-8")


def append_record(path: str | Path, record: dict) -> None:
    """Append ``record`` as one JSON line (flushed, so a kill tears at most this line)."""
    with Path(path).open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def read_records(path: str | Path) -> list[dict]:
    """The JSON lines of ``path`` (none if it does not exist); lines that do not parse, as a kill
    mid-write leaves, are skipped with a warning."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            logger.warning("%s:%d: skipping a torn log line (%d characters)", path, number, len(line))
    return records


def truncate_records(path: str | Path, last_step: int) -> None:
    """Keep the records of steps up to ``last_step`` (and drop torn lines), in one rename."""
    if Path(path).is_file():
        kept = [r for r in read_records(path) if r.get("step", 0) <= last_step]
        write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
