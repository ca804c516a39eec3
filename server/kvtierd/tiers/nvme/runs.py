"""Batched block I/O of the NVMe tier: a batch of slots becomes one gathered ``pwritev`` /
``preadv`` per run of slots that follow each other in one block file, then each block is checked
on its own.

Role: the "how" of :meth:`NvmeTier.write_many` / :meth:`NvmeTier.read_many` (slot headers built
and verified here, bytes moved by the ``pwrite`` / ``pread`` the tier passes in, at linear
offsets). Ownership: no state; the header buffers are the call's, the arena slots the caller's.
Concurrency: runs on one of the tier's I/O threads per batch; batches touch disjoint slots.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier_contract.directio import aligned_buffer
from kvtierd.tiers.base import WriteItem
from kvtierd.tiers.nvme import format as fmt
from kvtierd.tiers.nvme.values import NvmeLocation

ReadItem = tuple[NvmeLocation, bytes, bytes, memoryview]  # location, digest, key, arena slot
Transfer = Callable[[int, list[memoryview]], None]  # (linear offset, views): one gathered call


def write_runs(
    items: list[WriteItem], seqs: list[int], *, io_align: int, file_bytes: int, pwrite: Transfer
) -> list[int]:
    """Headers computed here (payload checksums too, unless the item carries its block's
    digest), then one ``pwrite`` per run of adjacent slots. Returns the checksums in item order."""
    a, fb = io_align, file_bytes
    checksums = [0] * len(items)
    headers = aligned_buffer(a * len(items), a)
    order = sorted(range(len(items)), key=lambda i: items[i][0])
    run: list[memoryview] = []
    run_start = run_end = -1
    for i in order:
        offset, digest, key, view, plen, given = items[i]
        region = view[: fmt.round_up(plen, a)]
        h = fmt.new_header(digest, key, region[:plen], sequence=seqs[i], io_align=a, checksum=given)
        hdr = headers[i * a : (i + 1) * a]
        fmt.encode_header_into(h, hdr)
        checksums[i] = h.payload_checksum
        if offset != run_end or offset // fb != run_start // fb:
            if run:
                pwrite(run_start, run)
            run, run_start = [], offset
        run += [hdr, region]
        run_end = offset + fmt.slot_bytes(plen, a)
    if run:
        pwrite(run_start, run)
    return checksums


def read_runs(
    items: list[ReadItem], *, io_align: int, file_bytes: int, pread: Transfer
) -> list[Exception | None]:
    """One ``pread`` per run of adjacent slots into the arena slots, then every block verified:
    per item None or the CorruptSlot that makes it a miss."""
    a, fb = io_align, file_bytes
    headers = aligned_buffer(a * len(items), a)
    regions = [dest[: fmt.round_up(loc.payload_len, a)] for loc, _d, _k, dest in items]
    order = sorted(range(len(items)), key=lambda i: items[i][0].offset)
    run: list[memoryview] = []
    start = end = -1
    for i in order:
        loc = items[i][0]
        if loc.offset != end or loc.offset // fb != start // fb:
            if run:
                pread(start, run)
            run, start = [], loc.offset
        run += [headers[i * a : (i + 1) * a], regions[i]]
        end = loc.offset + loc.slot_bytes
    if run:
        pread(start, run)
    return [_verify(headers[i * a : (i + 1) * a], regions[i], item) for i, item in enumerate(items)]


def _verify(header: memoryview, region: memoryview, item: ReadItem) -> Exception | None:
    loc, digest, key, _dest = item
    try:
        h = fmt.decode_header(
            header, expect_digest=digest, expect_key=key, expect_payload_len=loc.payload_len
        )
        if h.sequence != loc.seq:
            raise fmt.CorruptSlot("wrong_key", f"sequence {h.sequence}, expected {loc.seq}")
        fmt.verify_payload(h, region)
    except fmt.CorruptSlot as e:
        return e
    return None
