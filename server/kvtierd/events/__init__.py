"""KV events: blocks entering and leaving the daemon's tiers, published in vLLM's wire format
(ZMQ PUB + replay ROUTER, msgpack ``KVEventBatch``) for cache-aware routers. docs/events.md.

Parts: :mod:`~kvtierd.events.wire` (the encoding, stated once), :mod:`~kvtierd.events.sink`
(what the cache calls, always present: a no-op while events are off; a bounded queue),
:mod:`~kvtierd.events.publisher` (the thread, the sockets, the replay buffers; needs pyzmq and
msgpack, imported only when events are on).
"""

from kvtierd.events.sink import NO_EVENTS, BlockEvents, EventQueue, EventSink, NoEvents
from kvtierd.events.wire import MEDIUM_CPU, MEDIUM_REMOTE, MEDIUM_STORAGE, Medium

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_REMOTE",
    "MEDIUM_STORAGE",
    "NO_EVENTS",
    "BlockEvents",
    "EventQueue",
    "EventSink",
    "Medium",
    "NoEvents",
]
