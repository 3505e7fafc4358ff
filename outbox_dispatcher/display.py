"""Text for a human's terminal: writer-controlled strings made inert, and aligned columns.

Keys, topics, headers, reasons and pause notes come from writers or other operators. Printed raw,
an escape sequence clears the operator's screen or sets the window title, a carriage return
overwrites a line, a newline forges a table row and a bidi mark reorders what follows. Every human
output passes such text through `inert`; JSON output is exact (JSON escapes control characters).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence

_NAMED = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def unsafe(char: str) -> bool:
    # Cc: C0 and C1 controls and DEL (ESC among them); Cf: format characters (bidi embeddings,
    # overrides and isolates, zero-width joiners); Zl/Zp: line and paragraph separators.
    return unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp")


def inert(text: str) -> str:
    """`text` with every control, format and line-breaking character written as an escape
    (\\n, \\x1b, \\u202e), and the backslash doubled so that an escape is never ambiguous."""
    if text.isprintable() and "\\" not in text:
        return text
    out = []
    for char in text:
        if char in _NAMED:
            out.append(_NAMED[char])
        elif unsafe(char):
            code = ord(char)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(char)
    return "".join(out)


def inert_multiline(text: str) -> str:
    """Like `inert`, but newlines stay (a traceback's lines): each line is made inert."""
    return "\n".join(inert(line) for line in text.split("\n"))


def shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def columns(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows of cells as left-aligned columns under their header, each cell made inert."""
    cells = [[inert(cell) for cell in row] for row in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in cells
    ]


def age_text(seconds: float | None) -> str:
    """An age for people: 2.4s, 12m05s, 3h04m, 3d04h (JSON keeps the seconds)."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60)):
        if whole >= size:
            return f"{whole // size}{unit}{whole % size // sub_size:02d}{sub}"
    return f"{whole // 60}m{whole % 60:02d}s"
