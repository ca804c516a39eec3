"""Block digests (docs/hashing.md §6): XXH3_64, seed 0, the NVMe payload checksum too."""

from __future__ import annotations

from kvtier_contract.digests import block_digest, mismatches
from kvtierd.tiers.nvme.format import payload_checksum


def test_golden_vectors() -> None:
    assert block_digest(b"") == 0x2D06800538D394C2
    assert block_digest(b"hello") == 0x9555E8555C62DCFD
    assert block_digest(bytes(16384)) == 0xB7CE04B81707A4D0


def test_the_block_digest_is_the_nvme_payload_checksum() -> None:
    for payload in (b"", b"hello", bytes(range(256)) * 64):
        assert block_digest(memoryview(payload)) == payload_checksum(payload)


def test_mismatches_names_the_positions_that_differ() -> None:
    views = [b"a", b"b", b"c"]
    digests = [block_digest(b"a"), block_digest(b"x"), block_digest(b"c")]
    assert mismatches(views, digests) == [1]
