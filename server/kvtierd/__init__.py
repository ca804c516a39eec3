"""kvtierd: the kvtier daemon (host tier, index, sessions, gRPC service, data-plane servers).

The composition root is :mod:`kvtierd.app`; configuration is :class:`kvtierd.config.DaemonConfig`.
"""
