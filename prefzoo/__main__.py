"""``python -m prefzoo COMMAND [arguments]``: the same as the ``prefzoo`` console script (:mod:`prefzoo.commands`)."""

from prefzoo.commands import main

raise SystemExit(main())
