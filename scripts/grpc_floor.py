"""The gRPC Python floor on this machine: a bare grpc.aio server with one empty RPC, called by 3
client processes (asyncio and uvloop). Run: .venv/bin/python scripts/grpc_floor.py"""
import asyncio
import multiprocessing as mp
import os
import sys
import time

import grpc

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "client"))
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pbg


class S(pbg.KvtierServicer):
    async def Heartbeat(self, req, ctx):
        return pb.HeartbeatReply(boot_epoch=1)

async def serve(port, ready):
    server = grpc.aio.server()
    pbg.add_KvtierServicer_to_server(S(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start(); ready.set()
    await asyncio.sleep(12)

def server_main(port, ready, mode):
    if mode == "uvloop":
        import uvloop; uvloop.run(serve(port, ready))
    else:
        asyncio.run(serve(port, ready))

def client(port, n, q):
    ch = grpc.insecure_channel(f"127.0.0.1:{port}"); stub = pbg.KvtierStub(ch)
    stub.Heartbeat(pb.HeartbeatRequest())
    t = time.perf_counter()
    for _ in range(n): stub.Heartbeat(pb.HeartbeatRequest())
    q.put(n / (time.perf_counter() - t))

for mode in ("asyncio", "uvloop"):
    port = 50900 + (mode == "uvloop")
    ready = mp.Event(); p = mp.Process(target=server_main, args=(port, ready, mode)); p.start(); ready.wait()
    q = mp.Queue(); cs = [mp.Process(target=client, args=(port, 1500, q)) for _ in range(3)]
    t = time.perf_counter(); [c.start() for c in cs]; [c.join() for c in cs]
    el = time.perf_counter() - t
    print(mode, "total qps", round(4500 / el), "per-client", [round(q.get()) for _ in cs])
    p.terminate(); p.join()
