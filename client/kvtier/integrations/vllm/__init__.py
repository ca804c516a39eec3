"""kvtier for vLLM, two ways in (docs/vllm.md says when to pick which):

* the connector: ``--kv-transfer-config '{"kv_connector": "KvtierConnector",
  "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both", ...}'``;
* a secondary tier of vLLM's native offloading: ``"kv_connector": "OffloadingConnector"`` with
  ``"spec_name": "TieringOffloadingSpec"`` and a ``secondary_tiers`` entry
  ``{"type": "KvtierSecondaryTier", "module_path": "kvtier.integrations.vllm", ...}``.

Importing this package has no side effects and does not import vLLM or torch (vLLM's front-end
process imports it too); ``KvtierConnector``, ``KvtierConnectorMetadata`` and
``KvtierConnectorStats`` load the connector (``connector/``) on first access,
``KvtierSecondaryTier`` the tier (``tier/``). The two products share only engine-free parts at
this level: ``config`` (``ConfigError``, the settings checks, the revision and tokenizer rules)
and ``breaker`` (one circuit breaker per daemon for every client of the process).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["KvtierConnector", "KvtierConnectorMetadata", "KvtierConnectorStats", "KvtierSecondaryTier"]
_MODULES = {"KvtierSecondaryTier": "tier"}


def __getattr__(name: str) -> Any:
    if name in __all__:
        module = importlib.import_module(f"kvtier.integrations.vllm.{_MODULES.get(name, 'connector')}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
