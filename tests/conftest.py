"""Shared test set-up: no OUTBOX_* variable of the developer's shell leaks into a test."""

from __future__ import annotations

import os

for _name in list(os.environ):
    if _name.startswith("OUTBOX_") and not _name.startswith("OUTBOX_TEST_"):
        del os.environ[_name]
