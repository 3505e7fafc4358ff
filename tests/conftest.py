"""Shared test set-up: no OUTBOX_* variable of the developer's shell leaks into a test."""

from __future__ import annotations

import os

from outbox_dispatcher import logs

for _name in list(os.environ):
    # OUTBOX_CHAOS=full selects the long versions of the chaos tests; it configures the suite.
    if (
        _name.startswith("OUTBOX_")
        and not _name.startswith("OUTBOX_TEST_")
        and _name != "OUTBOX_CHAOS"
    ):
        del os.environ[_name]

logs.configure("console", "INFO")
