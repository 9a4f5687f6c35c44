"""Console output for the CLI: rich tables and progress where rich is installed, plain text otherwise.

Library code never prints; only the CLI and examples use this module.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

try:
    from rich.console import Console
    from rich.table import Table

    # Wide enough for the benchmark table when the output is a file or a pipe (rich assumes 80 then).
    _console: Any = Console(stderr=False, width=None if sys.stdout.isatty() else 160)
except ImportError:  # the "cli" extra is not installed
    Console = None  # type: ignore[assignment,misc]
    Table = None  # type: ignore[assignment,misc]
    _console = None

__all__ = ["echo", "table"]


def echo(text: str = "") -> None:
    if _console is not None:
        _console.print(text, highlight=False, markup=False)  # "[bench] ..." is text, not a style tag
    else:
        print(text, file=sys.stdout, flush=True)


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    if _console is not None and Table is not None:
        t = Table(title=title)
        for c in columns:
            t.add_column(c)
        for r in rows:
            t.add_row(*(str(x) for x in r))
        _console.print(t)
        return
    cells = [list(columns)] + [[str(x) for x in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    print(title)
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
