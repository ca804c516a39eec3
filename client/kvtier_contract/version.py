"""The one place kvtier's version is written.

Both distributions (``kvtier``, the SDK with the contract, and ``kvtierd``, the daemon) take
their version from here at build time, and both CLIs print it with ``--version``. The daemon
imports only the contract, so the version lives in the contract, not in the SDK.
"""

__version__ = "0.2.0"
