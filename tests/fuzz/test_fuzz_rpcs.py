"""Fuzz targets: every RPC of the Kvtier service, against one live daemon per module.

Each RPC gets two targets (``test_well_typed[<RPC>]``, ``test_raw_bytes[<RPC>]``):

* **well typed but hostile**: requests built from the RPC's own message descriptor, each field
  drawn from values a buggy or hostile client could send: ids that are live (this example's own
  session and jobs, the canary's namespace), finished (a closed session), another session's, zero,
  huge or random; key fields of random or committed keys, batches around the limit, lengths not a
  multiple of 32; transports known, disabled or unknown; lease lengths, names and namespace
  specs at the ends of their ranges;
* **random bytes**: an arbitrary request body (protobuf decodes many of them into some message;
  the others must be refused as INVALID_ARGUMENT, issue 12 finding 5).

Properties, every example: the status is OK or one of the documented codes
(``kvtier_contract.errors``; never UNKNOWN, INTERNAL or a deadline), and the daemon still
answers its health check with SERVING. After each target: the canary namespace's blocks, stored
(and pinned, so that fuzzed stores cannot evict them) by a client of their own before the first
example, load back byte-exact, and the daemon process is alive.

Each example runs in a session of its own (opened before, closed after), so reservations and
pins it makes do not pile up. Inputs worth keeping: ``tests/fuzz/corpus/rpcs/*.json`` (replayed
by ``test_corpus``; the ``Call`` format below). Run length: tests/fuzz/fuzzing.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import DaemonProcess, make_namespace
from fuzzing import corpus_json, fuzz_settings, note
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given
from hypothesis import strategies as st

import kvtier
from kvtier_contract import errors
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtier_contract.v1 import kvtier_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["Kvtier"]
METHODS = [m.name for m in SERVICE.methods]
DOCUMENTED = {"OK", *errors.GRPC_STATUS.values()} - {"INTERNAL"}  # INVALID_ARGUMENT ... ABORTED
TIMEOUT_S = 5.0
MAX_BATCH = 4096  # DaemonConfig.max_batch_blocks default
CANARY_BLOCKS = 8
U32, U64, I64 = (1 << 32) - 1, (1 << 64) - 1, 1 << 63
# Short-run examples per RPC (default 30): more where a request reaches the index.
EXAMPLES = {
    "Lookup": 60,
    "LookupSlices": 60,
    "PrepareStore": 90,
    "PrepareLoad": 80,
    "CompleteStore": 60,
    "CompleteLoad": 50,
    "Prefetch": 50,
    "RegisterNamespace": 60,
    "OpenSession": 50,
    "Stats": 5,
}
SERVE = ("--host-bytes", "64MiB", "--slab-bytes", "1MiB", "--lease-ttl-s", "2")
F = FieldDescriptor


@dataclass(frozen=True)
class Sym:
    """A value known only at run time: this example's session, a job, the canary's namespace..."""

    name: str


def distinct_keys(n: int, salt: int = 0) -> bytes:
    return b"".join(hashlib.sha256(b"fuzz %d %d" % (salt, i)).digest() for i in range(n))


# ---- strategies: one per field, by name where the name means something, else by type -----------

ids = st.integers(0, U64)
MINE = Sym("mine")
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "session_id": st.one_of(
        st.just(MINE),
        st.just(MINE),
        st.just(MINE),
        st.just(MINE),
        st.sampled_from([Sym("closed"), 0, U64]),
        ids,
    ),
    "namespace_id": st.one_of(
        st.sampled_from([Sym("fuzz_ns"), Sym("fuzz_ns"), Sym("canary_ns"), 0, U64]), ids
    ),
    "job_id": st.one_of(
        st.sampled_from([Sym("store"), Sym("store"), Sym("load"), Sym("pinned"), 0, U64]),
        st.integers(0, 300),
        ids,
    ),
    "buffer_id": st.one_of(st.integers(0, 4), ids),
    "keys": st.one_of(
        st.lists(st.binary(min_size=32, max_size=32), max_size=8).map(b"".join),
        st.sampled_from([Sym("canary_keys"), Sym("fuzz_keys")]),
        st.builds(
            distinct_keys,
            st.sampled_from([1, 64, MAX_BATCH - 1, MAX_BATCH, MAX_BATCH + 1]),
            st.integers(0, 3),
        ),
        st.binary(max_size=100),
    ),
    "transport": st.one_of(st.sampled_from([0, 1, 1, 2, 2, 3]), st.integers(-(1 << 31), (1 << 31) - 1)),
    "lease_ttl_ms": st.one_of(st.sampled_from([0, 1, 200, 2000, 300_000, 300_001, U32]), st.integers(0, U32)),
    "client_name": st.one_of(st.text(max_size=40), st.builds(str.__mul__, st.just("n"), st.just(100_000))),
    "digest": st.one_of(st.just(b""), st.just(Sym("digest")), st.binary(max_size=40)),
    "buffer_bytes": st.one_of(st.sampled_from([0, 1, U64]), ids),
    "handle_offset": st.one_of(st.sampled_from([0, U64]), ids),
}
FIELDS["namespace_ids"] = FIELDS["namespace_id"]  # LookupSlices' (a list of them)
# Present in every drawn request (their values still include 0 and garbage): without them
# almost every request would stop at "unknown session".
REQUIRED = {"session_id", "namespace_id", "namespace_ids", "job_id", "keys", "spec"}
BY_TYPE: dict[int, st.SearchStrategy[Any]] = {
    F.TYPE_BOOL: st.booleans(),
    F.TYPE_UINT32: st.one_of(st.sampled_from([0, 1, U32]), st.integers(0, U32)),
    F.TYPE_UINT64: st.one_of(st.sampled_from([0, 1, U64]), ids),
    F.TYPE_FIXED64: st.one_of(st.sampled_from([0, 1, U64]), st.integers(0, U64)),
    F.TYPE_INT64: st.one_of(st.sampled_from([0, 1, -1, 3, I64 - 1, -I64]), st.integers(-I64, I64 - 1)),
    F.TYPE_STRING: st.one_of(st.text(max_size=30), st.builds(str.__mul__, st.just("s"), st.just(70_000))),
    F.TYPE_BYTES: st.binary(max_size=80),
}
_VALID_SPEC = {k: v for k, v in make_namespace(model_id="fuzz").to_dict().items() if v is not None}


def field_strategy(f: FieldDescriptor) -> st.SearchStrategy[Any]:
    if f.name in FIELDS:
        one = FIELDS[f.name]
    elif f.type == F.TYPE_MESSAGE and f.message_type.name == "NamespaceSpec":
        one = spec_strategy()
    elif f.type == F.TYPE_MESSAGE:
        one = message_strategy(f.message_type)
    elif f.type == F.TYPE_ENUM:
        one = FIELDS["transport"]
    else:
        one = BY_TYPE[f.type]
    return st.lists(one, max_size=6) if f.is_repeated else one


def spec_strategy() -> st.SearchStrategy[dict[str, Any]]:
    """Valid namespace specs with a few fields changed, or every field drawn freely."""
    return st.one_of(
        mutated(pb.NamespaceSpec.DESCRIPTOR, _VALID_SPEC), message_strategy(pb.NamespaceSpec.DESCRIPTOR)
    )


def mutated(desc: Descriptor, valid: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """``valid`` with up to three of ``desc``'s fields set to anything of their type or removed:
    requests that get past the first checks and break one or two things at once."""
    if not desc.fields:
        return st.just(dict(valid))
    change = st.sampled_from(list(desc.fields)).flatmap(
        lambda f: st.tuples(st.just(f.name), st.one_of(st.none(), field_strategy(f)))
    )

    def apply(changes: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(valid)
        for name, value in changes:
            if value is None:
                out.pop(name, None)
            else:
                out[name] = value
        return out

    return st.lists(change, max_size=3).map(apply)


def message_strategy(desc: Descriptor) -> st.SearchStrategy[dict[str, Any]]:
    """A dict of field values for ``desc``; fields outside REQUIRED may be absent."""
    return st.fixed_dictionaries(
        {f.name: field_strategy(f) for f in desc.fields if f.name in REQUIRED},
        optional={f.name: field_strategy(f) for f in desc.fields if f.name not in REQUIRED},
    )


# A request every RPC accepts (symbols are this example's session, jobs and namespace).
VALID: dict[str, Any] = {
    "session_id": MINE,
    "namespace_id": Sym("fuzz_ns"),
    "keys": Sym("fuzz_keys"),
    "transport": pb.TRANSPORT_TCP,
    "job_id": Sym("store"),
    "ok": True,
    "spec": _VALID_SPEC,
    "digest": Sym("digest"),
    "client_name": "fuzz",
    "lease_ttl_ms": 1000,
    "pin": True,
}


def request_strategy(method: str) -> st.SearchStrategy[dict[str, Any]]:
    """Requests of ``method``: mostly a valid one with a few fields broken, else free."""
    desc = SERVICE.methods_by_name[method].input_type
    valid = {
        f.name: [VALID[f.name]] if f.is_repeated else VALID[f.name] for f in desc.fields if f.name in VALID
    }
    if "namespace_ids" in desc.fields_by_name:  # LookupSlices: the fuzz namespace, one slice
        valid["namespace_ids"] = [VALID["namespace_id"]]
    if method == "CompleteLoad":
        valid["job_id"] = Sym("load")
    return st.one_of(mutated(desc, valid), mutated(desc, valid), message_strategy(desc))


# ---- the daemon, the canary, and one call ------------------------------------------------------


class Target:
    """One daemon, a raw stub on it, the canary client, and what the symbols stand for."""

    def __init__(self, daemon: DaemonProcess) -> None:
        self.daemon = daemon
        self.channel = grpc.insecure_channel(
            daemon.grpc, options=[("grpc.max_send_message_length", 64 << 20)]
        )
        self.stub = pb_grpc.KvtierStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.canary = kvtier.Client.connect(daemon.unix, "shm", timeout_s=TIMEOUT_S, client_name="canary")
        canary_ns = self.canary.register(make_namespace(model_id="canary"))
        self.canary_keys = [hashlib.sha256(b"canary %d" % i).digest() for i in range(CANARY_BLOCKS)]
        self.canary_data = [hashlib.shake_256(k).digest(canary_ns.block_bytes) for k in self.canary_keys]
        assert canary_ns.put(self.canary_keys, self.canary_data).stored == CANARY_BLOCKS
        self.canary_pin = canary_ns.lookup_pinned(self.canary_keys)  # never evicted meanwhile
        assert self.canary_pin.hits == CANARY_BLOCKS
        self.canary_ns = canary_ns
        fuzz = make_namespace(model_id="fuzz")
        reg = self.call(
            "RegisterNamespace",
            pb.RegisterNamespaceRequest(spec=pb.NamespaceSpec(**_VALID_SPEC), digest=fuzz.digest),
        )
        closed = self.call("OpenSession", pb.OpenSessionRequest(client_name="closed"))
        self.call("CloseSession", pb.CloseSessionRequest(session_id=closed.session_id))
        self.symbols: dict[str, Any] = {
            "fuzz_ns": reg.namespace_id,
            "canary_ns": canary_ns.namespace_id,
            "closed": closed.session_id,
            "digest": fuzz.digest,
            "canary_keys": b"".join(self.canary_keys),
            "fuzz_keys": distinct_keys(4, 99),
        }
        self._fresh = itertools.count()
        with self.session(jobs=False) as symbols:  # commit the fuzz keys: loads find them
            store = self.call(
                "PrepareStore",
                pb.PrepareStoreRequest(
                    session_id=symbols["mine"],
                    namespace_id=reg.namespace_id,
                    keys=self.symbols["fuzz_keys"],
                    transport=pb.TRANSPORT_SHM,
                ),
            )
            self.call(
                "CompleteStore",
                pb.CompleteStoreRequest(session_id=symbols["mine"], job_id=store.job_id, ok=True),
            )
        self.seen: Counter[str] = Counter()  # "<RPC> raw|typed: <status>" -> calls

    def call(self, method: str, request: Any) -> Any:
        return getattr(self.stub, method)(request, timeout=TIMEOUT_S)

    def close(self) -> None:
        self.canary.close()
        self.channel.close()

    @contextlib.contextmanager
    def session(self, jobs: bool) -> Iterator[dict[str, Any]]:
        """This example's session (and, with ``jobs``, a store job, a load job and a pinned
        lookup in it): the symbols' values. Closed after the example."""
        opened = self.call(
            "OpenSession",
            pb.OpenSessionRequest(client_name="fuzz", lease_ttl_ms=30_000, transport=pb.TRANSPORT_SHM),
        )
        sid, ns = opened.session_id, self.symbols["fuzz_ns"]
        values = dict(self.symbols, mine=sid, store=0, load=0, pinned=0)
        if jobs:
            values["store"] = self.call(
                "PrepareStore",
                pb.PrepareStoreRequest(
                    session_id=sid,
                    namespace_id=ns,
                    keys=distinct_keys(2, 1000 + next(self._fresh)),
                    transport=pb.TRANSPORT_SHM,
                ),
            ).job_id
            canary = self.symbols["canary_ns"], self.symbols["canary_keys"]
            values["load"] = self.call(
                "PrepareLoad",
                pb.PrepareLoadRequest(
                    session_id=sid, namespace_id=canary[0], keys=canary[1], transport=pb.TRANSPORT_SHM
                ),
            ).job_id
            values["pinned"] = self.call(
                "Lookup", pb.LookupRequest(session_id=sid, namespace_id=canary[0], keys=canary[1], pin=True)
            ).job_id
        try:
            yield values
        finally:
            try:
                self.call("CloseSession", pb.CloseSessionRequest(session_id=sid))
            except grpc.RpcError as e:  # the example closed it itself
                assert e.code() == grpc.StatusCode.NOT_FOUND, e

    def check_healthy(self) -> None:
        reply = self.health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert self.daemon.proc is not None and self.daemon.proc.poll() is None

    def check_canary(self) -> None:
        """The canary's blocks load back byte-exact (and the daemon is alive and serving)."""
        self.check_healthy()
        got = self.canary_ns.get(self.canary_keys)
        assert [bytes(g) if g is not None else None for g in got] == self.canary_data


