"""Test doubles for kvtierd: for tests and fault-injection tooling only, never imported by the daemon.

* ``faults``: :class:`~kvtierd.testing.faults.FaultyDevice` / ``FaultyFileSystem`` wrap the NVMe
  tier's disk seam (``kvtierd.tiers.nvme.device``) to inject errors, torn writes, flipped bytes and
  latency over real files.

Nothing under ``kvtierd`` outside this package imports it (tests/unit/test_nvme_device.py checks).
"""
