"""Daemon side of the data plane, behind one seam (:mod:`kvtierd.transports.base`).

Transports move bytes and never change the index.

* ``shm``: hands the arena's memfd to same-host clients over a Unix socket (SCM_RIGHTS); the
  client copies bytes itself, so the daemon never touches payloads on this path.
* ``tcp``: the framed data channel (kvtier_contract.wire, docs/tcp_data_channel.md); payloads
  are received straight into arena slots and sent straight from them.
* ``cuda_ipc``: the daemon copies between clients' CUDA buffers (opened by IPC handle) and slots
  (cupy only when enabled; the CUDA calls behind ``cuda_driver.CudaDriver``).
"""
