"""Where settings come from besides flags and OUTBOX_* variables: OUTBOX_<SETTING>_FILE and
the files of OUTBOX_SECRETS_DIR (secrets mounted as files, never in the environment)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from outbox_dispatcher import errors
from outbox_dispatcher.config.names import env_name

SECRETS_DIR_VARIABLE = "OUTBOX_SECRETS_DIR"


def read_secret_file(path: Path, what: str) -> str:
    """A file's text without its trailing newline (editors and `echo` add one). The error names
    the variable and the path, never the content."""
    try:
        text = path.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        msg = f"cannot read {what} ({errors.describe(exc)}): fix the path or the file's permissions"
        raise errors.ConfigurationError(msg) from exc
    return text.rstrip("\r\n")


class _FileSource(PydanticBaseSettingsSource):
    """A source whose values are files: every setting that has one, read by get_field_value."""

    def __call__(self) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for name, field in self.settings_cls.model_fields.items():
            value, key, _ = self.get_field_value(field, name)
            if value is not None:
                values[key] = value
        return values


class FileVariablesSource(_FileSource):
    """OUTBOX_<SETTING>_FILE=<path>: the setting's value is the file's content (Docker and
    Kubernetes secrets mounted as files, so that the secret is not in the environment)."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        variable = env_name(field_name) + "_FILE"
        path = os.environ.get(variable)
        if not path:
            return None, field_name, False
        return read_secret_file(Path(path), f"{variable}={path}"), field_name, False


class SecretsDirSource(_FileSource):
    """Files in the directory OUTBOX_SECRETS_DIR (e.g. a mounted Kubernetes Secret), each named
    like the setting's variable (OUTBOX_DATABASE_URL; case does not matter)."""

    def __init__(self, settings_cls: type[BaseSettings]) -> None:
        super().__init__(settings_cls)
        self._files: dict[str, Path] = {}
        directory = os.environ.get(SECRETS_DIR_VARIABLE)
        if not directory:
            return
        root = Path(directory)
        if not root.is_dir():
            msg = f"{SECRETS_DIR_VARIABLE}={directory} is not a directory: mount it or unset it"
            raise errors.ConfigurationError(msg)
        # Kubernetes mounts a Secret as symlinks into a hidden ..data directory: skip dot files.
        self._files = {p.name.upper(): p for p in root.iterdir() if not p.name.startswith(".")}

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        name = env_name(field_name)
        path = self._files.get(name)
        if path is None or not path.is_file():
            return None, field_name, False
        return read_secret_file(path, f"{name} in {SECRETS_DIR_VARIABLE}"), field_name, False
