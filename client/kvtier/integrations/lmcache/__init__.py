"""kvtier as an L2 adapter of LMCache's multi-process server (lmcache==0.5.6)::

    lmcache server --l2-adapter '{"type": "plugin", "module_path": "kvtier.integrations.lmcache",
        "class_name": "KvtierL2Adapter", "adapter_params": {...}}'

Importing this package has no side effects and does not import LMCache or torch;
``KvtierL2Adapter`` loads ``kvtier.integrations.lmcache.adapter`` (which imports LMCache) on
first access. The settings and identities (``config``), the key mapping (``keys``) and the lock
bookkeeping (``locks``) are plain Python. See docs/lmcache.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvtierL2Adapter"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        try:
            from kvtier.integrations.lmcache import adapter
        except ImportError as e:
            if e.name is not None and e.name.split(".")[0] in ("lmcache", "torch"):
                raise ImportError(
                    f"kvtier.integrations.lmcache.{name} needs LMCache (pip install lmcache==0.5.6): {e}",
                    name=e.name,
                ) from e
            raise
        return getattr(adapter, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
