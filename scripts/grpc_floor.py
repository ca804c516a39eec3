"""The gRPC Python floor on this machine: a bare grpc.aio server with one empty RPC, called by 3
client processes, on asyncio and on uvloop. Run: .venv/bin/python scripts/grpc_floor.py

Measured 2026-11-30 on the 2-core development machine: 1,796 calls/s (asyncio), 1,854 (uvloop).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import sys
import time
from typing import Any

import grpc

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "client"))
from kvtier_contract.v1 import kvtier_pb2 as pb  # noqa: E402
from kvtier_contract.v1 import kvtier_pb2_grpc as pbg  # noqa: E402

CLIENTS, CALLS = 3, 1500


class Empty(pbg.KvtierServicer):  # type: ignore[misc]
    async def Heartbeat(self, request: Any, context: Any) -> Any:
        return pb.HeartbeatReply(boot_epoch=1)


async def serve(port: int, ready: Any) -> None:
    server = grpc.aio.server()
    pbg.add_KvtierServicer_to_server(Empty(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    ready.set()
    await asyncio.sleep(3600)


def server_main(port: int, ready: Any, loop: str) -> None:
    if loop == "uvloop":
        import uvloop

        uvloop.run(serve(port, ready))
    else:
        asyncio.run(serve(port, ready))


def client_main(port: int, results: Any) -> None:
    stub = pbg.KvtierStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    stub.Heartbeat(pb.HeartbeatRequest())
    t0 = time.perf_counter()
    for _ in range(CALLS):
        stub.Heartbeat(pb.HeartbeatRequest())
    results.put(CALLS / (time.perf_counter() - t0))


def main() -> None:
    for n, loop in enumerate(("asyncio", "uvloop")):
        port = 50900 + n
        ready = mp.Event()
        server = mp.Process(target=server_main, args=(port, ready, loop))
        server.start()
        ready.wait()
        results: Any = mp.Queue()
        clients = [mp.Process(target=client_main, args=(port, results)) for _ in range(CLIENTS)]
        t0 = time.perf_counter()
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        total = CLIENTS * CALLS / (time.perf_counter() - t0)
        per = [round(results.get()) for _ in clients]
        print(f"{loop}: {total:,.0f} calls/s in total, per client {per}")
        server.terminate()
        server.join()


if __name__ == "__main__":
    main()
