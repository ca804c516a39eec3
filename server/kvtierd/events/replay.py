"""Replay buffers bounded in bytes: each stream's last messages, for the replay endpoint.

Primitives: :class:`ReplayBuffers` (all streams' buffers and their total) makes a
:class:`ReplayBuffer` per stream (``new(cap_bytes)``); ``append(buffer, seq, payload)`` keeps a
message, dropping the oldest ones first (of that stream past its own cap, then of the stream
holding the most past the total) and counting them; ``buffer.since(first, max_bytes,
max_messages)`` is a replay answer, bounded; ``forget(buffer)`` returns a closed stream's bytes.

A message counts its payload plus :data:`ENTRY_OVERHEAD_BYTES` (the Python objects around it),
so that ``held_bytes`` is what the buffers keep alive, not only what they would send.

Ownership: the publisher thread alone (kvtierd.events.publisher); ``held_bytes`` and the counts
may be read from any thread (ints).
"""

from __future__ import annotations

from collections import deque

ENTRY_OVERHEAD_BYTES = 160
"""What one buffered message costs beside its payload: the bytes object's header, the tuple,
the seq int, the deque's slot."""


class ReplayBuffer:
    """One stream's last messages, oldest first: at most ``max_messages`` and ``cap_bytes``
    (but always the last one). Owned by its :class:`ReplayBuffers`; publisher thread only."""

    def __init__(self, cap_bytes: int, max_messages: int) -> None:
        self.cap_bytes = cap_bytes
        self.max_messages = max_messages
        self.held_bytes = 0
        self._items: deque[tuple[int, bytes]] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def since(self, first: int, max_bytes: int, max_messages: int) -> list[tuple[int, bytes]]:
        """The buffered messages with ``seq >= first``, in order, as many as fit in
        ``max_bytes`` of payload and ``max_messages`` (at least one, when there is one)."""
        out: list[tuple[int, bytes]] = []
        size = 0
        for seq, payload in self._items:
            if seq < first:
                continue
            if out and (size + len(payload) > max_bytes or len(out) >= max_messages):
                break
            out.append((seq, payload))
            size += len(payload)
        return out

    def _push(self, seq: int, payload: bytes) -> None:
        self._items.append((seq, payload))
        self.held_bytes += len(payload) + ENTRY_OVERHEAD_BYTES

    def _pop(self) -> int:
        """Drop the oldest message; the bytes it held."""
        _, payload = self._items.popleft()
        n = len(payload) + ENTRY_OVERHEAD_BYTES
        self.held_bytes -= n
        return n

    def _over(self) -> bool:
        return len(self._items) > 1 and (
            self.held_bytes > self.cap_bytes or len(self._items) > self.max_messages
        )


class ReplayBuffers:
    """Every stream's :class:`ReplayBuffer` and their total, at most ``total_cap_bytes``: past
    it, the oldest message of the stream holding the most goes first (a stream that floods
    loses its own history before the others lose theirs). Counts what it dropped.
    Publisher thread only (figures: any thread)."""

    def __init__(self, total_cap_bytes: int) -> None:
        self.total_cap_bytes = total_cap_bytes
        self.held_bytes = 0
        self.dropped_messages = 0
        self.dropped_bytes = 0
        self._buffers: list[ReplayBuffer] = []

    def new(self, cap_bytes: int, max_messages: int) -> ReplayBuffer:
        buf = ReplayBuffer(cap_bytes, max_messages)
        self._buffers.append(buf)
        return buf

    def forget(self, buf: ReplayBuffer) -> None:
        """A stream closed: its bytes are no longer held."""
        self._buffers.remove(buf)
        self.held_bytes -= buf.held_bytes

    def append(self, buf: ReplayBuffer, seq: int, payload: bytes) -> None:
        """Keep ``payload`` as message ``seq`` of ``buf``'s stream, within both caps."""
        before = buf.held_bytes
        buf._push(seq, payload)
        self.held_bytes += buf.held_bytes - before
        while buf._over():
            self._drop(buf)
        while self.held_bytes > self.total_cap_bytes:
            fattest = max(self._buffers, key=lambda b: b.held_bytes)
            if len(fattest) <= 1:  # every stream down to its last message
                break
            self._drop(fattest)

    def _drop(self, buf: ReplayBuffer) -> None:
        n = buf._pop()
        self.held_bytes -= n
        self.dropped_messages += 1
        self.dropped_bytes += n
