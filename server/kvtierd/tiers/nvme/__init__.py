"""NVMe tier foundation: the disk seam (``device``), the slot and directory format (``format``,
grammar in docs/block_format.md) and the offline checker (``fsck``).

Block files, the journal and recovery build on these; nothing here knows the index or policies.
"""

from kvtierd.tiers.nvme.device import (
    Device,
    DiskError,
    DiskFull,
    DiskIOError,
    FaultyDevice,
    FaultyFileSystem,
    FileSystem,
    SyncFailed,
    UnsafeFile,
    aligned_buffer,
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
    "CorruptMeta", "CorruptSlot", "Device", "DiskError", "DiskFull", "DiskIOError", "FaultyDevice",
    "FaultyFileSystem", "FileSystem", "SlotHeader", "StoreMeta", "SyncFailed", "UnsafeFile",
    "aligned_buffer", "decode_header", "encode_header", "new_header", "slot_bytes", "verify_payload",
]