def build(cls: Any, values: dict[str, Any], symbols: dict[str, Any]) -> Any:
    """The message ``cls`` with ``values`` (symbols replaced by what they stand for)."""
    msg = cls()
    for name, v in values.items():
        f = cls.DESCRIPTOR.fields_by_name[name]
        if f.type == F.TYPE_MESSAGE:
            sub = _message_class(f.message_type)
            if f.is_repeated:
                for item in v:
                    getattr(msg, name).add().CopyFrom(build(sub, item, symbols))
            else:
                getattr(msg, name).CopyFrom(build(sub, v, symbols))
        elif f.is_repeated:
            getattr(msg, name).extend(_resolve(x, symbols) for x in v)
        else:
            setattr(msg, name, _resolve(v, symbols))
    return msg


def _resolve(v: Any, symbols: dict[str, Any]) -> Any:
    return symbols[v.name] if isinstance(v, Sym) else v


def _message_class(desc: Descriptor) -> Any:
    return getattr(pb, desc.name)


def status_of(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except grpc.RpcError as e:
        return str(e.code().name)
    return "OK"


def needs_jobs(method: str) -> bool:
    return "job_id" in SERVICE.methods_by_name[method].input_type.fields_by_name


@dataclass
class Call:
    """One fuzz input: ``method`` and either ``request`` (field values; a "$name" string stands
    for a symbol) or ``raw`` (hex of the request body)."""

    method: str
    request: dict[str, Any] | None = None
    raw: bytes | None = None


def run_call(target: Target, call: Call, accept: set[str] = DOCUMENTED) -> str:
    """Send one call in a session of its own; check the status and the daemon's health."""
    desc = SERVICE.methods_by_name[call.method]
    with target.session(needs_jobs(call.method)) as symbols:
        if call.raw is not None:
            raw_call = target.channel.unary_unary(f"/{SERVICE.full_name}/{call.method}")
            code = status_of(lambda: raw_call(call.raw, timeout=TIMEOUT_S))
        else:
            request = build(_message_class(desc.input_type), call.request or {}, symbols)
            code = status_of(lambda: target.call(call.method, request))
    note(f"{call.method}: {code}")
    target.seen[f"{call.method} {'raw' if call.raw is not None else 'typed'}: {code}"] += 1
    assert code in accept, f"{call.method} answered {code}"
    target.check_healthy()
    return code


# ---- tests -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    d = DaemonProcess(Path(tmp_path_factory.mktemp("fuzz-rpcs")), *SERVE).start()
    t = Target(d)
    try:
        yield t
    finally:
        print("\nstatuses seen:", ", ".join(f"{k} x{n}" for k, n in sorted(t.seen.items())))
        t.close()
        d.kill()


def _from_json(v: Any) -> Any:
    if isinstance(v, str) and v.startswith("$"):
        return Sym(v[1:])
    if isinstance(v, dict):
        return {k: _from_json(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_from_json(x) for x in v]
    return v


@pytest.mark.parametrize("entry", corpus_json("rpcs"), ids=lambda e: e["name"])
def test_corpus(target: Target, entry: dict[str, Any]) -> None:
    """Every kept call still gets a documented status."""
    request = _from_json(entry.get("request"))
    if isinstance(request, dict):
        for name in ("keys", "digest", "device_uuid", "ipc_handle"):
            if isinstance(request.get(name), str):  # bytes fields are written as hex
                request[name] = bytes.fromhex(request[name])
    raw = bytes.fromhex(entry["raw"]) if "raw" in entry else None
    run_call(target, Call(entry["method"], request, raw))
    target.check_canary()


@pytest.mark.parametrize("method", METHODS)
def test_well_typed(target: Target, method: str) -> None:
    """Hostile but well-typed requests of ``method``."""
    requests = request_strategy(method)

    @fuzz_settings(EXAMPLES.get(method, 30))
    @given(request=requests)
    def one(request: dict[str, Any]) -> None:
        run_call(target, Call(method, request))

    one()
    target.check_canary()


@pytest.mark.parametrize("method", METHODS)
def test_raw_bytes(target: Target, method: str) -> None:
    """Arbitrary request bodies of ``method``: a documented status, INVALID_ARGUMENT for one
    that does not decode."""

    @fuzz_settings(12)
    @given(body=st.binary(max_size=64))
    def one(body: bytes) -> None:
        run_call(target, Call(method, raw=body))

    one()
    target.check_canary()
