"""Shared test set-up: no OUTBOX_* variable of the developer's shell leaks into a test."""

from __future__ import annotations

import os

from outbox_dispatcher import logs

for _name in list(os.environ):
    # Kept: OUTBOX_SERVICES_* (services' ports, for stop/start), OUTBOX_CHAOS* (scale, report).
    if _name.startswith("OUTBOX_") and not _name.startswith(
        ("OUTBOX_TEST_", "OUTBOX_SERVICES_", "OUTBOX_CHAOS")
    ):
        del os.environ[_name]

logs.configure("console", "INFO")
