"""Explainer: why one connection's calls miss or drop, in words naming the fix, noted once.

``note(why, diagnosis)`` keeps the words in ``counters.last_error`` and reports the cause to the
breaker's :class:`kvtier.diagnose.CauseLog` (one WARNING per cause, shared by the breaker's
members), a failure known only by its words (``Method: CODE: details`` from an RPC thread, or
what broke) explained first (``explain_words``); ``sharpen`` makes a diagnosis sure with one
TLS handshake (:func:`kvtier.reach.speaks_tls`) where a TCP port that closed the connection
leaves it a guess.

A part of :class:`kvtier.connection.Connection`, handed the peer, the settings (the probe
deadline), the clock, the counters and the cause log. Owns no state: any thread.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.addresses import tcp_endpoint
from kvtier.calls import MIN_RPC_S
from kvtier.diagnose import CauseLog, Diagnosis, Peer, explain_rpc
from kvtier.reach import speaks_tls
from kvtier.results import ClientCounters
from kvtier.settings import ClientSettings
from kvtier_contract import errors

PROBED = ("plaintext-on-tls", "tls-cert-required", "tls-cert-refused")  # causes a handshake tells


class Explainer:
    """See the module docstring."""

    def __init__(
        self,
        peer: Peer,
        settings: ClientSettings,
        clock: Callable[[], float],
        counters: ClientCounters,
        causes: CauseLog,
    ) -> None:
        self._peer, self._settings, self._clock = peer, settings, clock
        self._counters, self._causes = counters, causes

    def note(self, why: str, diagnosis: Diagnosis | None = None) -> None:
        """Record why calls miss or drop: in ``counters.last_error`` (the diagnosis' words when
        there is one) and, once per cause, in a WARNING (the breaker's ``causes``)."""
        if diagnosis is None:
            diagnosis = explain_words(self._peer, why)
        message = str(diagnosis.error)
        self._counters.last_error = message
        if not diagnosis.transient:  # (the daemon answers now: the next try will say more)
            self._causes.report(
                diagnosis.cause,
                f"{message}; meanwhile lookups miss and puts are dropped (the engine recomputes)",
            )

    def sharpen(self, diagnosis: Diagnosis, deadline: float | None = None) -> Diagnosis:
        """``diagnosis`` made sure where a TLS handshake can tell (a TCP port that closed the
        connection): one handshake to one address of the host, within the probe deadline and
        what is left before ``deadline``. Never on a Unix socket or a gRPC scheme target."""
        endpoint = tcp_endpoint(self._peer.address)
        if diagnosis.cause not in PROBED or diagnosis.rpc is None or endpoint is None:
            return diagnosis
        probe_s = self._settings.probe_s
        left = probe_s if deadline is None else deadline - self._clock()
        if left < MIN_RPC_S:
            return diagnosis
        answers = speaks_tls(*endpoint, min(probe_s, left))
        return explain_rpc(self._peer, *diagnosis.rpc, tls_probe=answers)


def explain_words(peer: Peer, why: str) -> Diagnosis:
    """A failure known only by its words: a failed RPC's (``Method: CODE: details``, from a
    call started on an RPC thread) explained as ``explain_rpc`` does; any other (a transfer
    that broke, no answer in time) has for cause what failed (the words before the colon)."""
    method, _, rest = why.partition(": ")
    code, _, details = rest.partition(": ")
    if code.isupper() and code.replace("_", "").isalpha() and details:
        return explain_rpc(peer, method, code, details)
    what = method.strip() or "call"
    return Diagnosis(f"away-{what}", errors.Unavailable(f"daemon at {peer.address}: {why}"))
