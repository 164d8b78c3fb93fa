"""``python -m prefzoo.diagnose RUN_DIR``: the beta doctor (:mod:`prefzoo.report.diagnose`), as ``prefzoo diagnose``."""

from prefzoo.report.diagnose import main

if __name__ == "__main__":
    raise SystemExit(main())
