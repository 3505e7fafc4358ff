"""The database side: the statements by name, and the two faces that run them (the dispatcher's
and the operator's), each built once and handed to the components that need it."""

from __future__ import annotations

from outbox_dispatcher.store.base import Row, StoreBase
from outbox_dispatcher.store.dispatch import DispatchStore, OutOfMemoryError
from outbox_dispatcher.store.operator import OperatorStore
from outbox_dispatcher.store.statements import Statement, Statements

__all__ = [
    "DispatchStore",
    "OperatorStore",
    "OutOfMemoryError",
    "Row",
    "Statement",
    "Statements",
    "StoreBase",
]
