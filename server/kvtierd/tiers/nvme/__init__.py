"""NVMe tier: the disk seam (``device``), the slot and directory format (``format``, grammar in
docs/block_format.md), the offline checker (``fsck``), the index log (``journal``) and the tier
itself (``tier``: block files, batched I/O, group commit, recovery). Nothing here knows the index
or policies; kvtierd.tiering connects the tier to the cache.
"""

from kvtierd.tiers.nvme.device import (
    Device,
    DiskError,
    DiskFull,
    DiskIOError,
    FileSystem,
    SyncFailed,
    UnsafeFile,
)
from kvtierd.tiers.nvme.format import (
    CorruptMeta,
    CorruptSlot,
    SlotHeader,
    StoreMeta,
    decode_header,
    encode_header,
    new_header,
    slot_bytes,
    verify_payload,
)

__all__ = [
    "CorruptMeta", "CorruptSlot", "Device", "DiskError", "DiskFull", "DiskIOError", "FileSystem",
    "SlotHeader", "StoreMeta", "SyncFailed", "UnsafeFile", "decode_header",
    "encode_header", "new_header", "slot_bytes", "verify_payload",
]
