"""Slot format: header round trips, every way a header or payload goes bad, the meta file.

Slots are tiny: a 5-byte or 6000-byte payload behind a 4 KiB (or 16 KiB) header region. A "disk"
here is a bytearray; the device tests and fsck tests put the same bytes in real files.
"""

from __future__ import annotations

import pytest

from kvtierd.tiers.nvme.format import (
    HEADER,
    MAGIC,
    CorruptMeta,
    CorruptSlot,
    SlotHeader,
    StoreMeta,
    data_file_name,
    decode_header,
    encode_header,
    encode_header_into,
    new_header,
    parse_data_file_name,
    payload_checksum,
    slot_bytes,
    verify_payload,
)

NS = bytes(range(32))
OTHER_NS = bytes(32)
KEY = b"\xaa" * 32
PAYLOAD = bytes(i * 7 % 251 for i in range(6000))  # two 4 KiB blocks of payload region


def header(io_align: int = 4096, payload: bytes = PAYLOAD, sequence: int = 1) -> SlotHeader:
    return new_header(NS, KEY, payload, sequence=sequence, io_align=io_align, written_at_ns=123)


def slot(io_align: int = 4096, payload: bytes = PAYLOAD) -> bytearray:
    """One whole slot as it lies on disk: header region, payload, zero padding."""
    h = header(io_align, payload)
    buf = bytearray(h.slot_bytes)
    buf[:io_align] = encode_header(h)
    buf[io_align : io_align + len(payload)] = payload
    return buf


def reason(region: bytes | bytearray, **expect: object) -> str:
    with pytest.raises(CorruptSlot) as info:
        decode_header(region, **expect)  # type: ignore[arg-type]
    return info.value.reason


# -- layout -----------------------------------------------------------------------------------------


def test_slot_is_one_header_region_then_the_payload_rounded_up() -> None:
    assert HEADER.size == 128
    assert slot_bytes(1, 4096) == 4096 + 4096
    assert slot_bytes(4096, 4096) == 2 * 4096
    assert slot_bytes(4097, 4096) == 3 * 4096
    assert slot_bytes(6000, 16384) == 2 * 16384
    assert slot_bytes(114_688, 4096) == 4096 + 114_688  # Qwen3-0.6B block: already aligned


def test_golden_header_bytes() -> None:
    # The worked example of docs/block_format.md: a 5-byte payload "hello", sequence 7.
    h = new_header(NS, KEY, b"hello", sequence=7, io_align=4096, written_at_ns=1_700_000_000_000_000_000)
    region = encode_header(h)
    assert h.payload_checksum == 0x9555E8555C62DCFD
    assert region[:128].hex() == (
        "4b5654424c4b303101000000800000000010000000000000000102030405060708090a0b0c0d0e0f"
        "101112131415161718191a1b1c1d1e1f" + "aa" * 32 + "0500000000000000fddc625c55e85595"
        "070000000000000000002a36fe9c9717a1bca54502f76bf7"
    )
    assert region[128:] == bytes(4096 - 128)


@pytest.mark.parametrize("io_align", [512, 4096, 16384])
def test_round_trip(io_align: int) -> None:
    h = header(io_align)
    region = encode_header(h)
    assert len(region) == io_align and region.startswith(MAGIC)
    assert (
        decode_header(
            region, expect_digest=NS, expect_key=KEY, expect_payload_len=6000, available_bytes=h.slot_bytes
        )
        == h
    )
    buf = slot(io_align)
    verify_payload(h, buf[io_align:])  # the padded payload region verifies as well
    verify_payload(h, PAYLOAD)


def test_encode_into_an_aligned_staging_buffer_clears_old_bytes() -> None:
    h = header()
    region = memoryview(bytearray(b"\xff" * 4096))  # a reused staging buffer
    encode_header_into(h, region)
    assert bytes(region) == encode_header(h)


# -- header corruption ------------------------------------------------------------------------------


def test_all_zero_region_is_an_empty_slot() -> None:
    assert reason(bytes(4096)) == "zero"


@pytest.mark.parametrize("io_align", [4096, 16384])
@pytest.mark.parametrize("position", [0, 7, 8, 12, 16, 24, 56, 88, 96, 104, 112, 120, 127])
def test_any_flipped_header_byte_is_detected(io_align: int, position: int) -> None:
    region = bytearray(encode_header(header(io_align)))
    region[position] ^= 0x01
    expected = {0: "bad_magic", 7: "bad_magic", 8: "bad_version"}.get(position, "bad_header_checksum")
    assert reason(region) == expected


def test_flipped_byte_in_the_padding_is_detected() -> None:
    region = bytearray(encode_header(header()))
    region[3000] = 0x40
    assert reason(region) == "bad_padding"


