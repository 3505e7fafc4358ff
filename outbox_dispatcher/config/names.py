"""Names the dispatcher builds SQL and variables from: identifiers validated and quoted once,
the database URL checked without quoting it, the environment variable of a setting."""

from __future__ import annotations

import re
import urllib.parse

# Lowercase only, so that derived names (outbox_claim, outbox_schema_version, ...) stay valid,
# unquoted-equivalent identifiers; short enough that every derived name fits in 63 bytes.
IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,39}$")
RESERVED_SCHEMAS = frozenset({"pg_catalog", "information_schema", "pg_toast"})


def validate_identifier(value: str, what: str) -> str:
    if not IDENTIFIER.match(value):
        msg = (
            f"{what} {value!r} is not allowed: use 1-40 characters of lowercase letters, digits "
            "and underscores, starting with a letter or underscore"
        )
        raise ValueError(msg)
    return value


def split_list(value: str | None) -> list[str]:
    """A comma-separated setting's items, blanks dropped."""
    return [item.strip() for item in (value or "").split(",") if item.strip()]


def quote_identifier(value: str) -> str:
    """Quote an identifier that has already passed validate_identifier."""
    return '"' + value.replace('"', '""') + '"'


PERCENT_ENCODE = (
    "percent-encode the characters of the user name and password that mean something in a URL "
    "(@ as %40, : as %3A, / as %2F, ? as %3F, # as %23, % as %25)"
)


def database_url_problem(dsn: str) -> str | None:
    """Why `dsn` is not a PostgreSQL URL the driver would read as meant, or None. Never quotes
    any part of it: an unencoded '/', '?', '#' or '@' in the password moves the password's
    pieces into the host, port or path, where a driver's parse error would quote them."""
    try:
        parts = urllib.parse.urlsplit(dsn)
    except ValueError:
        return "it does not parse as a URL"
    if parts.scheme not in ("postgresql", "postgres") or not dsn.startswith(parts.scheme + "://"):
        return "it must start with postgresql://"
    netloc = parts.netloc
    rest = dsn[len(parts.scheme) + 3 + len(netloc) :]
    if netloc.count("@") > 1 or ("@" not in netloc and "@" in rest):
        return "an '@', '/', '?' or '#' in the user name or password is not percent-encoded"
    for host in netloc.rpartition("@")[2].split(","):
        port = host.rpartition("]")[2].rpartition(":")[2] if ":" in host else ""
        if port and not port.isdigit():
            return "a port is not a number (is a character of the password not percent-encoded?)"
    return None


def env_name(field: str) -> str:
    """The environment variable of a setting."""
    return "OUTBOX_SCHEMA" if field == "db_schema" else f"OUTBOX_{field.upper()}"
