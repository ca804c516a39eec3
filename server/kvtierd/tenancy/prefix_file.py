"""Where the published prefixes outlive a restart: ``published-prefixes.json`` in the NVMe tier's
directory (the daemon's one durable directory; ``PREFIXES_NAME`` in
:mod:`kvtierd.tiers.nvme.format`, docs/block_format.md §1).

Format (JSON, UTF-8; written whole, replaced atomically: tmp + fsync + rename + fsync of the
directory, through the tier's disk seam :class:`~kvtierd.tiers.nvme.device.FileSystem`)::

    {"format_version": 1,
     "groups": {"<group>": {"<name>": {"tokens": <1..MAX_PREFIX_TOKENS>, "digest": "<64 hex>"}}}}

Every group and name a name of the tenants file's rule (``kvtierd.tenants_file.NAME_RULE``), at
most ``MAX_PREFIXES_PER_GROUP`` names a group. ``decode`` refuses anything else (``ValueError``):
a file it cannot read is never guessed at.

:class:`PrefixFile` reads it (``load``: None when there is none) and replaces it (``save``:
``Unavailable`` when the disk refuses). It opens the directory for each call and keeps nothing
open. Any thread (the registry writes from the event loop's default executor).
"""

from __future__ import annotations

import errno
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier_contract.errors import Unavailable
from kvtier_contract.prefixes import MAX_PREFIX_TOKENS, MAX_PREFIXES_PER_GROUP, PREFIX_DIGEST_BYTES
from kvtierd.tenants_file import is_name
from kvtierd.tiers.nvme.device import DiskError, FileSystem
from kvtierd.tiers.nvme.format import PREFIXES_NAME

__all__ = ["FORMAT_VERSION", "MAX_FILE_BYTES", "Groups", "Prefix", "PrefixFile", "decode", "encode"]

FORMAT_VERSION = 1
MAX_FILE_BYTES = 1 << 20
"""The most a prefix file may hold (16 prefixes a group at ~150 bytes each: thousands of groups)."""


@dataclass(frozen=True)
class Prefix:
    """What the daemon keeps of one published prefix: its length and digest, never its tokens."""

    tokens: int
    digest: bytes


Groups = Mapping[str, Mapping[str, Prefix]]
"""group -> name -> prefix (never mutated: a change builds a new one)."""


def encode(groups: Groups) -> bytes:
    """The file's bytes for ``groups`` (sorted: equal registries write equal files)."""
    body = {
        g: {n: {"tokens": p.tokens, "digest": p.digest.hex()} for n, p in names.items()}
        for g, names in groups.items()
        if names
    }
    return (json.dumps({"format_version": FORMAT_VERSION, "groups": body}, sort_keys=True) + "\n").encode()


def decode(data: bytes) -> dict[str, dict[str, Prefix]]:
    """The registry a file holds; ValueError naming what is wrong."""
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(raw, dict) or set(raw) != {"format_version", "groups"}:
        raise ValueError("expected exactly the keys format_version and groups")
    if raw["format_version"] != FORMAT_VERSION:
        raise ValueError(f"format_version {raw['format_version']!r} (this daemon reads {FORMAT_VERSION})")
    groups = raw["groups"]
    if not isinstance(groups, dict):
        raise ValueError("groups: expected an object")
    return {g: _names(g, names) for g, names in groups.items()}


def _names(group: str, names: Any) -> dict[str, Prefix]:
    if not is_name(group) or not isinstance(names, dict) or not 0 < len(names) <= MAX_PREFIXES_PER_GROUP:
        raise ValueError(f"group {group!r}: expected a name and 1..{MAX_PREFIXES_PER_GROUP} prefixes")
    return {name: _prefix(group, name, p) for name, p in names.items()}


def _prefix(group: str, name: str, raw: Any) -> Prefix:
    where = f"group {group!r}, prefix {name!r}"
    if not is_name(name) or not isinstance(raw, dict) or set(raw) != {"tokens", "digest"}:
        raise ValueError(f"{where}: expected a name and exactly the keys tokens and digest")
    tokens, digest = raw["tokens"], raw["digest"]
    if type(tokens) is not int or not 0 < tokens <= MAX_PREFIX_TOKENS:
        raise ValueError(f"{where}: tokens must be an integer in 1..{MAX_PREFIX_TOKENS}")
    try:
        value = bytes.fromhex(digest) if isinstance(digest, str) else b""
    except ValueError:
        value = b""
    if len(value) != PREFIX_DIGEST_BYTES:
        raise ValueError(f"{where}: digest must be {2 * PREFIX_DIGEST_BYTES} hex digits")
    return Prefix(tokens, value)


class PrefixFile:
    """``PREFIXES_NAME`` in ``directory`` (see the module docstring). Owns no open file."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    @property
    def path(self) -> str:
        return f"{self.directory.rstrip('/')}/{PREFIXES_NAME}"

    def load(self) -> dict[str, dict[str, Prefix]] | None:
        """The registry the file holds; None when there is no file (nor directory) yet.
        ValueError (a file that is not one), DiskError (the disk refused)."""
        try:
            fs = FileSystem(self.directory)
        except DiskError as e:
            if e.errno == errno.ENOENT:
                return None
            raise
        try:
            data = fs.read_file(PREFIXES_NAME, max_bytes=MAX_FILE_BYTES)
        finally:
            fs.close()
        return None if data is None else decode(data)

    def save(self, groups: Groups) -> None:
        """Replace the file by ``groups``: after a crash, either all of it or the previous
        content. Unavailable naming the file and the cause when the disk refuses."""
        data = encode(groups)
        try:
            fs = FileSystem(self.directory)  # (never made here: the tier makes it)
            try:
                fs.write_file_atomic(PREFIXES_NAME, data)
            finally:
                fs.close()
        except DiskError as e:
            raise Unavailable(f"the published prefixes could not be written to {self.path}: {e}") from None
