"""What proved a session's tenant when it was opened (kvtierd.tenancy.Tenancy.honours reads it
again at every reload). Pure data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Credential:
    """A bearer token of the file (its SHA-256), a Unix peer login (uid, gid), a client
    certificate name, or nothing (the single-tenant daemon)."""

    kind: Literal["token", "unix", "cert", "none"]
    token_sha256: bytes = b""
    uid: int = -1
    gid: int = -1
    name: str = ""


NO_CREDENTIAL = Credential("none")
