"""``python -m kvtierd serve|fsck``: the daemon's entry (same as the ``kvtierd`` script)."""

try:
    from kvtierd.cli import main
except KeyboardInterrupt:  # Ctrl-C while Python imports the CLI: no traceback
    raise SystemExit(130) from None

raise SystemExit(main())
