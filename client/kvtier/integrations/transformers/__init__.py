"""kvtier for Hugging Face Transformers: prefix caching for ``generate`` (docs/transformers.md).

``KvtierPrefixCache(address_or_client, model, model_revision=..., tokenizer_digest=...)``
restores the longest stored prefix of a prompt into a ``DynamicCache`` before ``generate`` and
stores the prompt's KV as kvtier blocks after it.

Importing this package has no side effects and imports neither torch nor transformers; the
options and identity (``PrefixCacheOptions``, ``model_namespace``, ``tokenizer_files_digest``,
``ConfigError``, in ``identity``) are plain Python. ``KvtierPrefixCache`` and
``PrefixCacheCounters`` load ``kvtier.integrations.transformers.prefix_cache`` (torch and
transformers) on first access; without transformers installed that access is an ImportError
that says what to install.
"""

from __future__ import annotations

from typing import Any

from kvtier.integrations.transformers.identity import (
    LAYOUT,
    LAYOUT_MLA,
    ConfigError,
    PrefixCacheOptions,
    config_digest,
    model_namespace,
    tokenizer_files_digest,
)

__all__ = [
    "LAYOUT",
    "LAYOUT_MLA",
    "ConfigError",
    "KvtierPrefixCache",
    "PrefixCacheCounters",
    "PrefixCacheOptions",
    "config_digest",
    "model_namespace",
    "tokenizer_files_digest",
]

_LAZY = ("KvtierPrefixCache", "PrefixCacheCounters")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        try:
            from kvtier.integrations.transformers import prefix_cache
        except ModuleNotFoundError as e:
            if e.name not in ("transformers", "torch"):
                raise
            raise ImportError(
                f"kvtier.integrations.transformers.{name} needs {e.name}: pip install 'kvtier[transformers]'"
            ) from e
        return getattr(prefix_cache, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
