"""The vLLM KV connector: ``KvtierConnector`` (``kv_connector_module_path``:
``kvtier.integrations.vllm``, or this package).

Importing this package has no side effects and does not import vLLM or torch: ``KvtierConnector``,
``KvtierConnectorMetadata`` and ``KvtierConnectorStats`` load the vLLM adapter (``adapter``, with
``metadata``; the only modules here that import vLLM) on first access. The rest is plain Python,
tested without vLLM:

* the scheduler side: ``planner`` (``Planner``, holding its ``Lookups`` (``lookups``, over the
  one thread to the daemon: ``lookup_thread``, ``backend``), ``LoadDecisions``
  (``load_decisions``) and ``StorePlanning`` (``store_planning``), over the request records of
  ``requests``) and its data (``plans``);
* the worker side: ``worker`` (``KvtierWorker``, holding its ``LoadPath`` (``loads``),
  ``StorePath`` (``stores``) and ``StepTiming`` (``step_timing``) over one ``WorkerState``
  (``worker_state``));
* ``config`` (the connector's settings and the engine identity) and ``translate`` (vLLM's
  objects into those, duck-typed).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["KvtierConnector", "KvtierConnectorMetadata", "KvtierConnectorStats"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("kvtier.integrations.vllm.connector.adapter"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
