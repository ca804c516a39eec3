"""kvtier_contract.units: human sizes in, human sizes out."""

from __future__ import annotations

import pytest

from kvtier_contract.units import format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("4096", 4096),
        (4096, 4096),
        ("1GiB", 1 << 30),
        ("1 GiB", 1 << 30),
        ("  512MiB ", 512 << 20),
        ("1gib", 1 << 30),
        ("1Gi", 1 << 30),
        ("4k", 4000),
        ("4KB", 4000),
        ("4KiB", 4096),
        ("2T", 2 * 10**12),
        ("1TiB", 1 << 40),
        ("1.5KiB", 1536),
        ("0.5GiB", 1 << 29),
        ("7b", 7),
        ("1500000000.0", 1_500_000_000),
        (1_500_000_000.0, 1_500_000_000),  # a float from a JSON file
    ],
)
def test_parse_bytes(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["16.1KB", "4.1MB", "32.7MB"])
def test_parse_bytes_is_exact_for_decimal_fractions(text: str) -> None:
    assert parse_bytes(text) == round(float(text[:-2]) * 1000 ** (1 + "KMG".index(text[-2])))


@pytest.mark.parametrize(
    "value", ["", "GiB", "-1", "-1GiB", "1 GiBs", "1XB", "1e9", "0.1KiB", "1.5", "ten", True, False, -1, 1.5]
)
def test_parse_bytes_rejects_naming_the_field(value: object) -> None:
    with pytest.raises(ValueError) as exc:
        parse_bytes(value, field="host_bytes")  # type: ignore[arg-type]
    assert str(exc.value).startswith("host_bytes: "), str(exc.value)


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (64 << 20, "64.0 MiB"),
        ((1 << 30) + (1 << 29), "1.5 GiB"),
        (1 << 40, "1.0 TiB"),
        (1 << 50, "1024.0 TiB"),  # TiB is the largest unit
        (-2048, "-2.0 KiB"),
    ],
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


@pytest.mark.parametrize("n", [0, 4096, 1536, 64 << 20, 3 << 30])
def test_format_then_parse_round_trips_whole_units(n: int) -> None:
    assert parse_bytes(format_bytes(n).replace(" ", "")) == n


@pytest.mark.parametrize(
    ("n", "text"),
    [(16 << 20, "16MiB"), (1 << 30, "1GiB"), (3 << 40, "3TiB"), (1000, "1000B"), (1536, "1536B")],
)
def test_exact_bytes_reads_back_exactly(n: int, text: str) -> None:
    from kvtier_contract.units import exact_bytes

    assert exact_bytes(n) == text and parse_bytes(text) == n


def test_decimal_and_binary_units_differ_as_documented() -> None:
    """``1gb`` is 10^9 bytes (issue 39: with 64 MiB slabs, a host tier of 896 MiB, now warned at
    start: tests/unit/kvtierd/app/test_start_warnings.py); ``1GiB`` is 2^30."""
    assert parse_bytes("1gb") == parse_bytes("1GB") == parse_bytes("1G") == 10**9
    assert parse_bytes("1gib") == parse_bytes("1Gi") == 1 << 30
