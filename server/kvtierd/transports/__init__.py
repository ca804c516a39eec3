"""Daemon side of the data plane. Transports move bytes and never change the index.

* ``shm``: hands the arena's memfd to same-host clients over a Unix socket (SCM_RIGHTS); the
  client copies bytes itself, so the daemon never touches payloads on this path.
* ``tcp``: the framed data channel (kvtier_contract.wire, docs/tcp_data_channel.md); payloads are received
  straight into arena slots and sent straight from them.

Lifecycle of each server: ``start()`` (binds, serves on the daemon loop) -> ``close()``.
"""
