"""kvtier for SGLang: a HiCache L3 storage backend, loaded by SGLang's dynamic loader::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang", "class_name": "KvtierHiCacheStorage",
        "interface_v1": 1, "address": "unix:/run/kvtier.sock", "model_revision": "<commit>"}'

Importing this package has no side effects and imports neither SGLang nor torch;
``KvtierHiCacheStorage`` loads ``kvtier.integrations.sglang.backend`` (which subclasses SGLang's
``HiCacheStorage``) on first access, and says so plainly when SGLang is not installed. The
configuration and page keys (``config``) and the host pool's page geometry (``pages``) are plain
Python / torch. See docs/sglang.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BackendCounters", "KvtierHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        try:
            from kvtier.integrations.sglang import backend
        except ModuleNotFoundError as e:
            if e.name is not None and e.name.split(".")[0] == "sglang":
                raise ImportError(
                    "kvtier.integrations.sglang needs SGLang "
                    "(sglang.srt.mem_cache.hicache_storage); see docs/sglang.md"
                ) from e
            raise
        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
