from __future__ import annotations

from benchmarks.harness import main

raise SystemExit(main())
