"""The house's "never" list for the operator layer and the faces, read from the imports (as
test_broker.py pins the one module below aiokafka's API): the operator layer knows no face, and
the console does not stand on the CLI."""

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
        assert offenders(face, "outbox_dispatcher.store", "outbox_dispatcher.sql") == []
        assert attribute_uses(face, "store") == [], face
