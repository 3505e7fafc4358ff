"""How the pages show values: writer-controlled text made inert (HTML-escaped, and control,
format and line-breaking characters shown as marked escapes), times relative with the exact
time on hover, counts with thousands separators, words in the singular or plural."""

from __future__ import annotations

import contextlib
import json
from datetime import UTC, datetime

import orjson
from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup, escape

from outbox_dispatcher import display


def _escape_of(char: str) -> str:
    code = ord(char)
    named = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
    return named.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def inert(value: object) -> Markup:
    """Text as inert HTML. A control, format or line-breaking character is shown as its escape
    in a marked span (so that an escape character and the four characters `\\x1b` look
    different); every other character is itself, HTML-escaped."""
    text = "" if value is None else str(value)
    out: list[str] = []
    for char in text:
        if display.unsafe(char) or char in "\n\r\t":
            code = f"U+{ord(char):04X}"
            out.append(
                f'<span class="ctl" title="control character {code}">{_escape_of(char)}</span>'
            )
        else:
            out.append(str(escape(char)))
    return Markup("".join(out))  # noqa: S704 - every character escaped or replaced above


def inert_lines(value: object) -> Markup:
    """Like `inert`, but newlines stay (a traceback's lines)."""
    return Markup("\n").join(inert(line) for line in str(value).split("\n"))


def shortened(value: object, width: int) -> Markup:
    text = "" if value is None else str(value)
    return inert(display.shorten(text, width))


def _datetime(value: object) -> datetime | None:
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = datetime.fromisoformat(value)
    return value if isinstance(value, datetime) else None


def exact_time(value: object) -> str:
    at = _datetime(value)
    if at is None:
        return "-" if value is None else str(value)
    return at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def relative(seconds: float) -> str:
    """'just now', '12s ago', '5 min ago', '3 h ago', '2 d ago'; 'in 5 min' ahead."""
    ahead = seconds < 0
    seconds = abs(seconds)
    if seconds < 2:
        return "just now"
    if seconds < 60:
        text = f"{seconds:.0f}s"
    elif seconds < 3600:
        text = f"{seconds / 60:.0f} min"
    elif seconds < 86400 * 2:
        text = f"{seconds / 3600:.1f} h"
    else:
        text = f"{seconds / 86400:.0f} d"
    return f"in {text}" if ahead else f"{text} ago"


def when(value: object) -> Markup:
    """A time as `<time>`: relative to now, the exact UTC time on hover."""
    at = _datetime(value)
    if at is None:
        return Markup("-")
    ago = (datetime.now(UTC) - at).total_seconds()
    iso = escape(at.isoformat())
    return Markup(  # noqa: S704 - only escaped values and fixed words
        f'<time datetime="{iso}" title="{exact_time(at)}">{relative(ago)}</time>'
    )


def shown(value: object) -> Markup:
    """A filter's value: yes/no, a list joined, text made inert."""
    if isinstance(value, bool):
        return inert("yes" if value else "no")
    if isinstance(value, list):
        return Markup(", ").join(inert(item) for item in value)
    return inert(value)


def plural(n: int, word: str, words: str | None = None) -> str:
    """'1 dispatcher', '3 dispatchers', '2,400 rows'."""
    return f"{n:,} {word}" if n == 1 else f"{n:,} {words or word + 's'}"


def number(value: object) -> str:
    return f"{value:,}" if isinstance(value, int) else "-" if value is None else str(value)


def ascii_json(value: object) -> str:
    """JSON with every non-ASCII character escaped: exact, yet no control or bidi character
    reaches the page (for hidden form fields that carry a filter back)."""
    return json.dumps(value, ensure_ascii=True, default=_time_value)


def _time_value(value: object) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(type(value).__name__)


def exact_attribute(value: object) -> Markup:
    """An attribute value that the browser reads back exactly while the page's source holds no
    raw control, format or line-breaking character (each written as a character reference)."""
    text = str(escape("" if value is None else value))
    exact = "".join(f"&#x{ord(c):x};" if display.unsafe(c) else c for c in text)
    return Markup(exact)  # noqa: S704 - escaped above, and character references are inert


def environment() -> Environment:
    env = Environment(
        loader=PackageLoader("outbox_dispatcher.console", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
    )
    env.filters["inert"] = inert
    env.filters["inert_lines"] = inert_lines
    env.filters["short"] = shortened
    env.filters["age"] = display.age_text
    env.filters["time"] = exact_time
    env.filters["when"] = when
    env.filters["num"] = number
    env.filters["shown"] = shown
    env.filters["json"] = lambda value: orjson.dumps(value).decode()
    env.filters["ascii_json"] = ascii_json
    env.filters["exact"] = exact_attribute
    env.globals["plural"] = plural
    return env
