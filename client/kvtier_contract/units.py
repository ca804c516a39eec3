"""Human sizes and durations: ``parse_bytes("1GiB") == 1 << 30``, ``format_bytes(1536) == "1.5 KiB"``."""

from __future__ import annotations

import re
from decimal import Decimal

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1 << 10,
    "kib": 1 << 10,
    "mi": 1 << 20,
    "mib": 1 << 20,
    "gi": 1 << 30,
    "gib": 1 << 30,
    "ti": 1 << 40,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: str | int, *, field: str = "size") -> int:
    """Parse ``"1GiB"``, ``"512 MiB"``, ``"4k"`` or a plain integer into bytes: ``k M G T``
    (``KB MB GB TB``) are powers of 1000 (``"1GB"`` is 10^9 bytes), ``Ki Mi Gi Ti`` (``KiB
    MiB GiB TiB``) powers of 1024 (``"1GiB"`` is 2^30); case-insensitive. Every size the daemon
    takes (its flags, its config file, the tenants file) is read here.

    Raises ValueError naming ``field`` for anything else (negative, unknown unit, fraction of a byte).
    """
    if isinstance(value, bool):
        raise ValueError(f"{field}: expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{field}: must be >= 0, got {value}")
        return value
    m = _SIZE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{field}: cannot parse size {value!r} (examples: 1GiB, 512MiB, 4096)")
    n = Decimal(m.group(1)) * _UNITS[m.group(2).lower()]  # exact: "16.1KB" is 16100 bytes
    if n != int(n):
        raise ValueError(f"{field}: {value!r} is not a whole number of bytes")
    return int(n)


def exact_bytes(n: int) -> str:
    """``n`` as a size that :func:`parse_bytes` reads back exactly, in the largest binary
    unit that divides it: ``exact_bytes(16 << 20) == "16MiB"``, ``exact_bytes(1000) == "1000B"``."""
    for shift, unit in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"


def format_bytes(n: float) -> str:
    """Format a byte count with binary units, e.g. ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
