"""A router-side KV-event subscriber for tests: rebuilds a daemon's holdings (key -> media) from
its events, filling gaps through the replay endpoint as vLLM's own subscriber example does.

Rules it follows (docs/events.md): the first message it sees, it replays from 0 first (a late
joiner); a seq past the next one it expects is a gap (a lost message, or a daemon restart whose
stream started at a later seq): it replays from the next expected seq and applies what comes
back in order (asking again while an answer, bounded in bytes, stops short); a seq it has
seen is skipped. ``lose`` drops chosen messages on arrival, to make
gaps on purpose.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Follower:
    def __init__(
        self, endpoint: str, replay_endpoint: str | None, lose: Callable[[int], bool] = lambda n: False
    ) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.lose = lose
        self.held: dict[bytes, set[str]] = {}
        self.stored: dict[bytes, dict[str, Any]] = {}  # key -> its last BlockStored (CPU)
        self.next_seq: int | None = None
        self.received = 0  # messages that came on the SUB socket
        self.lost = 0  # of which dropped on purpose
        self.replays = 0
        self.replayed = 0
        self.tenants: set[str | None] = set()
        self.events = 0

    def close(self) -> None:
        self.sub.close(0)
        self.ctx.term()

    # -- applying ---------------------------------------------------------------------------------

    def _apply(self, seq: int, payload: bytes) -> None:
        ts, events, *_ = msgpack.unpackb(payload, raw=False)
        for ev in events:
            self.events += 1
            kind = ev["type"]
            if kind == "AllBlocksCleared":
                self.held.clear()
                continue
            self.tenants.add(ev.get("tenant_id"))
            if kind == "BlockStored":
                for i, k in enumerate(ev["block_hashes"]):
                    self.held.setdefault(k, set()).add(ev["medium"])
                    if ev["medium"] == "CPU":
                        bs = ev["block_size"]
                        self.stored[k] = {
                            **ev,
                            "index": i,
                            "tokens": ev["token_ids"][i * bs : (i + 1) * bs],
                            "parent": ev["parent_block_hash"] if i == 0 else ev["block_hashes"][i - 1],
                        }
            elif kind == "BlockRemoved":
                for k in ev["block_hashes"]:
                    media = self.held.get(k)
                    if media is not None:
                        media.discard(ev["medium"])
                        if not media:
                            del self.held[k]
        self.next_seq = seq + 1

    def _replay(self, start: int) -> list[tuple[int, bytes]]:
        """vLLM's replay protocol: send the start seq, read [topic, seq, payload] until END_SEQ."""
        assert self.replay_endpoint is not None, "a gap, and no replay endpoint"
        self.replays += 1
        sock = self.ctx.socket(zmq.DEALER)
        sock.connect(self.replay_endpoint)
        try:
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            out: list[tuple[int, bytes]] = []
            while True:
                if not sock.poll(5000):
                    raise AssertionError("replay answered no end marker")
                _, _topic, seq, payload = sock.recv_multipart()
                if seq == END_SEQ:
                    return out
                out.append((int.from_bytes(seq, "big"), payload))
        finally:
            sock.close(0)

    def _fill(self, start: int, upto: int) -> None:
        """Replay ``start`` up to ``upto``: an answer is bounded (events_replay_max_bytes), so
        ask again from where it stopped until it is empty or reaches ``upto``."""
        while True:
            answer = self._replay(start)
            for seq, payload in answer:
                if seq < upto and (self.next_seq is None or seq >= self.next_seq):
                    self.replayed += 1
                    self._apply(seq, payload)
            if not answer or answer[-1][0] + 1 >= upto:
                return
            start = answer[-1][0] + 1

    # -- pumping ----------------------------------------------------------------------------------

    def pump(self, timeout_s: float = 0.2) -> int:
        """Take every message that arrives within ``timeout_s`` of the last; how many."""
        n = 0
        while self.sub.poll(int(timeout_s * 1000)):
            _topic, seq_b, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            self.received += 1
            n += 1
            if self.lose(self.received):
                self.lost += 1
                continue
            if self.next_seq is None:
                self._fill(0, seq)  # a late joiner: everything buffered before it
            elif seq > self.next_seq:
                self._fill(self.next_seq, seq)  # a gap (lost, or a restarted daemon's stream)
            if self.next_seq is not None and seq < self.next_seq:
                continue  # seen already
            self._apply(seq, payload)
        return n

    def settle(self, check: Callable[[], bool], timeout_s: float = 30.0) -> None:
        """Pump until ``check()`` holds (the daemon's own work, flushes, may still be going)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.pump(0.1) and self.replay_endpoint:
                # a lost last message leaves no gap to see; a subscriber whose subscription
                # reached the daemon after the stream's last message saw none (vLLM's
                # router-style subscriber asks the replay from 0 then, as here)
                self._fill(0 if self.next_seq is None else self.next_seq, 1 << 64)
            if check():
                return
            if time.monotonic() > deadline:
                raise AssertionError("the holdings never agreed with the daemon")
