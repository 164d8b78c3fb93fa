"""``python -m prefzoo.report DIR``: :func:`prefzoo.report.main`."""

from prefzoo.report import main

raise SystemExit(main())
