"""The one rule for what may name a model or adapter revision and a tokenizer (docs/hashing.md,
"Revisions and tokenizer digests").

* ``revision_problem(value)``: why ``value`` cannot be a revision (a moving ref, an unset value,
  a placeholder), or None when it can;
* ``tokenizer_digest_problem(value)``: the same for a tokenizer digest;
* ``is_mutable_revision(value)``: whether ``value`` names a ref that moves (or a git expression
  relative to one).

Used by ``kvtier_contract.identity.Namespace`` (so by the SDK and the daemon alike) and by every
engine integration to refuse a setting before it gets there. The rule only refuses values: the
hash of every accepted value is unchanged. Pure functions; thread-safe.
"""

from __future__ import annotations

import re

__all__ = ["MUTABLE_REVISIONS", "is_mutable_revision", "revision_problem", "tokenizer_digest_problem"]

MUTABLE_REVISIONS = frozenset(
    {
        "main",
        "master",
        "head",
        "latest",
        "trunk",
        "develop",
        "dev",
        "default",
        "stable",
        "nightly",
        "@",
        "fetch_head",
        "orig_head",
        "merge_head",
        "cherry_pick_head",
        "revert_head",
        "rebase_head",
    }
)
"""Names that move, in lower case, refused as revisions in any case: branch names (``main``, and
``dev``, which Hub repos use too; ``default``, Mercurial's main branch), channels that are moved
by design even when published as tags (``latest``, ``stable``, ``nightly``), and git's symbolic
refs (``HEAD``, ``@``, ``FETCH_HEAD``...). So is any ``refs/heads/...``, ``refs/remotes/...``,
``origin/...`` or ``upstream/...``, and any git expression: ``~``, ``^`` or ``@{`` cannot occur
in a ref name (git check-ref-format), so ``HEAD~1``, ``v1^`` and ``main@{u}`` name a commit by
its relation to a ref: pin the commit itself."""
_MOVING_PREFIXES = ("refs/heads/", "refs/remotes/", "origin/", "upstream/")
_EXPRESSION = re.compile(r"[~^]|@\{")
_UNSET = frozenset({"none", "null", "nil", "undefined"})  # str() of a value nobody set
_PLACEHOLDER_WORDS = frozenset({"todo", "tbd", "fixme", "changeme", "placeholder", "unknown"})
_ZERO_DIGEST = re.compile(r"(?:[a-z0-9-]+:)*0{7,}")  # 0000000, sha256:000...: no real digest


def is_mutable_revision(value: str) -> bool:
    """Whether ``value`` names a ref that moves (``MUTABLE_REVISIONS``, ``refs/heads/...``) or
    is a git expression relative to one (``HEAD~1``, ``main^``, ``@{u}``)."""
    low = value.strip().lower()
    return low in MUTABLE_REVISIONS or low.startswith(_MOVING_PREFIXES) or _EXPRESSION.search(low) is not None


def _template(value: str) -> bool:
    """Text copied from a template (``<commit>``, ``...``) or a placeholder word."""
    if any(mark in value for mark in ("<", ">", "\u2026", "...")):
        return True
    return value.strip().lower() in _PLACEHOLDER_WORDS


def _zero_digest(value: str) -> bool:
    """Seven or more zeros after optional ``algorithm:`` prefixes: a digest nobody computed.
    (``0``, ``run:0`` and ``2024-05-01T12:00`` are real names.)"""
    return _ZERO_DIGEST.fullmatch(value.strip().lower()) is not None


def revision_problem(value: str) -> str | None:
    """Why ``value`` cannot be a model or adapter revision, or None when it can. A revision
    names fixed weights: a commit hash (or another immutable id: a tag, a files digest, a dated
    snapshot name); never empty, a moving ref (``main``, ``HEAD~1``, ``latest``...), an unset
    value (``"None"``) or a placeholder (``<commit>``, ``0000000``)."""
    text = value.strip()
    if not text:
        return "required (empty): give the immutable revision (a commit hash)"
    if is_mutable_revision(text):
        return (
            f"{value!r} is a moving ref, not an immutable revision: its weights can change "
            "under the same name; pin the commit hash (e.g. the Hub's commit, or `git "
            "rev-parse HEAD`)"
        )
    if text.lower() in _UNSET:
        return f"{value!r} looks like an unset value: give the commit hash"
    if _template(text) or _zero_digest(text):
        return f"{value!r} is a placeholder, not a revision: give the commit hash"
    return None


def tokenizer_digest_problem(value: str) -> str | None:
    """Why ``value`` cannot be a tokenizer digest, or None when it can: the literal ``"none"``
    (the engine takes token ids only) or a digest of the tokenizer files; never an unset value
    in other spelling (``"None"``, ``"null"``) or a placeholder (``sha256:000...``, ``<digest>``,
    an ``algorithm:`` prefix with no digest or only zeros after it)."""
    text = value.strip()
    if text == "none":
        return None
    if text.lower() in _UNSET:
        return (
            f"{value!r} looks like an unset value; write the literal 'none' when the engine "
            "skips the tokenizer, else a digest of its files"
        )
    _, colon, body = text.rpartition(":")
    if _template(text) or _zero_digest(text) or (colon and set(body) <= {"0"}):
        return (
            f"{value!r} is a placeholder, not a digest: two tokenizers would share it; give "
            "a digest of the tokenizer files (or 'none' when the engine skips the tokenizer)"
        )
    return None
