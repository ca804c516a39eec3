"""The fleet key: who may write a value the cluster tier serves (docs/cluster.md, docs/security.md).

The daemons of one fleet share a secret, the *fleet key* (``cluster_fleet_key_file``: hex, at
least 32 bytes, e.g. ``openssl rand -hex 32``). Every value they write carries a MAC under a
*realm* key derived from it, and a value whose MAC does not verify is never served
(kvtierd.tiers.cluster.format). A realm is one tenant of a daemon with a tenants file, one
group of tenants of such a daemon (docs/security.md § Groups: its publishers write, its members
read; under its own key, so a group never shares a realm with a tenant of the same name in
another daemon's file), or, for daemons without one, the trust domain their ``cluster_realm``
names (whatever ``tenant`` their clients put in their namespaces: such a daemon has no
credential that says who they are, so its values never pass for a tenant's, and every engine
that reaches one daemon of a realm can plant values that every daemon of that realm serves: one
realm per trust domain, e.g. per Deployment)::

    realm key = BLAKE2b-256(key = fleet key, data = "kvtier/fleet/tenant/v1\\0" + tenant name)
              = BLAKE2b-256(key = fleet key, data = "kvtier/fleet/group/v1\\0" + group name)
              = BLAKE2b-256(key = fleet key, data = "kvtier/fleet/untenanted/v2\\0" + cluster_realm)
    realm tag = hex(BLAKE2b-64(key = realm key, data = "kvtier/fleet/tag/v1"))     (16 hex)

Redis keys start with ``kvt2:<realm tag>:``: an operator can give each tenant's traffic a Redis
ACL key pattern (``~kvt2:<tag>:*``), and the tag, derived from the key, names no tenant and
cannot be guessed without the fleet key. ``python -m kvtierd.tiers.cluster.keys FILE TENANT``
(or ``FILE --group GROUP``, ``FILE --realm CLUSTER_REALM``) prints a realm's pattern.

The key is never logged: :class:`FleetKeys` and :class:`Realm` leave it out of their ``repr``.
Pure functions and immutable objects (the realm cache is a dict filled on first use, from the
cluster tier's thread and the daemon's loop: a race computes the same value twice); stdlib only,
so the config can validate the file without redis-py.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass, field
from pathlib import Path

FIELD = "cluster_fleet_key_file"
REALM_FIELD = "cluster_realm"
MAX_REALM_CHARS = 128
MIN_KEY_BYTES = 32
MAC_BYTES = 32
TAG_PREFIX = b"kvt2:"
_TENANT_DOMAIN = b"kvtier/fleet/tenant/v1\0"
_GROUP_DOMAIN = b"kvtier/fleet/group/v1\0"
_UNTENANTED_DOMAIN = b"kvtier/fleet/untenanted/v2\0"
_TAG_DOMAIN = b"kvtier/fleet/tag/v1"


def read_fleet_key(path: str | Path) -> bytes:
    """The fleet key in ``path`` (hex digits, whitespace ignored, at least 32 bytes); a
    ValueError naming ``cluster_fleet_key_file`` (never quoting the file's content) otherwise."""
    if not str(path):
        raise ValueError(
            f"{FIELD}: required with cluster (a file holding the fleet key the "
            f"daemons of one fleet share, hex: openssl rand -hex 32 > FILE; "
            f"docs/cluster.md)"
        )
    try:
        text = Path(path).read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not ASCII hex"
        raise ValueError(f"{FIELD}: cannot read {str(path)!r}: {why}") from None
    try:
        key = bytes.fromhex("".join(text.split()))
    except ValueError:
        raise ValueError(
            f"{FIELD}: {str(path)!r} must hold the key as hex digits (openssl rand -hex 32)"
        ) from None
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(
            f"{FIELD}: {str(path)!r} holds {len(key)} bytes of key; at least "
            f"{MIN_KEY_BYTES} are needed (openssl rand -hex 32)"
        )
    return key


def check_realm_name(name: str) -> str:
    """``name`` if it is a valid ``cluster_realm`` (1 to 128 letters, digits, ``.``, ``_``, ``-``,
    starting with a letter or digit); a ValueError naming ``cluster_realm`` otherwise."""
    ok = 0 < len(name) <= MAX_REALM_CHARS and name[0].isascii() and name[0].isalnum()
    if not ok or not all(c.isascii() and (c.isalnum() or c in "._-") for c in name):
        raise ValueError(
            f"{REALM_FIELD}: expected 1 to {MAX_REALM_CHARS} letters, digits, '.', '_' or '-' "
            f"(a name for this deployment's trust domain, e.g. its namespace and name), got {name!r}"
        )
    return name


@dataclass(frozen=True)
class Realm:
    """Whose values a Redis key holds: the MAC key and the key prefix of one tenant (or of the
    untenanted daemons of one ``cluster_realm``) under one fleet key."""

    name: str | None
    """The tenant or the group, or None (untenanted)."""
    mac_key: bytes = field(repr=False)
    """The 32-byte BLAKE2b key of this realm's MACs."""
    prefix: bytes = b""
    """``kvt2:<tag>:``, the start of every Redis key of this realm."""
    cluster_realm: str = ""
    """Untenanted: the ``cluster_realm`` of its daemons ("" for a tenant's or a group's realm)."""
    group: bool = False
    """``name`` is a group of tenants."""

    @property
    def acl_pattern(self) -> str:
        """The Redis ACL key pattern covering this realm's keys."""
        return f"~{self.prefix.decode()}*"


class FleetKeys:
    """The fleet key and the realms derived from it (see the module docstring)."""

    def __init__(self, fleet_key: bytes) -> None:
        if len(fleet_key) < MIN_KEY_BYTES:
            raise ValueError(f"{FIELD}: a fleet key needs at least {MIN_KEY_BYTES} bytes")
        # BLAKE2b takes keys of at most 64 bytes: a longer one is hashed down first
        self._root = fleet_key if len(fleet_key) <= 64 else hashlib.blake2b(fleet_key).digest()
        self._realms: dict[tuple[str, str], Realm] = {}

    def __repr__(self) -> str:
        return f"FleetKeys(<{len(self._realms)} realms>)"

    def realm(self, tenant: str) -> Realm:
        """The realm of ``tenant`` (a daemon with a tenants file)."""
        r = self._realms.get(("tenant", tenant))
        if r is None:
            mac_key, prefix = self._derive(_TENANT_DOMAIN + tenant.encode())
            r = self._realms["tenant", tenant] = Realm(tenant, mac_key, prefix)
        return r

    def group(self, group: str) -> Realm:
        """The realm of group ``group`` of tenants (a daemon with a tenants file)."""
        r = self._realms.get(("group", group))
        if r is None:
            mac_key, prefix = self._derive(_GROUP_DOMAIN + group.encode())
            r = self._realms["group", group] = Realm(group, mac_key, prefix, group=True)
        return r

    def untenanted(self, cluster_realm: str) -> Realm:
        """The realm of the daemons without tenants whose ``cluster_realm`` is this (checked:
        ValueError naming it)."""
        r = self._realms.get(("untenanted", cluster_realm))
        if r is None:
            mac_key, prefix = self._derive(_UNTENANTED_DOMAIN + check_realm_name(cluster_realm).encode())
            r = self._realms["untenanted", cluster_realm] = Realm(None, mac_key, prefix, cluster_realm)
        return r

    def _derive(self, data: bytes) -> tuple[bytes, bytes]:
        """(realm key, key prefix) of the realm ``data`` names."""
        mac_key = hashlib.blake2b(data, key=self._root, digest_size=32).digest()
        tag = hashlib.blake2b(_TAG_DOMAIN, key=mac_key, digest_size=8).hexdigest()
        return mac_key, TAG_PREFIX + tag.encode() + b":"


def main(argv: list[str] | None = None) -> int:
    """Print the Redis ACL key pattern of a tenant's realm, of a group's (``--group NAME``), or
    (``--realm NAME``) of the untenanted daemons of ``cluster_realm`` NAME."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3) or (len(args) == 3) != (args[1] in ("--realm", "--group")):
        print(
            "usage: python -m kvtierd.tiers.cluster.keys FLEET_KEY_FILE "
            "(TENANT | --group GROUP | --realm CLUSTER_REALM)",
            file=sys.stderr,
        )
        return 2
    try:
        keys = FleetKeys(read_fleet_key(args[0]))
        if len(args) == 2:
            realm = keys.realm(args[1])
        else:
            realm = keys.group(args[2]) if args[1] == "--group" else keys.untenanted(args[2])
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    print(realm.acl_pattern)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
