"""Block digests: what "bytes verified end to end" compares (docs/security.md).

Every block gets one digest when it is committed: xxh3_64 (seed 0) of its payload bytes, the
same function as the NVMe tier's payload checksum (kvtierd.tiers.nvme.format), so a block's
NVMe header carries its digest unchanged. Computed where the bytes are at the commit: by an shm
client from the bytes it copies into a slot (sent in ``CompleteStoreRequest.digests``),
by the daemon for what it received over tcp, or by the daemon from the slot at CompleteStore
(cuda_ipc, clients that send none, ``verify_store = "daemon"``). Checked by the client on every
``get_into`` (the digests come in ``PrepareLoadReply.digests``).

xxhash releases the GIL while it hashes, so a daemon thread or a client's RPC threads keep
running during a hash of a large block.

Bytes that arrive over tcp are hashed piece by piece as they land (:class:`StreamingDigests`):
by the client for a verified read (kvtier.transports.tcp), by the daemon for a store
(kvtierd.transports.tcp_segments); the digests are the same as hashing each block whole.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

Buffer = memoryview | bytes | bytearray


def block_digest(payload: Buffer) -> int:
    """xxh3_64 (seed 0) of ``payload``: a block's digest (an unsigned 64-bit integer)."""
    return xxhash.xxh3_64_intdigest(payload)


def block_digests(payloads: Sequence[Buffer]) -> list[int]:
    """The digest of each payload (one call: a thread's share of a transfer)."""
    h = xxhash.xxh3_64_intdigest
    return [h(p) for p in payloads]


def mismatches(views: Sequence[Buffer], digests: Sequence[int]) -> list[int]:
    """Positions of ``views`` whose digest differs from ``digests`` (same length)."""
    h = xxhash.xxh3_64_intdigest
    return [i for i, (v, d) in enumerate(zip(views, digests, strict=True)) if h(v) != d]


class StreamingDigests:
    """The digests of blocks laid out back to back in one byte stream that arrives in pieces
    of any size: each piece is hashed as soon as it is fed (while it is still in the CPU's
    cache), and each block's digest equals :func:`block_digest` of the whole block.

    Lifecycle: made for one stream (a frame of blocks, a segment of slots) with every block's
    length (``lengths``; ``wanted[k]`` false: block ``k`` is passed over, never hashed); fed its
    bytes in order, each once (:meth:`feed` a piece, or :meth:`arrived` for a stream received
    into one buffer); then read (``digests``) and dropped. A piece that starts a block and
    holds all of it is hashed in one call; a block that spans pieces goes through xxh3's
    streaming state. ``index`` / ``offset`` is where the next byte goes (the block in
    progress, its bytes fed so far); a block of no bytes is complete once the cursor reaches
    it (from the start, for leading ones), and never reported by ``feed``.

    Owns its xxh3 state and ``digests``; not thread-safe (one receiving thread or one event
    loop feeds it).
    """

    def __init__(self, lengths: Sequence[int], wanted: Sequence[bool] | None = None) -> None:
        assert wanted is None or len(wanted) == len(lengths)
        self.lengths = list(lengths)
        self.wanted = wanted
        self.digests: list[int | None] = [None] * len(self.lengths)  # None: not all in (or not wanted)
        self.index = 0  # the block the next byte belongs to (len(lengths): the stream is done)
        self.offset = 0  # bytes of that block fed so far
        self.fed = 0  # bytes of the stream fed so far
        self._state: xxhash.xxh3_64 | None = None  # xxh3 state of the block in progress, made on first need
        self._skip_empty()

    @classmethod
    def uniform(cls, block_bytes: int, count: int) -> StreamingDigests:
        """``count`` blocks of ``block_bytes`` each, all hashed."""
        return cls([block_bytes] * count)

    @property
    def done(self) -> bool:
        """Every block's bytes are in."""
        return self.index == len(self.lengths)

    def feed(self, piece: Buffer) -> list[tuple[int, int]]:
        """Hash ``piece``, the stream's next bytes (one byte per item): (block index, digest)
        of each wanted block whose last byte it holds, in order."""
        view = piece if isinstance(piece, memoryview) else memoryview(piece)
        out: list[tuple[int, int]] = []
        lengths, wanted = self.lengths, self.wanted
        pos, n = 0, len(view)
        while pos < n:
            assert self.index < len(lengths), "fed past the stream's last block"
            k, size, offset = self.index, lengths[self.index], self.offset
            take = min(size - offset, n - pos)
            last = offset + take == size
            if wanted is None or wanted[k]:
                part = view[pos : pos + take] if take < n else view
                if take == size:  # the whole block in this piece: one call
                    out.append((k, xxhash.xxh3_64_intdigest(part)))
                else:  # part of a block: its streaming state (one, reset as a block starts)
                    state = self._state
                    if state is None:
                        state = self._state = xxhash.xxh3_64()
                    elif offset == 0:
                        state.reset()
                    state.update(part)
                    if last:
                        out.append((k, state.intdigest()))
            pos += take
            if last:
                self.index, self.offset = k + 1, 0
                if k + 1 < len(lengths) and not lengths[k + 1]:
                    self._skip_empty()
            else:
                self.offset = offset + take
        self.fed += n
        for k, d in out:
            self.digests[k] = d
        return out

    def arrived(self, stream: memoryview, upto: int) -> list[tuple[int, int]]:
        """:meth:`feed` what arrived since the last call in ``stream``, a view that holds the
        whole stream from its start and has its first ``upto`` bytes in now."""
        return self.feed(stream[self.fed : upto])

    def _skip_empty(self) -> None:
        """Complete the blocks of no bytes at the cursor."""
        while not self.done and self.lengths[self.index] == 0:
            if self.wanted is None or self.wanted[self.index]:
                self.digests[self.index] = block_digest(b"")
            self.index += 1
