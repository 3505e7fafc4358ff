"""Shared test set-up: no OUTBOX_* variable of the developer's shell leaks into a test."""

from __future__ import annotations

import os

from outbox_dispatcher import logs

for _name in list(os.environ):
    # OUTBOX_SERVICES_* (the ports of deploy/local/services.sh) must reach the outage tests'
    # kafka-stop/kafka-start, or those act on the default ports. OUTBOX_CHAOS=full selects the
    # long versions of the chaos tests.
    if _name.startswith("OUTBOX_") and not _name.startswith(
        ("OUTBOX_TEST_", "OUTBOX_SERVICES_", "OUTBOX_CHAOS")
    ):
        del os.environ[_name]

logs.configure("console", "INFO")
