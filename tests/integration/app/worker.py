"""A client process for integration tests: ``python worker.py ROLE TRANSPORT ADDRESS SEED N``.

Roles: ``put`` stores N blocks of a seeded token sequence and prints a JSON result; ``get`` loads
them and prints whether every byte matches; ``reserve`` prepares a store, writes half a block
into shm, prints ``RESERVED`` and then waits to be killed (a client dying mid-store).
"""

from __future__ import annotations

import hashlib
import json
import signal
import sys

import numpy as np

import kvtier
from kvtier_contract.v1 import kvtier_pb2 as pb

sys.path.insert(0, __file__.rsplit("/", 3)[0])  # tests/ (tests/integration/<component>/this file)
from conftest import make_namespace  # noqa: E402
from tests_helpers import worker_keys  # noqa: E402


def block(seed: int, i: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng([seed, i]).integers(0, 256, nbytes, dtype=np.uint8)


def main() -> None:
    role, transport, address, seed_s, n_s = sys.argv[1:6]
    seed, n = int(seed_s), int(n_s)
    client = kvtier.Client.connect(address, transport=transport, lease_ttl_s=1.0)  # type: ignore[arg-type]
    ns = client.register(make_namespace())
    keys = worker_keys(ns, seed, n)
    if role == "put":
        r = ns.put(keys, [block(seed, i, ns.block_bytes) for i in range(n)])
        print(json.dumps({"stored": r.stored, "present": r.already_present, "dropped": r.dropped}))
    elif role == "get":
        got = ns.get(keys)
        ok = [
            g is not None and bytes(g) == block(seed, i, ns.block_bytes).tobytes() for i, g in enumerate(got)
        ]
        digest = hashlib.sha256(b"".join(bytes(g) for g in got if g is not None)).hexdigest()
        print(json.dumps({"lookup": ns.lookup(keys), "ok": sum(ok), "digest": digest}))
    elif role == "reserve":
        prep = client.session.call(
            "PrepareStore",
            pb.PrepareStoreRequest(
                namespace_id=ns.namespace_id, keys=b"".join(keys), transport=pb.TRANSPORT_SHM
            ),
        )
        view = client.session.data()._arena()  # type: ignore[attr-defined]
        off = prep.offsets[0]
        view[off : off + ns.block_bytes // 2] = block(seed, 0, ns.block_bytes)[: ns.block_bytes // 2]
        print("RESERVED", flush=True)
        signal.pause()  # held, mid-write, until the test kills this process
    client.close()


if __name__ == "__main__":
    main()
