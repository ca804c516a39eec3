"""What the connector's and the secondary tier's settings share, as plain data (no vLLM import).

``ConfigError`` (a setting missing or malformed, naming it), ``settings_from`` (a settings
dataclass from the operator's keys, an unknown key refused by name), ``check_client_fields`` (the
checks both settings run on the daemon's address and credentials) and the identity rules below.
The connector's own settings are ``connector.config``, the tier's ``tier.config``.

Fail-closed: nothing here invents an identity field. A model revision comes from the extra config,
from vLLM's ``--revision`` or from a Hugging Face snapshot directory name (``.../snapshots/<sha>``);
otherwise the connector refuses to start. The tokenizer digest is the SHA-256 of the tokenizer
files, the explicit ``"none"`` when vLLM skips the tokenizer, or the extra config's value.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from kvtier_contract import defaults
from kvtier_contract.identity import is_mutable_revision, tokenizer_digest_problem

DEFAULT_ADDRESS = defaults.ADDRESS
_SNAPSHOT = re.compile(r"/snapshots/([0-9a-f]{40})(/|$)")
_COMMIT = re.compile(r"[0-9a-f]{40}")
# Files whose bytes define a Hugging Face tokenizer (whichever of them exist).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
)
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


class ConfigError(ValueError):
    """A connector setting is missing or malformed; ``field`` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


_S = TypeVar("_S")
Need = Callable[[bool, str, str], None]


def settings_from(cls: type[_S], extra: Mapping[str, Any] | None, prefix: str) -> _S:
    """``cls(**extra)`` of a settings dataclass (the connector's or the tier's), validated:
    ``socket`` is the short form of a Unix ``address``; an unknown key is refused by name
    (``<prefix>.<key>``), as is what the class's ``validate`` refuses."""
    extra = dict(extra or {})
    if "socket" in extra:  # the short form a sidecar uses
        if "address" in extra:
            raise ConfigError(f"{prefix}.socket", "give either socket or address, not both")
        sock = str(extra.pop("socket"))
        extra["address"] = sock if sock.startswith("unix:") else f"unix:{sock}"
    known = set(cls.__dataclass_fields__)  # type: ignore[attr-defined]
    for key in extra:
        if key not in known:
            raise ConfigError(
                f"{prefix}.{key}", f"unknown key; known: {', '.join(sorted(known | {'socket'}))}"
            )
    cfg = cls(**extra)
    cfg.validate()  # type: ignore[attr-defined]
    return cfg


def needs(prefix: str) -> Need:
    """``need(ok, key, message)``: ConfigError ``<prefix>.<key>: message`` unless ``ok``."""

    def need(ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"{prefix}.{key}", message)

    return need


def check_client_fields(
    cfg: Any, need: Need, *, positive: Sequence[str], strings: Sequence[str], flags: Sequence[str]
) -> None:
    """The checks the connector's and the tier's settings share: the address, positive integer
    ``positive``, non-empty-or-absent ``strings``, boolean ``flags``, the tokenizer digest rule,
    and a Unix login (a Unix address, no token file)."""
    need(isinstance(cfg.address, str) and bool(cfg.address), "address", "must be a non-empty string")
    for key in positive:
        value = getattr(cfg, key)
        need(
            isinstance(value, int) and not isinstance(value, bool) and value > 0,
            key,
            "must be a positive integer",
        )
    for key in strings:
        value = getattr(cfg, key)
        need(value is None or (isinstance(value, str) and bool(value)), key, "must be a non-empty string")
    problem = tokenizer_digest_problem(cfg.tokenizer_digest) if cfg.tokenizer_digest else None
    need(problem is None, "tokenizer_digest", str(problem))
    for key in flags:
        need(isinstance(getattr(cfg, key), bool), key, "must be true or false")
    need(not (cfg.unix_login and cfg.token_file), "unix_login", "give token_file or unix_login, not both")
    need(
        not cfg.unix_login or cfg.address.startswith("unix:"),
        "unix_login",
        "needs a Unix socket address (socket or unix: address)",
    )


def resolve_model_revision(configured: str | None, engine_revision: str | None, model_path: str) -> str:
    """The model's immutable revision: the extra config's, the commit vLLM resolved its
    ``--revision`` to (``engine_revision.resolved`` where vLLM provides it), an explicit
    ``--revision`` other than a branch default, or the commit of a Hugging Face snapshot
    directory. Anything else is a ``ConfigError`` (no silent default; vLLM reports ``"main"`` for
    a hub model served without ``--revision``, which names no fixed weights)."""
    if configured:
        return configured
    resolved = getattr(engine_revision, "resolved", None)
    if isinstance(resolved, str) and _COMMIT.fullmatch(resolved):
        return resolved
    if engine_revision and not is_mutable_revision(str(engine_revision)):
        return str(engine_revision)
    m = _SNAPSHOT.search(os.path.abspath(model_path) + "/")
    if m:
        return m.group(1)
    raise ConfigError(
        "kv_connector_extra_config.model_revision",
        f"required: the model {model_path!r} is not a Hugging Face snapshot and vLLM was given no "
        "--revision; set the model's immutable revision (e.g. its commit hash)",
    )


def files_digest(directory: str | os.PathLike[str], names: tuple[str, ...]) -> str | None:
    """``sha256:<hex>`` over (name, length, bytes) of those of ``names`` that exist in
    ``directory``, in the given order; None when none exists."""
    h = hashlib.sha256(b"kvtier/files/v1")
    found = False
    base = Path(directory)
    for name in names:
        path = base / name
        if not path.is_file():
            continue
        found = True
        data = path.read_bytes()
        h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little"))
        h.update(data)
    return f"sha256:{h.hexdigest()}" if found else None


def resolve_tokenizer_digest(
    configured: str | None, skipped: bool, tokenizer_path: str, hub_revision: str | None = None
) -> str:
    """``"none"`` when the engine runs without a tokenizer (token ids in, token ids out), the
    configured digest, the digest of the tokenizer files in a local directory, or, for a hub id
    at a commit, ``hf:<id>@<commit>`` (the files at a commit never change); else ``ConfigError``."""
    if configured:
        return configured
    if skipped:
        return "none"
    if os.path.isdir(tokenizer_path):
        digest = files_digest(tokenizer_path, TOKENIZER_FILES)
        if digest is not None:
            return digest
    elif hub_revision and _COMMIT.fullmatch(hub_revision):
        return f"hf:{tokenizer_path}@{hub_revision}"
    raise ConfigError(
        "kv_connector_extra_config.tokenizer_digest",
        f"required: no tokenizer files found in {tokenizer_path!r} and no commit to name them by",
    )
