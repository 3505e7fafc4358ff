"""schema/schema.sql and the generated migrations are what schema/build.py makes from the engine's
sources (schema/engine/), as a lockfile check does: an edit of a generated file, or an engine
change no migration carries, fails here (tests/integration/test_schema.py then proves the
catalogs equal)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def build_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("schema_build", ROOT / "schema" / "build.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_files_match_their_sources() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "schema" / "build.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_every_engine_function_has_one_source_and_is_included() -> None:
    build = build_module()
    names = sorted(p.stem for p in (ROOT / "schema" / "engine").glob("*.sql"))
    tables = (ROOT / "schema" / "tables.sql").read_text()
    included = sorted(build.INCLUDE.findall(tables))
    assert included == names
    # No engine function is defined a second time outside its file.
    for name in names:
        assert f"FUNCTION ${{schema}}.${{table}}_{name}(" not in tables


def copy_tree(tmp_path: Path) -> Path:
    target = tmp_path / "schema"
    shutil.copytree(ROOT / "schema", target)
    return target


def test_the_check_fails_on_a_hand_edited_schema_and_on_an_engine_change_no_step_carries(
    tmp_path: Path,
) -> None:
    schema = copy_tree(tmp_path)
    build = [sys.executable, str(schema / "build.py"), "--check"]
    (schema / "schema.sql").write_text((schema / "schema.sql").read_text() + "\n-- edited\n")
    edited = subprocess.run(build, capture_output=True, text=True, check=False)
    assert edited.returncode == 1 and "schema/schema.sql is not what" in edited.stderr
    subprocess.run([sys.executable, str(schema / "build.py")], check=True, capture_output=True)
    # (a function no step carries yet: an unreleased step's functions follow their sources)
    (schema / "engine" / "extra.sql").write_text(
        "CREATE OR REPLACE FUNCTION ${schema}.${table}_extra() RETURNS integer\n"
        "    LANGUAGE sql\nAS $fn$\nSELECT 1;\n$fn$;\n"
    )
    tables = schema / "tables.sql"
    tables.write_text(tables.read_text() + "\n-- @engine extra\n")
    subprocess.run([sys.executable, str(schema / "build.py")], check=False, capture_output=True)
    missed = subprocess.run(build, capture_output=True, text=True, check=False)
    assert missed.returncode == 1 and "schema/engine/extra.sql differs" in missed.stderr


@pytest.mark.parametrize("name", ["bad name", "Upper"])
def test_a_new_step_needs_a_plain_name(tmp_path: Path, name: str) -> None:
    schema = copy_tree(tmp_path)
    result = subprocess.run(
        [sys.executable, str(schema / "build.py"), "new", name], capture_output=True, check=False
    )
    assert result.returncode == 2


def test_a_new_step_carries_the_changed_functions(tmp_path: Path) -> None:
    schema = copy_tree(tmp_path)
    sweep = schema / "engine" / "sweep.sql"
    sweep.write_text(sweep.read_text().replace("repaired := 0;", "repaired := 0; -- changed"))
    subprocess.run(
        [sys.executable, str(schema / "build.py"), "new", "sweep_change"],
        check=True,
        capture_output=True,
    )
    steps = sorted((schema / "steps").glob("*_sweep_change.sql"))
    assert len(steps) == 1
    assert "-- @engine sweep\n" in steps[0].read_text()
    migration = schema / "migrations" / steps[0].name
    assert "repaired := 0; -- changed" in migration.read_text()
    check = subprocess.run(
        [sys.executable, str(schema / "build.py"), "--check"], capture_output=True, check=False
    )
    assert check.returncode == 0
