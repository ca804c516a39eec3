"""kvtier for vLLM: ``--kv-transfer-config '{"kv_connector": "KvtierConnector",
"kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both", ...}'``.

Importing this package has no side effects and does not import vLLM or torch (vLLM's front-end
process imports it too); ``KvtierConnector`` and ``KvtierConnectorStats`` load
``kvtier.integrations.vllm.connector`` (which imports vLLM) on first access. The planning logic
(``planner``), the engine identity (``config``) and the worker's data movement (``worker``) are
plain Python and tested without vLLM. See docs/vllm.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvtierConnector", "KvtierConnectorMetadata", "KvtierConnectorStats"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvtier.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
