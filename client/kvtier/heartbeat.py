"""The heartbeat of one session, and the HeartbeatRequest that carries its local lookups' tallies.

Every period, even while other calls keep the lease alive, the heartbeat thread makes one
Heartbeat call: the replies bring the daemon's tier figures (``Session.tier_figures``), which a
busy engine needs most, and each request carries the tallies of the lookups answered from the
published index (:class:`kvtier.local_index.LocalIndexes`) since the last one, for the daemon's
Stats. A heartbeat that fails is dropped, not sent again: an unanswered one may have been
applied, and a lookup left uncounted is better than one counted twice.

Lifecycle: ``Heartbeat(...)`` -> ``start()`` -> ``stop()`` (the thread ends at its next wake-up;
a daemon thread, never joined). Owned by a :class:`kvtier.session.Session`; its thread makes the
session's calls, ``stop`` is called from any thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from kvtier.calls import Away
from kvtier.local_index import LocalIndexes, Tally
from kvtier_contract import errors
from kvtier_contract.v1 import kvtier_pb2 as pb


def tally_request(local: LocalIndexes | None, tallies: dict[int, Tally] | None = None) -> Any:
    """A HeartbeatRequest carrying ``tallies`` (default: take ``local``'s pending ones)."""
    if tallies is None:
        tallies = local.take_tallies() if local is not None else {}
    return pb.HeartbeatRequest(
        local_lookups=[
            pb.LookupTally(
                namespace_id=ns,
                lookups=t.lookups,
                blocks_requested=t.blocks_requested,
                blocks_hit=t.blocks_hit,
            )
            for ns, t in tallies.items()
        ]
    )


class Heartbeat:
    """See the module docstring. ``call``: the session's ``call``; ``request``: the next
    request (its tallies taken); ``period_s``: the wait before each beat (read each time)."""

    def __init__(
        self, call: Callable[[str, Any], Any], request: Callable[[], Any], period_s: Callable[[], float]
    ) -> None:
        self._call, self._request, self._period_s = call, request, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="kvtier-heartbeat")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self._period_s()):
            request = self._request()
            try:
                self._call("Heartbeat", request)
            except (Away, errors.KvtierError):
                pass  # dropped, not sent again (see the module docstring)
