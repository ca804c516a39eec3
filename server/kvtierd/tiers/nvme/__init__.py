"""NVMe tier: the disk seam (``device``, its typed ``errors``, its scatter/gather ``buffers``),
the slot and directory format (``format``, grammar in docs/block_format.md), the offline checker
(``fsck``), the index log (``journal``: writer, checkpoints and the group commit; ``records``:
its frame grammar; ``replay``: recovery) and the tier itself (``tier``: ``NvmeTier``, holding its
parts: ``files``, the open block files and the batched I/O on them; ``startup``, one opening and
recovery, handed over; the journal's group commit; with ``values``: config, locations, figures).
Nothing here knows the index or policies; the cache's chain link (kvtierd.cache.chain.TierLink)
connects the tier to it.
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
    "CorruptMeta",
    "CorruptSlot",
    "Device",
    "DiskError",
    "DiskFull",
    "DiskIOError",
    "FileSystem",
    "SlotHeader",
    "StoreMeta",
    "SyncFailed",
    "UnsafeFile",
    "decode_header",
    "encode_header",
    "new_header",
    "slot_bytes",
    "verify_payload",
]
