"""The put workload of the NVMe crash loop: ``python nvme_driver.py ADDRESS ROUND [MAX_BLOCKS]``.

Stores batches of blocks of round ROUND into one namespace until the daemon goes away (or
MAX_BLOCKS are stored; it then only reads), and reports each event on stdout as one flushed line:

    READY               connected and registered: the test may pick its kill moment now
    PUT a b             blocks a .. b-1 are about to be put (in flight from this line on)
    DURABLE j j ...     the daemon reported these blocks durable (``lookup_detail``)
    BAD r j             a get returned other bytes than were put for block j of round r

A block's key and bytes follow from (round, j) (:func:`key`, :func:`block`), so any process can
check any block. Exits 0 when the daemon is gone (a put dropped or a read failed).
"""

from __future__ import annotations

import hashlib
import random
import sys
from collections.abc import Sequence

import kvtier

sys.path.insert(0, __file__.rsplit("/", 3)[0])  # tests/ (tests/integration/<component>/this file)
from conftest import make_namespace  # noqa: E402

NAMESPACE = make_namespace(model_id="test/crash", tokens_per_block=4)  # 4 KiB blocks
BATCH = 8


def key(rnd: int, j: int) -> bytes:
    return hashlib.sha256(b"kvtier crash loop %d/%d" % (rnd, j)).digest()


def block(rnd: int, j: int) -> bytes:
    """The bytes of block j of round ``rnd``: distinct per block, never all zero."""
    return hashlib.shake_256(key(rnd, j)).digest(NAMESPACE.block_bytes)


def say(*words: object) -> None:
    print(*words, flush=True)


def report_durable(ns: kvtier.client.NamespaceHandle, rnd: int, pending: list[int]) -> list[int]:
    """Print the pending blocks the daemon now reports durable; the ones still pending."""
    window = pending[:1024]
    detail = ns.lookup_detail([key(rnd, j) for j in window])
    done = [j for j, d in zip(window[: detail.hits], detail.durable, strict=True) if d]
    if done:
        say("DURABLE", *done)
    finished = set(done)
    return [j for j in pending if j not in finished]


def check(ns: kvtier.client.NamespaceHandle, blocks: Sequence[tuple[int, int]]) -> bool:
    """Read blocks back: absent is fine, other bytes are BAD. False when the daemon is away."""
    got = ns.get([key(r, j) for r, j in blocks])
    for (r, j), g in zip(blocks, got, strict=True):
        if g is not None and bytes(g) != block(r, j):
            say("BAD", r, j)
    return ns.client.counters.gets_failed == 0


def main() -> None:
    address, rnd = sys.argv[1], int(sys.argv[2])
    max_blocks = int(sys.argv[3]) if len(sys.argv) > 3 else 1 << 30
    rng = random.Random(rnd)
    client = kvtier.Client.connect(address, transport="shm", timeout_s=2.0, heartbeat=False)
    ns = client.register(NAMESPACE)
    if not client.connected:
        sys.exit("daemon not reachable")
    say("READY")
    stored, pending = 0, []
    while True:
        if stored < max_blocks:
            ids = list(range(stored, stored + BATCH))
            say("PUT", ids[0], ids[-1] + 1)
            r = ns.put([key(rnd, j) for j in ids], [block(rnd, j) for j in ids])
            if r.dropped or r.stored + r.already_present < len(ids):
                break
            stored += BATCH
            pending += ids
        if pending:
            pending = report_durable(ns, rnd, pending)
        earlier = [(rnd, rng.randrange(stored))] if stored else []
        if rnd:
            earlier.append((rng.randrange(rnd), rng.randrange(64)))
        if not check(ns, earlier):
            break
    client.close()


if __name__ == "__main__":
    main()
