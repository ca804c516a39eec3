"""``python -m kvtierd serve|fsck``: the daemon's entry (same as the ``kvtierd`` script)."""

from kvtierd.cli import main

raise SystemExit(main())
