"""Names the dispatcher builds SQL and variables from: identifiers validated and quoted once,
schema patterns (`tenant_*`) and what they match, the database URL checked without quoting it and
the database it names, the environment variable of a setting."""

from __future__ import annotations

import functools
import heapq
import re
import urllib.parse

# Lowercase only, so that derived names (outbox_claim, outbox_schema_version, ...) stay valid,
# unquoted-equivalent identifiers; short enough that every derived name fits in 63 bytes.
IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,39}$")
# The home database's schema of the fleet's membership table (store/fleet.sql): never an outbox's.
FLEET_SCHEMA = "outbox_fleet"
RESERVED_SCHEMAS = frozenset({"pg_catalog", "information_schema", "pg_toast", FLEET_SCHEMA})
# A schema pattern of OUTBOX_SOURCES: identifier characters and '*', which matches any run of them.
PATTERN = re.compile(r"^[a-z_*][a-z0-9_*]*$")
STAR = "[a-z0-9_]*"


def validate_identifier(value: str, what: str) -> str:
    if not IDENTIFIER.match(value):
        msg = (
            f"{what} {value!r} is not allowed: use 1-40 characters of lowercase letters, digits "
            "and underscores, starting with a letter or underscore"
        )
        raise ValueError(msg)
    return value


def schema_or_pattern(value: str) -> str:
    """A schema name, or a pattern whose `*` stands for any run of identifier characters."""
    if "*" not in value:
        validate_identifier(value, "schema")
    elif not PATTERN.match(value) or len(value.replace("*", "")) > 40:
        msg = (
            f"schema pattern {value!r} is not allowed: apart from '*', use at most 40 lowercase "
            "letters, digits and underscores, starting with a letter, underscore or '*'"
        )
        raise ValueError(msg)
    if value in RESERVED_SCHEMAS or value.startswith("pg_"):
        msg = (
            f"schema {value!r} is a system schema (or only matches them) or the fleet's "
            f"{FLEET_SCHEMA}: choose another"
        )
        raise ValueError(msg)
    return value


def schema_matches(pattern: str, schema: str) -> bool:
    """Whether `schema` is `pattern` or one of the names it matches."""
    return re.fullmatch(STAR.join(map(re.escape, pattern.split("*"))), schema) is not None


def common_name(p: str, q: str) -> str | None:
    """The shortest schema name that both `p` and `q` (names or patterns) match, or None. Always
    decidable: a shortest path through the pairs of positions in both; a word that would begin
    with a digit is prefixed (both begin with '*' then), one longer than 40 is no name."""
    heap: list[tuple[int, str, int, int]] = [(0, "", 0, 0)]
    seen: set[tuple[int, int]] = set()
    while heap:
        _, word, i, j = heapq.heappop(heap)
        if (i, j) in seen:
            continue
        seen.add((i, j))
        if (i, j) == (len(p), len(q)):
            word = word if word[:1].isalpha() or word[:1] == "_" else "x" + word
            return word if len(word) <= 40 else None
        a, b = p[i : i + 1], q[j : j + 1]
        steps = [(i + 1, j, "")] if a == "*" else []
        steps += [(i, j + 1, "")] if b == "*" else []
        if a and b and "*" not in (a, b) and a == b:
            steps.append((i + 1, j + 1, a))
        elif a == "*" and b not in ("", "*"):
            steps.append((i, j + 1, b))
        elif b == "*" and a not in ("", "*"):
            steps.append((i + 1, j, a))
        for ni, nj, char in steps:
            heapq.heappush(heap, (len(word) + len(char), word + char, ni, nj))
    return None


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


@functools.lru_cache(maxsize=1024)
def database_of(url: str) -> str:
    """A database as messages, labels and grouping name it: hosts, ports and name, never the user
    or password ("db1:5432/app"): two URLs of one database with other users or options name it
    alike. The URL has passed database_url_problem. Cached: every served outbox's `database`
    asks (its key, each probe and registry pass over them all: 220k URL parses in a fleet's
    first 90 s with 500 outboxes, a tenth of its process's CPU), and a process has few URLs."""
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qs(parts.query)
    userinfo, _, netloc = parts.netloc.rpartition("@")
    default_port = query.get("port", ["5432"])[0]
    hosts = []
    for host in (netloc or ",".join(query.get("host", []))).split(","):
        name, colon, port = host.rpartition(":")
        if not colon or name.count("[") != name.count("]") or host.endswith("]"):
            name, port = host, ""
        hosts.append(f"{urllib.parse.unquote(name).lower() or 'localhost'}:{port or default_port}")
    user = urllib.parse.unquote(userinfo.split(":", 1)[0])
    name = urllib.parse.unquote(parts.path.lstrip("/"))
    name = name or (query.get("dbname") or query.get("database") or [user])[0]
    return f"{','.join(sorted(hosts))}/{name}"
