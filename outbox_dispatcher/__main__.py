from __future__ import annotations

from outbox_dispatcher.cli import main

raise SystemExit(main())
