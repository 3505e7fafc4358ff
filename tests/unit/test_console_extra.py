"""The console's web stack is the install extra outbox-dispatcher[console]: without it every
other command still runs, and `console` says in one line how to install it. Shown in a child
process whose imports of the web stack fail, as they do where the extra is not installed."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import outbox_dispatcher

ROOT = Path(__file__).resolve().parents[2]
WEB_STACK = ("starlette", "jinja2", "markupsafe", "uvicorn", "multipart", "python_multipart")
WEB_STACK += ("itsdangerous",)

# Installed at start-up by site (PYTHONPATH is searched first): a finder that refuses the web
# stack, the way Python refuses a module that is not installed.
SITECUSTOMIZE = f"""
import sys

class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {WEB_STACK!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
"""


def without_web_stack(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_the_child_cannot_import_the_web_stack(tmp_path: Path) -> None:
    ran = without_web_stack(tmp_path, "-c", "import starlette")
    assert ran.returncode == 1 and "No module named 'starlette'" in ran.stderr


def test_console_without_the_extra_says_in_one_line_how_to_install_it(tmp_path: Path) -> None:
    ran = without_web_stack(tmp_path, "-m", "outbox_dispatcher", "console")
    assert ran.returncode == 2, ran.stderr
    assert ran.stdout == ""
    [line] = ran.stderr.splitlines()
    assert line.startswith("outbox-dispatcher: `outbox-dispatcher console` needs the console's")
    assert "pip install 'outbox-dispatcher[console]'" in line


def modules_outside_the_console() -> list[str]:
    found = []
    for module in pkgutil.walk_packages(outbox_dispatcher.__path__, "outbox_dispatcher."):
        if not module.name.startswith(("outbox_dispatcher.console", "outbox_dispatcher.__main__")):
            found.append(module.name)
    return found


def test_everything_but_the_console_imports_without_the_web_stack(tmp_path: Path) -> None:
    modules = modules_outside_the_console()
    assert {"outbox_dispatcher.cli", "outbox_dispatcher.dispatch.supervisor"} <= set(modules)
    assert "outbox_dispatcher.operate.actions" in modules
    code = "import importlib, sys\n" + "".join(
        f"importlib.import_module({name!r})\n" for name in modules
    )
    code += f"assert not {{m.partition('.')[0] for m in sys.modules}} & set({WEB_STACK!r})\n"
    ran = without_web_stack(tmp_path, "-c", code)
    assert ran.returncode == 0, ran.stderr


@pytest.mark.parametrize(
    "command",
    [
        ("run",),
        ("migrate",),
        ("status",),
        ("dead", "list"),
        ("dead", "requeue"),
        ("replay",),
        ("pause",),
        ("resume",),
        ("cleanup",),
        ("check",),
        ("console",),
    ],
)
def test_every_command_parses_without_the_web_stack(tmp_path: Path, command: tuple[str]) -> None:
    ran = without_web_stack(tmp_path, "-m", "outbox_dispatcher", *command, "--help")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith(f"usage: outbox-dispatcher {' '.join(command)} [options]")


def test_the_web_stack_is_the_console_extra_and_the_dev_extra_and_the_image_install_it() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {"starlette", "jinja2", "uvicorn", "python-multipart", "itsdangerous"}
    console = project["optional-dependencies"]["console"]
    assert {pin.partition("==")[0] for pin in console} == names
    assert all("==" in pin for pin in console), "pinned"
    assert not {pin.partition("==")[0] for pin in project["dependencies"]} & names
    assert set(console) <= set(project["optional-dependencies"]["dev"])
    dockerfile = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    assert '"$(echo /wheels/*.whl)[console]"' in dockerfile
