"""outbox-dispatcher: moves events from a PostgreSQL transactional outbox to Kafka."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("outbox-dispatcher")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = ["__version__"]
