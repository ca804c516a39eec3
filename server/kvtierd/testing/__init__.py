"""Test doubles for kvtierd: for tests and fault-injection tooling only, never imported by the daemon.

* ``faults``: :class:`~kvtierd.testing.faults.FaultyDevice` / ``FaultyFileSystem`` wrap the NVMe
  tier's disk seam (``kvtierd.tiers.nvme.device``) to inject errors, torn writes, flipped bytes and
  latency over real files.
* ``serve``: ``python -m kvtierd.testing.serve --read-latency-ms MS serve ...`` runs a real daemon
  whose NVMe reads are slowed by ``MS`` (a slow disk to hold a load in flight; vLLM async tests).

Nothing under ``kvtierd`` outside this package imports it
(tests/unit/kvtierd/tiers/nvme/test_nvme_device.py checks).
"""
