"""The house's "never" list, read from the imports (as test_broker.py pins the one module below
aiokafka's API): the operator layer knows no face, the console does not stand on the CLI, and the
Kafka side knows neither the loop above it nor the database side nor the settings."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "outbox_dispatcher"


def imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth of the file (lazy imports too), absolute."""
    found: set[str] = set()
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}".rstrip(".")
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def offenders(folder: str, *forbidden: str) -> list[str]:
    """Files of `folder` that import a module under one of `forbidden`."""
    found = []
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        for name in sorted(imports(path)):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                found.append(f"{path.relative_to(PACKAGE)}: {name}")
    return found


def test_the_reader_sees_every_kind_of_import() -> None:
    sample = PACKAGE / "cli" / "__init__.py"
    assert "outbox_dispatcher.cli.operator" in imports(sample)  # from outbox_dispatcher.cli import
    lazy = PACKAGE / "cli" / "process.py"
    assert "outbox_dispatcher.console" in imports(lazy), "an import inside a function counts"


def test_the_operator_layer_imports_neither_face() -> None:
    assert offenders("operate", "outbox_dispatcher.cli", "outbox_dispatcher.console") == []
    # Nor a face's machinery: its filters are data, not a command line or a request.
    assert offenders("operate", "argparse", "starlette", "jinja2", "tqdm") == []


def test_the_console_does_not_import_the_cli() -> None:
    assert offenders("console", "outbox_dispatcher.cli") == []


def attribute_uses(folder: str, name: str) -> list[str]:
    """Places in `folder` that read an attribute `name` (x.store, session.store.fetch...)."""
    found = []
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == name:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    return found


def test_the_faces_reach_the_database_only_through_the_operator_layer() -> None:
    """The CLI's operator commands and the console read and act through operate/ (reads,
    listings, actions, jobs, logins), never through the store or its statements, so that a
    change of what "pending" or "in flight" means (the claim engine's) changes one place."""
    for face in ("cli", "console"):
        assert offenders(face, "outbox_dispatcher.store") == []
        assert attribute_uses(face, "store") == [], face


def test_the_root_exceptions_import_neither_the_kafka_side_nor_its_client() -> None:
    """errors.py keeps the root exception and its subclasses, below everything; how a publish
    failure is handled and described is the Kafka side's (kafka/failures.py), which imports
    errors.py, never the other way round."""
    found = imports(PACKAGE / "errors.py")
    assert [name for name in sorted(found) if name.startswith("outbox_dispatcher.kafka")] == []
    assert [name for name in sorted(found) if name.split(".")[0] == "aiokafka"] == []
    assert "outbox_dispatcher.errors" in imports(PACKAGE / "kafka" / "failures.py")


# The database side: the store/ folder (statements, stores, the executor helper, migrations).
STORE_SIDE = ("outbox_dispatcher.store",)


def test_only_the_store_and_the_inbox_import_asyncpg() -> None:
    """The database client is the store's business: the rest of the package names its types and
    errors through store/db.py (and the faces through operate/session.py), so that a change of
    driver or of a class the client raises is one folder's change."""
    found = [
        f"{path.relative_to(PACKAGE)}: {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.parent.name != "store" and path.name != "inbox.py"
        for name in sorted(imports(path))
        if name.split(".")[0] == "asyncpg"
    ]
    assert found == []


def test_the_store_imports_nothing_above_it() -> None:
    """store/ runs statements for whoever holds it: it imports neither the Kafka side, nor the
    loop, nor the operator layer, nor a face."""
    above = ("kafka", "dispatch", "operate", "cli", "console")
    assert offenders("store", *(f"outbox_dispatcher.{name}" for name in above)) == []


# aiokafka's public API: the producer, its errors and structs, the default partitioner's hash.
# aiokafka.admin: the documented admin client (the progress topic's creation,
# kafka/exactly_once/progress.py).
AIOKAFKA_PUBLIC = (
    "aiokafka",
    "aiokafka.errors",
    "aiokafka.structs",
    "aiokafka.partitioner",
    "aiokafka.admin",
)


def test_the_kafka_side_imports_neither_the_loop_nor_the_store_nor_the_settings() -> None:
    """kafka/ is handed its configs (dispatch/supervisor.configs_of builds them) and gives its
    parts to whoever iterates a delivery: it imports nothing above it."""
    assert offenders("kafka", "outbox_dispatcher.dispatch", *STORE_SIDE) == []
    assert offenders("kafka", "outbox_dispatcher.config") == []
    assert offenders("kafka", "asyncpg", "pydantic_settings") == []


def test_the_never_list_reader_finds_an_offender() -> None:
    """The checks above can fail: the loop imports the Kafka side, and the store the database."""
    assert offenders("dispatch", "outbox_dispatcher.kafka")
    assert [f for f in offenders(".", *STORE_SIDE) if f.startswith("dispatch/")]


def test_only_kafka_internals_imports_aiokafka_below_its_public_api() -> None:
    """As test_broker.py reads the private attributes, this reads the imports: aiokafka's
    internal modules (client, cluster, conn, protocol, producer, record, ...) are imported by
    kafka/internals.py only, and aiokafka by kafka/ only."""
    internal = []
    outside = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        for module in sorted(imports(path)):
            if module.split(".")[0] != "aiokafka":
                continue
            if not name.startswith("kafka/"):
                outside.append(f"{name}: {module}")
            public = module in AIOKAFKA_PUBLIC or module.rsplit(".", 1)[0] in AIOKAFKA_PUBLIC
            if not public and name != "kafka/internals.py":
                internal.append(f"{name}: {module}")
    assert internal == [], "move these into outbox_dispatcher/kafka/internals.py"
    assert outside == [], "only the Kafka side speaks to aiokafka"
    assert "aiokafka.conn" in imports(PACKAGE / "kafka" / "internals.py"), "the reader sees them"