def test_bad_magic_and_stale_payload_bytes() -> None:
    region = bytearray(encode_header(header()))
    region[:8] = b"KVTBLK02"
    assert reason(region) == "bad_magic"
    assert reason(PAYLOAD[:4096]) == "bad_magic"  # the middle of some payload: not a header


def test_torn_header_over_old_payload_bytes() -> None:
    # The region held payload bytes of an earlier slot; the new header write stopped after the
    # first 512-byte sector: the 128 header bytes are whole, the rest is old data.
    region = bytearray(PAYLOAD[:4096])
    region[:512] = encode_header(header())[:512]
    assert reason(region) == "bad_padding"


def test_torn_header_inside_its_first_bytes() -> None:
    region = bytearray(4096)
    region[:64] = encode_header(header())[:64]  # only half of the 128 header bytes arrived
    assert reason(region) == "bad_header_checksum"


def test_torn_header_over_zeros_is_whole_and_the_payload_check_catches_the_slot() -> None:
    # A fresh file: a header torn after 512 bytes is complete (its padding is zero anyway), but
    # the payload never arrived, so the slot as a whole is still refused.
    disk = bytearray(slot_bytes(6000))
    disk[:512] = encode_header(header())[:512]
    h = decode_header(disk[:4096])
    with pytest.raises(CorruptSlot) as info:
        verify_payload(h, disk[4096:])
    assert info.value.reason == "bad_payload_checksum"


def test_unknown_version_is_refused_before_its_checksum() -> None:
    region = bytearray(encode_header(header()))
    region[8] = 2
    assert reason(region) == "bad_version"


def test_header_read_at_the_wrong_alignment_is_refused() -> None:
    region16 = encode_header(header(16384))
    # Read as a 4 KiB region: the header bytes are whole, but io_align says 16 KiB.
    assert reason(region16[:4096]) == "bad_layout"


def test_wrong_namespace_and_wrong_key() -> None:
    region = encode_header(header())
    assert reason(region, expect_digest=OTHER_NS) == "wrong_namespace"
    assert reason(region, expect_digest=NS, expect_key=b"\xbb" * 32) == "wrong_key"


def test_payload_length_beyond_the_slot_or_file() -> None:
    h = header()  # slot of 3 blocks: header + 2 payload blocks
    region = encode_header(h)
    assert reason(region, available_bytes=h.slot_bytes - 4096) == "bad_length"
    assert decode_header(region, available_bytes=h.slot_bytes) == h
    assert reason(region, expect_payload_len=4096) == "bad_length"
    # A header claiming a payload longer than the bytes handed to verify_payload.
    with pytest.raises(CorruptSlot) as info:
        verify_payload(h, PAYLOAD[:5999])
    assert info.value.reason == "bad_length"


# -- payload corruption -----------------------------------------------------------------------------


@pytest.mark.parametrize("position", [0, 1, 4095, 4096, 5999])
def test_flipped_payload_byte(position: int) -> None:
    h = header()
    payload = bytearray(PAYLOAD)
    payload[position] ^= 0x80
    with pytest.raises(CorruptSlot) as info:
        verify_payload(h, payload)
    assert info.value.reason == "bad_payload_checksum"


def test_torn_payload_half_written() -> None:
    h = header()
    disk = bytearray(PAYLOAD[::-1])  # an older slot's bytes
    disk[:3000] = PAYLOAD[:3000]  # the write stopped half way
    with pytest.raises(CorruptSlot) as info:
        verify_payload(h, disk)
    assert info.value.reason == "bad_payload_checksum"
    assert payload_checksum(memoryview(disk)) != h.payload_checksum


# -- directory layout -------------------------------------------------------------------------------


def test_data_file_names() -> None:
    assert data_file_name(0) == "blocks-00000.kvt"
    assert data_file_name(42) == "blocks-00042.kvt"
    assert parse_data_file_name("blocks-00042.kvt") == 42
    for other in ("blocks-42.kvt", "blocks-00042.kvt.tmp", "xblocks-00042.kvt", "kvtier.meta"):
        assert parse_data_file_name(other) is None


def test_meta_round_trip_and_refusals() -> None:
    meta = StoreMeta(io_align=16384, file_bytes=16 * 16384, files=3, created_ns=5)
    assert StoreMeta.decode(meta.encode()) == meta
    bad = [
        b"not json",
        b'{"io_align": 4096}',  # keys missing
        meta.encode().replace(b'"files": 3', b'"files": true'),  # a bool is not a count
        meta.encode().replace(b'"format_version": 1', b'"format_version": 2'),
        meta.encode().replace(b'"io_align": 16384', b'"io_align": 3000'),
        meta.encode().replace(b'"file_bytes": 262144', b'"file_bytes": 262145'),
    ]
    for data in bad:
        with pytest.raises(CorruptMeta):
            StoreMeta.decode(data)
