"""Bad input against a real daemon: the right status code, a message naming the field, no change.

Three layers are exercised: the gRPC control plane with a raw stub (what a buggy or hostile
client can send), the SDK (``kvtier.Client``: caller mistakes raise before anything is sent) and
the TCP data channel with hand-built frames (``kvtier_contract.wire``).

"No change" is checked on the daemon's own figures: the Stats reply (less its uptime) and the
published prefixes are the same before and after the bad call. The daemon fixture: 64 MiB host
tier, 1 MiB slabs, batches of at most 4096 keys; the test namespace has 16 KiB blocks.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from conftest import DaemonProcess, make_namespace

import kvtier
from kvtier_contract import errors, wire
from kvtier_contract.protoutil import to_dict
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtier_contract.v1 import kvtier_pb2_grpc as pb_grpc
from kvtier_contract.wire import Op, Status

MAX_BATCH = 4096  # DaemonConfig.max_batch_blocks default
StatusCode = grpc.StatusCode
TIMEOUT_S = 5.0


def keys(*ids: int) -> bytes:
    """Packed 32-byte keys, as the protocol carries them."""
    return b"".join(i.to_bytes(32, "big") for i in ids)


DATA_SECRETS: dict[int, bytes] = {}  # session id -> its data secret (OpenSessionReply)


@dataclass
class Ctx:
    """Two open sessions (``session_id`` for shm jobs, ``tcp_session_id`` for tcp ones: a job's
    transport must be its session's) with the test namespace registered."""

    stub: Any
    session_id: int
    ns_id: int
    block_bytes: int
    open_reply: Any
    tcp_session_id: int

    def call(self, method: str, request: Any) -> Any:
        return getattr(self.stub, method)(request, timeout=TIMEOUT_S)

    def open_session(self, transport: int = pb.TRANSPORT_SHM) -> int:
        reply = self.call(
            "OpenSession",
            pb.OpenSessionRequest(client_name="bad-input", lease_ttl_ms=60_000, transport=transport),
        )
        DATA_SECRETS[reply.session_id] = reply.data_secret
        return int(reply.session_id)

    def prepare_store(
        self, *ids: int, session_id: int | None = None, transport: int = pb.TRANSPORT_SHM
    ) -> Any:
        default = self.tcp_session_id if transport == pb.TRANSPORT_TCP else self.session_id
        return self.call(
            "PrepareStore",
            pb.PrepareStoreRequest(
                session_id=session_id or default,
                namespace_id=self.ns_id,
                keys=keys(*ids),
                transport=transport,
            ),
        )

    def store(self, *ids: int) -> None:
        """A whole shm store (the bytes are whatever the slots held)."""
        prep = self.prepare_store(*ids)
        self.call(
            "CompleteStore", pb.CompleteStoreRequest(session_id=self.session_id, job_id=prep.job_id, ok=True)
        )

    def lookup(self, *ids: int) -> int:
        return int(
            self.call(
                "Lookup",
                pb.LookupRequest(session_id=self.session_id, namespace_id=self.ns_id, keys=keys(*ids)),
            ).hit_blocks
        )

    def state(self) -> dict[str, Any]:
        """Everything Stats reports, less the uptime, and the published prefixes."""
        d = to_dict(self.call("Stats", pb.StatsRequest()))
        del d["uptime_s"]
        d["published_prefixes"] = to_dict(self.call("ListPrefixes", pb.ListPrefixesRequest()))
        return d


@pytest.fixture
def ctx(daemon: DaemonProcess) -> Iterator[Ctx]:
    with grpc.insecure_channel(daemon.grpc) as channel:
        stub = pb_grpc.KvtierStub(channel)
        ns = make_namespace()
        spec = pb.NamespaceSpec(**{k: v for k, v in ns.to_dict().items() if v is not None})
        reg = stub.RegisterNamespace(
            pb.RegisterNamespaceRequest(spec=spec, digest=ns.digest), timeout=TIMEOUT_S
        )
        opened = stub.OpenSession(
            pb.OpenSessionRequest(client_name="bad-input", lease_ttl_ms=60_000, transport=pb.TRANSPORT_SHM),
            timeout=TIMEOUT_S,
        )
        tcp = stub.OpenSession(
            pb.OpenSessionRequest(
                client_name="bad-input-tcp", lease_ttl_ms=60_000, transport=pb.TRANSPORT_TCP
            ),
            timeout=TIMEOUT_S,
        )
        DATA_SECRETS.update({opened.session_id: opened.data_secret, tcp.session_id: tcp.data_secret})
        yield Ctx(stub, opened.session_id, reg.namespace_id, reg.block_bytes, opened, tcp.session_id)


def rejected(ctx: Ctx, method: str, request: Any, code: grpc.StatusCode, field: str) -> str:
    """Call ``method``; assert the status, that the message starts with ``field``, no change."""
    before = ctx.state()
    with pytest.raises(grpc.RpcError) as exc:
        ctx.call(method, request)
    err = exc.value
    assert err.code() == code, (err.code(), err.details())
    assert (err.details() or "").startswith(f"{field}: "), err.details()
    assert ctx.state() == before
    return str(err.details())


# ---- requests of every RPC, one bad field at a time ------------------------------------------

UNKNOWN_SESSION = 123_456_789
UNKNOWN_NS = 987_654_321

Build = Callable[[Ctx], Any]
CASES: list[tuple[str, str, Build, grpc.StatusCode, str]] = []


def case(name: str, method: str, build: Build, code: grpc.StatusCode, field: str) -> None:
    CASES.append((name, method, build, code, field))


for _method, _req in [
    ("Lookup", pb.LookupRequest),
    ("PrepareStore", pb.PrepareStoreRequest),
    ("PrepareLoad", pb.PrepareLoadRequest),
    ("Prefetch", pb.PrefetchRequest),
]:

    def _with(r: type = _req, **kw: Any) -> Build:
        def build(c: Ctx) -> Any:
            fields = dict(session_id=c.session_id, namespace_id=c.ns_id, keys=keys(1, 2))
            if r not in (pb.LookupRequest, pb.PrefetchRequest):
                fields["transport"] = pb.TRANSPORT_SHM
            fields.update({k: (v(c) if callable(v) else v) for k, v in kw.items()})
            return r(**fields)

        return build

    case(
        f"{_method}-keys-not-a-multiple-of-32",
        _method,
        _with(keys=keys(1) + b"\0" * 31),
        StatusCode.INVALID_ARGUMENT,
        "keys",
    )
    case(f"{_method}-keys-one-byte", _method, _with(keys=b"\1"), StatusCode.INVALID_ARGUMENT, "keys")
    case(
        f"{_method}-more-keys-than-a-batch",
        _method,
        _with(keys=bytes(32 * (MAX_BATCH + 1))),
        StatusCode.RESOURCE_EXHAUSTED,
        "keys",
    )
    case(
        f"{_method}-unknown-namespace",
        _method,
        _with(namespace_id=UNKNOWN_NS),
        StatusCode.NOT_FOUND,
        "namespace_id",
    )
    case(
        f"{_method}-unknown-session",
        _method,
        _with(session_id=UNKNOWN_SESSION),
        StatusCode.NOT_FOUND,
        "session_id",
    )
    if _req not in (pb.LookupRequest, pb.PrefetchRequest):
        for _tp in (pb.TRANSPORT_UNSPECIFIED, 77):
            case(
                f"{_method}-transport-{_tp}",
                _method,
                _with(transport=_tp),
                StatusCode.INVALID_ARGUMENT,
                "transport",
            )
        # Known, but this daemon runs without cuda_ipc = true.
        case(
            f"{_method}-transport-cuda-ipc-disabled",
            _method,
            _with(transport=pb.TRANSPORT_CUDA_IPC),
            StatusCode.FAILED_PRECONDITION,
            "transport",
        )


def _slices(**kw: Any) -> Build:
    def build(c: Ctx) -> Any:
        fields: dict[str, Any] = dict(
            session_id=c.session_id, namespace_ids=[c.ns_id], keys=[keys(1, 2)], pin=True
        )
        fields.update({k: (v(c) if callable(v) else v) for k, v in kw.items()})
        return pb.LookupSlicesRequest(**fields)

    return build


case(
    "LookupSlices-no-namespace",
    "LookupSlices",
    _slices(namespace_ids=[], keys=[]),
    StatusCode.INVALID_ARGUMENT,
    "namespace_ids",
)
case(
    "LookupSlices-65-namespaces",
    "LookupSlices",
    _slices(namespace_ids=list(range(1, 66)), keys=[b""] * 65),
    StatusCode.INVALID_ARGUMENT,
    "namespace_ids",
)
case(
    "LookupSlices-a-namespace-twice",
    "LookupSlices",
    _slices(namespace_ids=lambda c: [c.ns_id, c.ns_id], keys=[keys(1), keys(1)]),
    StatusCode.INVALID_ARGUMENT,
    "namespace_ids",
)
case(
    "LookupSlices-fewer-chains-than-namespaces",
    "LookupSlices",
    _slices(namespace_ids=lambda c: [c.ns_id, UNKNOWN_NS]),
    StatusCode.INVALID_ARGUMENT,
    "keys",
)
case(
    "LookupSlices-keys-not-a-multiple-of-32",
    "LookupSlices",
    _slices(keys=[keys(1) + b"\0"]),
    StatusCode.INVALID_ARGUMENT,
    "keys",
)
case(
    "LookupSlices-more-keys-than-a-batch",
    "LookupSlices",
    _slices(keys=[bytes(32 * (MAX_BATCH + 1))]),
    StatusCode.RESOURCE_EXHAUSTED,
    "keys",
)
case(
    "LookupSlices-unknown-namespace",
    "LookupSlices",
    _slices(namespace_ids=lambda c: [c.ns_id, UNKNOWN_NS], keys=[keys(1, 2), keys(1, 2)]),
    StatusCode.NOT_FOUND,
    "namespace_id",
)
case(
    "LookupSlices-unknown-session",
    "LookupSlices",
    _slices(session_id=UNKNOWN_SESSION),
    StatusCode.NOT_FOUND,
    "session_id",
)

for _method, _req in [("Heartbeat", pb.HeartbeatRequest), ("CloseSession", pb.CloseSessionRequest)]:
    case(
        f"{_method}-unknown-session",
        _method,
        lambda c, r=_req: r(session_id=UNKNOWN_SESSION),
        StatusCode.NOT_FOUND,
        "session_id",
    )
case(
    "CompleteStore-unknown-session",
    "CompleteStore",
    lambda c: pb.CompleteStoreRequest(session_id=UNKNOWN_SESSION, job_id=1, ok=True),
    StatusCode.NOT_FOUND,
    "session_id",
)
case(
    "CompleteLoad-unknown-session",
    "CompleteLoad",
    lambda c: pb.CompleteLoadRequest(session_id=UNKNOWN_SESSION, job_id=1),
    StatusCode.NOT_FOUND,
    "session_id",
)
case(
    "CompleteStore-unknown-job",
    "CompleteStore",
    lambda c: pb.CompleteStoreRequest(session_id=c.session_id, job_id=999_999, ok=True),
    StatusCode.NOT_FOUND,
    "job_id",
)
case(
    "CompleteLoad-unknown-job",
    "CompleteLoad",
    lambda c: pb.CompleteLoadRequest(session_id=c.session_id, job_id=999_999),
    StatusCode.NOT_FOUND,
    "job_id",
)
case(
    "OpenSession-transport-9",
    "OpenSession",
    lambda c: pb.OpenSessionRequest(client_name="x", transport=9),
    StatusCode.INVALID_ARGUMENT,
    "transport",
)
case(
    "OpenSession-transport-cuda-ipc-disabled",
    "OpenSession",
    lambda c: pb.OpenSessionRequest(client_name="x", transport=pb.TRANSPORT_CUDA_IPC),
    StatusCode.FAILED_PRECONDITION,
    "transport",
)
# The cuda_ipc RPCs on a daemon without cuda_ipc = true: refused before anything is read.
case(
    "RegisterCudaBuffer-disabled",
    "RegisterCudaBuffer",
    lambda c: pb.RegisterCudaBufferRequest(
        session_id=c.session_id, device_uuid=bytes(16), ipc_handle=bytes(64), buffer_bytes=1 << 20
    ),
    StatusCode.FAILED_PRECONDITION,
    "transport",
)
case(
    "CudaCopy-disabled",
    "CudaCopy",
    lambda c: pb.CudaCopyRequest(session_id=c.session_id, job_id=1, buffer_id=1),
    StatusCode.FAILED_PRECONDITION,
    "transport",
)
case(
    "ReleaseCudaBuffer-disabled",
    "ReleaseCudaBuffer",
    lambda c: pb.ReleaseCudaBufferRequest(session_id=c.session_id, buffer_id=1),
    StatusCode.FAILED_PRECONDITION,
    "transport",
)


# Published prefixes (a daemon without tenants: any group name a tenants file could have).
for _name, _fields, _field in [
    ("no-name", {"name": ""}, "name"),
    ("name-of-129", {"name": "n" * 129}, "name"),
    ("no-group", {"group": ""}, "group"),
    ("tokens-0", {"tokens": 0}, "tokens"),
    ("tokens-over-the-bound", {"tokens": (1 << 20) + 1}, "tokens"),
    ("digest-of-31", {"digest": bytes(31)}, "digest"),
]:
    case(
        f"PublishPrefix-{_name}",
        "PublishPrefix",
        lambda c, f=_fields: pb.PublishPrefixRequest(
            **{"group": "g", "name": "system", "tokens": 64, "digest": bytes(32), **f}
        ),
        StatusCode.INVALID_ARGUMENT,
        _field,
    )


@pytest.mark.parametrize(
    ("method", "build", "code", "field"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_request_is_refused_naming_the_field(
    ctx: Ctx, method: str, build: Build, code: grpc.StatusCode, field: str
) -> None:
    ctx.store(1)  # something in the cache that a bad request must not touch
    rejected(ctx, method, build(ctx), code, field)


def test_every_rpc_is_covered() -> None:
    rpcs = {m.name for m in pb.DESCRIPTOR.services_by_name["Kvtier"].methods}
    covered = {c[1] for c in CASES} | {"RegisterNamespace", "Stats", "ListPrefixes"}  # (no fields)
    assert covered == rpcs


# ---- RegisterNamespace: fail closed ---------------------------------------------------------


def spec_of(**overrides: Any) -> pb.NamespaceSpec:
    fields = {k: v for k, v in make_namespace().to_dict().items() if v is not None}
    fields.update(overrides)
    return pb.NamespaceSpec(**{k: v for k, v in fields.items() if v is not None})


MISSING = [
    "model_id",
    "model_revision",
    "tokenizer_digest",
    "kv_dtype",
    "layout",
    "tokens_per_block",
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "tp_size",
    "pp_size",
]


@pytest.mark.parametrize("name", MISSING)
def test_register_namespace_with_a_missing_identity_field(ctx: Ctx, name: str) -> None:
    # proto3 cannot tell "unset" from "" or 0: both mean missing, and missing is an error
    spec = spec_of(**{name: None})
    details = rejected(
        ctx,
        "RegisterNamespace",
        pb.RegisterNamespaceRequest(spec=spec),
        StatusCode.INVALID_ARGUMENT,
        f"namespace.{name}",
    )
    assert "required" in details or "must be" in details


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"kv_dtype": "float12"}, "namespace.kv_dtype"),
        ({"num_layers": 2**40}, "namespace.num_layers"),
        ({"tp_rank": 2, "tp_size": 2}, "namespace.tp_rank"),
        ({"adapter_id": "lora-x"}, "namespace.adapter_revision"),
        ({"cache_salt": ""}, "namespace.cache_salt"),  # present but empty: not a silent "no salt"
        ({"model_id": " "}, "namespace.model_id"),
        ({"model_revision": "main"}, "namespace.model_revision"),  # the SDK's rule, on the daemon
        ({"tokenizer_digest": "sha256:" + "0" * 64}, "namespace.tokenizer_digest"),
    ],
)
def test_register_namespace_with_a_malformed_field(ctx: Ctx, overrides: dict[str, Any], field: str) -> None:
    rejected(
        ctx,
        "RegisterNamespace",
        pb.RegisterNamespaceRequest(spec=spec_of(**overrides)),
        StatusCode.INVALID_ARGUMENT,
        field,
    )


def test_register_namespace_without_a_spec(ctx: Ctx) -> None:
    rejected(
        ctx,
        "RegisterNamespace",
        pb.RegisterNamespaceRequest(),
        StatusCode.INVALID_ARGUMENT,
        "namespace.model_id",
    )


def test_register_namespace_with_a_digest_mismatch(ctx: Ctx) -> None:
    other = make_namespace(model_revision="rev2")
    for digest in (other.digest, b"\0" * 32, b"short"):
        rejected(
            ctx,
            "RegisterNamespace",
            pb.RegisterNamespaceRequest(spec=spec_of(), digest=digest),
            StatusCode.INVALID_ARGUMENT,
            "digest",
        )


def test_register_namespace_whose_block_does_not_fit_a_slab(ctx: Ctx) -> None:
    # 2048 tokens x 1 KiB per token = 2 MiB > 1 MiB slabs
    spec = spec_of(model_id="big", tokens_per_block=2048)
    details = rejected(
        ctx,
        "RegisterNamespace",
        pb.RegisterNamespaceRequest(spec=spec),
        StatusCode.INVALID_ARGUMENT,
        "namespace.block_bytes",
    )
    assert "slab" in details
    # exactly one slab is fine
    reply = ctx.call(
        "RegisterNamespace", pb.RegisterNamespaceRequest(spec=spec_of(model_id="big", tokens_per_block=1024))
    )
    assert reply.block_bytes == 1 << 20


# ---- jobs: ownership, kind, completion --------------------------------------------------------


def test_complete_store_of_another_sessions_job(ctx: Ctx) -> None:
    other = ctx.open_session()
    prep = ctx.prepare_store(1, 2, session_id=other)
    assert prep.job_id
    # [1w 2w] belong to `other`
    rejected(
        ctx,
        "CompleteStore",
        pb.CompleteStoreRequest(session_id=ctx.session_id, job_id=prep.job_id, ok=True),
        StatusCode.NOT_FOUND,
        "job_id",
    )  # as an absent job: an id tells nothing
    rejected(
        ctx,
        "CompleteStore",
        pb.CompleteStoreRequest(session_id=ctx.session_id, job_id=prep.job_id, ok=False),
        StatusCode.NOT_FOUND,
        "job_id",
    )
    # the owner still completes it
    done = ctx.call("CompleteStore", pb.CompleteStoreRequest(session_id=other, job_id=prep.job_id, ok=True))
    assert (done.committed, done.aborted) == (2, 0)
    assert ctx.lookup(1, 2) == 2


def test_complete_load_of_another_sessions_job(ctx: Ctx) -> None:
    ctx.store(1)
    other = ctx.open_session()
    load = ctx.call(
        "PrepareLoad",
        pb.PrepareLoadRequest(
            session_id=other, namespace_id=ctx.ns_id, keys=keys(1), transport=pb.TRANSPORT_SHM
        ),
    )
    assert load.job_id and ctx.state()["pinned_blocks"] == 1
    rejected(
        ctx,
        "CompleteLoad",
        pb.CompleteLoadRequest(session_id=ctx.session_id, job_id=load.job_id),
        StatusCode.NOT_FOUND,
        "job_id",
    )
    ctx.call("CompleteLoad", pb.CompleteLoadRequest(session_id=other, job_id=load.job_id))
    assert ctx.state()["pinned_blocks"] == 0


def test_complete_store_twice(ctx: Ctx) -> None:
    prep = ctx.prepare_store(1)
    request = pb.CompleteStoreRequest(session_id=ctx.session_id, job_id=prep.job_id, ok=True)
    assert ctx.call("CompleteStore", request).committed == 1
    rejected(ctx, "CompleteStore", request, StatusCode.NOT_FOUND, "job_id")
    # an abort after the commit must not take the committed block away
    request.ok = False
    rejected(ctx, "CompleteStore", request, StatusCode.NOT_FOUND, "job_id")
    assert ctx.lookup(1) == 1


def test_complete_store_with_item_ok_of_the_wrong_length(ctx: Ctx) -> None:
    ctx.store(2)
    prep = ctx.prepare_store(1, 2, 3)
    # reserved: 1 and 3 (2 is present), so item_ok needs two values
    assert list(prep.status) == [pb.STORE_RESERVED, pb.STORE_ALREADY_PRESENT, pb.STORE_RESERVED]
    for item_ok in ([True], [True, True, True]):
        rejected(
            ctx,
            "CompleteStore",
            pb.CompleteStoreRequest(session_id=ctx.session_id, job_id=prep.job_id, ok=True, item_ok=item_ok),
            StatusCode.INVALID_ARGUMENT,
            "item_ok",
        )
    done = ctx.call(
        "CompleteStore",
        pb.CompleteStoreRequest(
            session_id=ctx.session_id, job_id=prep.job_id, ok=True, item_ok=[False, True]
        ),
    )
    assert (done.committed, done.aborted) == (1, 1)
    assert ctx.lookup(2, 3) == 2 and ctx.lookup(1) == 0


def test_complete_load_on_a_store_job_and_store_on_a_load_job(ctx: Ctx) -> None:
    ctx.store(1)
    prep = ctx.prepare_store(2)
    rejected(
        ctx,
        "CompleteLoad",
        pb.CompleteLoadRequest(session_id=ctx.session_id, job_id=prep.job_id),
        StatusCode.FAILED_PRECONDITION,
        "job_id",
    )
    load = ctx.call(
        "Lookup", pb.LookupRequest(session_id=ctx.session_id, namespace_id=ctx.ns_id, keys=keys(1), pin=True)
    )
    assert load.hit_blocks == 1 and load.job_id
    rejected(
        ctx,
        "CompleteStore",
        pb.CompleteStoreRequest(session_id=ctx.session_id, job_id=load.job_id, ok=True),
        StatusCode.FAILED_PRECONDITION,
        "job_id",
    )
    ctx.call("CompleteLoad", pb.CompleteLoadRequest(session_id=ctx.session_id, job_id=load.job_id))
    ctx.call("CompleteStore", pb.CompleteStoreRequest(session_id=ctx.session_id, job_id=prep.job_id, ok=True))
    state = ctx.state()
    assert state["pinned_blocks"] == 0 and state["writing_blocks"] == 0


def test_a_closed_session_is_unknown_and_its_jobs_are_gone(ctx: Ctx) -> None:
    other = ctx.open_session()
    prep = ctx.prepare_store(1, session_id=other)
    ctx.call("CloseSession", pb.CloseSessionRequest(session_id=other))
    assert ctx.state()["writing_blocks"] == 0
    rejected(
        ctx,
        "CompleteStore",
        pb.CompleteStoreRequest(session_id=other, job_id=prep.job_id, ok=True),
        StatusCode.NOT_FOUND,
        "session_id",
    )
    rejected(
        ctx, "CloseSession", pb.CloseSessionRequest(session_id=other), StatusCode.NOT_FOUND, "session_id"
    )
    assert ctx.lookup(1) == 0


def test_an_expired_session_is_unknown(ctx: Ctx) -> None:
    reply = ctx.call("OpenSession", pb.OpenSessionRequest(client_name="short", lease_ttl_ms=1))
    assert reply.lease_ttl_ms == 200  # clamped to min_lease_ttl_s
    prep = ctx.prepare_store(1, session_id=reply.session_id)
    assert prep.job_id
    expired = ctx.state()["leases_expired"]
    deadline = time.monotonic() + 10
    # the daemon's sweeper collects the lease; wait for its figure, not for a fixed time
    while ctx.state()["leases_expired"] == expired:
        assert time.monotonic() < deadline, "lease never expired"
        time.sleep(0.05)
    assert ctx.state()["writing_blocks"] == 0
    rejected(
        ctx, "Heartbeat", pb.HeartbeatRequest(session_id=reply.session_id), StatusCode.NOT_FOUND, "session_id"
    )
    rejected(
        ctx,
        "CompleteStore",
        pb.CompleteStoreRequest(session_id=reply.session_id, job_id=prep.job_id, ok=True),
        StatusCode.NOT_FOUND,
        "session_id",
    )
    assert ctx.state()["total"]["stores_dropped"] == 1


# ---- the SDK: caller mistakes raise before anything is sent ----------------------------------


@pytest.fixture
def client(daemon: DaemonProcess, transport: str) -> Iterator[kvtier.Client]:
    with kvtier.Client.connect(
        daemon.address(transport), transport=transport, timeout_s=TIMEOUT_S, heartbeat=False
    ) as c:
        assert c.connected
        yield c


def figures(client: kvtier.Client) -> dict[str, Any]:
    s = client.stats()
    return {
        "total": s["total"],
        "writing": s["writing_blocks"],
        "pinned": s["pinned_blocks"],
        "used": s["host_used_bytes"],
    }


def test_put_with_a_wrong_sized_block_stores_nothing(client: kvtier.Client) -> None:
    ns = client.register(make_namespace())
    ks = ns.block_keys(list(range(48)))  # 3 blocks
    good = bytes(ns.block_bytes)
    before = figures(client)
    for blocks, what in [
        ([good, bytes(ns.block_bytes - 1), good], "block 1 has"),
        ([good, good, bytes(ns.block_bytes + 1)], "block 2 has"),
        ([good, good], "2 blocks for 3 keys"),
        ([good, good, "not bytes"], "bytes-like"),
    ]:
        with pytest.raises(errors.InvalidArgument) as exc:
            ns.put(ks, blocks)
        assert exc.value.field == "blocks" and what in str(exc.value)
    assert figures(client) == before
    assert ns.lookup(ks) == 0


def test_keys_that_are_not_32_bytes_are_refused(client: kvtier.Client) -> None:
    ns = client.register(make_namespace())
    ks = ns.block_keys(list(range(32)))
    before = figures(client)
    calls: list[Callable[[list[bytes]], object]] = [
        ns.lookup,
        lambda bad: ns.put(bad, [bytes(ns.block_bytes)] * len(bad)),
        ns.get,
    ]
    for bad in (ks[:1] + [ks[1][:31]], [ks[0] + b"\0"], [b""]):
        for call in calls:
            with pytest.raises(errors.InvalidArgument) as exc:
                call(bad)
            assert exc.value.field == "keys"
    assert figures(client) == before


def test_a_key_that_is_not_bytes_is_refused(client: kvtier.Client) -> None:
    ns = client.register(make_namespace())
    with pytest.raises(errors.InvalidArgument) as exc:
        ns.lookup(["k" * 32])  # type: ignore[list-item]
    assert exc.value.field == "keys"


def test_get_into_checks_the_buffers(client: kvtier.Client) -> None:
    import numpy as np

    ns = client.register(make_namespace())
    ks = ns.block_keys(list(range(32)))
    assert ns.put(ks, [bytes([7]) * ns.block_bytes] * 2).stored == 2
    before = figures(client)
    bad_buffers: list[tuple[list[Any], str]] = [
        ([bytearray(ns.block_bytes), bytearray(ns.block_bytes - 2)], "buffer 1 has"),
        ([bytearray(ns.block_bytes)], "1 buffers for 2 keys"),
        ([bytes(ns.block_bytes), bytearray(ns.block_bytes)], "read-only"),
        ([bytearray(ns.block_bytes), np.zeros((2, ns.block_bytes), np.uint8)[:, 0]], "contiguous"),
        ([bytearray(ns.block_bytes), None], "bytes-like"),
    ]
    for buffers, what in bad_buffers:
        with pytest.raises(errors.InvalidArgument) as exc:
            ns.get_into(ks, buffers)
        assert exc.value.field == "buffers" and what in str(exc.value), str(exc.value)
    # nothing was pinned, nothing loaded
    assert figures(client) == before
    out = [bytearray(ns.block_bytes) for _ in ks]
    assert ns.get_into(ks, out) == [True, True] and out[1] == bytes([7]) * ns.block_bytes


def test_register_wants_a_namespace(client: kvtier.Client) -> None:
    for bad in (make_namespace().to_dict(), "test/model", None):
        with pytest.raises(errors.InvalidArgument) as exc:
            client.register(bad)  # type: ignore[arg-type]
        assert exc.value.field == "namespace"
    assert client.stats()["namespaces"] == []


def test_an_unknown_transport_is_refused(daemon: DaemonProcess) -> None:
    with pytest.raises(errors.InvalidArgument) as exc:
        kvtier.Client(daemon.grpc, "udp", heartbeat=False)  # type: ignore[arg-type]
    assert exc.value.field == "transport"


# ---- the TCP data channel -------------------------------------------------------------------


def data_socket(daemon: DaemonProcess) -> socket.socket:
    host, _, port = daemon.info["data"].rpartition(":")
    return socket.create_connection((host, int(port)), timeout=TIMEOUT_S)


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, f"connection closed after {len(buf)} of {n} bytes"
        buf += chunk
    return buf


def recv_frame(s: socket.socket) -> tuple[Op, int, int, int, bytes]:
    op, job, index, status, length = wire.unpack(recv_exact(s, wire.HEADER.size))
    return op, job, index, status, recv_exact(s, length)


def expect_error_and_close(s: socket.socket, message: str) -> None:
    op, _job, _index, _status, body = recv_frame(s)
    assert op is Op.ERROR and message in body.decode(), body
    assert s.recv(1) == b""  # the daemon closed the connection


def hello(s: socket.socket, session_id: int) -> None:
    s.sendall(wire.hello(session_id, DATA_SECRETS[session_id]))
    assert recv_frame(s)[:2] == (Op.HELLO_OK, session_id)


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        (b"GARBAGE!" * 4, "bad frame magic"),
        (b"KVD0" + bytes(28), "bad frame magic"),
        (wire.HEADER.pack(wire.MAGIC, 99, 0, 0, 0, 0), "unknown frame op"),
        (wire.pack(Op.WRITE, 1, 0, length=0), "HELLO first"),
        (wire.hello(UNKNOWN_SESSION, bytes(32)), "unknown session or wrong data secret"),
        (wire.pack(Op.HELLO, UNKNOWN_SESSION), "data secret"),
    ],
)
def test_data_channel_garbage_gets_an_error_frame_and_a_close(
    daemon: DaemonProcess, ctx: Ctx, frames: bytes, message: str
) -> None:
    ctx.store(1)
    before = ctx.state()
    with data_socket(daemon) as s:
        s.sendall(frames)
        expect_error_and_close(s, message)
    assert ctx.state() == before
    # the daemon keeps serving, the data channel included
    with data_socket(daemon) as s:
        hello(s, ctx.session_id)
    assert ctx.lookup(1) == 1


def test_a_session_id_without_its_data_secret_binds_no_data_connection(
    daemon: DaemonProcess, ctx: Ctx
) -> None:
    """The session id is in every control request; the data channel takes only the secret
    handed out with the session: a live id with another secret is answered as an unknown one,
    and a bound connection cannot move to another session."""
    sid = ctx.tcp_session_id
    wrong = bytes(b ^ 1 for b in DATA_SECRETS[sid])
    with data_socket(daemon) as s:
        s.sendall(wire.hello(sid, wrong))
        expect_error_and_close(s, "unknown session or wrong data secret")
    with data_socket(daemon) as s:
        hello(s, ctx.session_id)
        s.sendall(wire.hello(sid, DATA_SECRETS[sid]))
        expect_error_and_close(s, "unknown session or wrong data secret")
    with data_socket(daemon) as s:
        hello(s, sid)  # the right one still binds


def test_data_channel_refuses_a_reply_op_from_the_client(daemon: DaemonProcess, ctx: Ctx) -> None:
    with data_socket(daemon) as s:
        hello(s, ctx.session_id)
        s.sendall(wire.pack(Op.ACK, 1))
        expect_error_and_close(s, "unexpected op")


def test_data_channel_write_of_the_wrong_length_is_reported_and_not_committed(
    daemon: DaemonProcess, ctx: Ctx
) -> None:
    bb = ctx.block_bytes
    prep = ctx.prepare_store(1, 2, transport=pb.TRANSPORT_TCP)
    job = prep.job_id
    assert list(prep.status) == [pb.STORE_RESERVED] * 2
    with data_socket(daemon) as s:
        hello(s, ctx.tcp_session_id)
        s.sendall(wire.pack(Op.WRITE, job, 0, length=bb) + b"\1" * bb)
        s.sendall(wire.pack(Op.WRITE, job, 1, length=bb - 1) + b"\2" * (bb - 1))
        s.sendall(wire.pack(Op.FLUSH, job))
        assert recv_frame(s)[:4] == (Op.ACK, job, 0, Status.BAD_LENGTH)
        # the error was reported once; the connection stays usable
        s.sendall(wire.pack(Op.FLUSH, job))
        assert recv_frame(s)[:4] == (Op.ACK, job, 0, Status.OK)
    done = ctx.call(
        "CompleteStore", pb.CompleteStoreRequest(session_id=ctx.tcp_session_id, job_id=job, ok=True)
    )
    # key 2's bytes never arrived whole: aborted although the client said ok
    assert (done.committed, done.aborted) == (1, 1)
    assert ctx.lookup(1) == 1 and ctx.lookup(2) == 0
    total = ctx.state()["total"]
    assert (total["stores_accepted"], total["stores_dropped"]) == (1, 1)
    assert total["bytes_in_tcp"] == bb


@pytest.mark.parametrize(
    ("index_of", "status"),
    [
        (lambda job: (job, 5), Status.BAD_INDEX),  # not a key of the job
        (lambda job: (job + 1000, 0), Status.UNKNOWN_JOB),
    ],
)
def test_data_channel_write_outside_a_job_is_reported(
    daemon: DaemonProcess, ctx: Ctx, index_of: Callable[[int], tuple[int, int]], status: Status
) -> None:
    bb = ctx.block_bytes
    prep = ctx.prepare_store(1, transport=pb.TRANSPORT_TCP)
    job, index = index_of(prep.job_id)
    with data_socket(daemon) as s:
        hello(s, ctx.tcp_session_id)
        s.sendall(wire.pack(Op.WRITE, job, index, length=bb) + b"\3" * bb)
        s.sendall(wire.pack(Op.FLUSH, job))
        assert recv_frame(s)[:4] == (Op.ACK, job, 0, status)
    done = ctx.call(
        "CompleteStore", pb.CompleteStoreRequest(session_id=ctx.tcp_session_id, job_id=prep.job_id, ok=True)
    )
    assert (done.committed, done.aborted) == (0, 1)  # its own key never got bytes
    assert ctx.lookup(1) == 0


def test_data_channel_write_into_another_sessions_job(daemon: DaemonProcess, ctx: Ctx) -> None:
    bb = ctx.block_bytes
    other = ctx.open_session(pb.TRANSPORT_TCP)
    prep = ctx.prepare_store(1, session_id=other, transport=pb.TRANSPORT_TCP)
    with data_socket(daemon) as s:
        hello(s, ctx.tcp_session_id)  # not the job's session
        s.sendall(wire.pack(Op.WRITE, prep.job_id, 0, length=bb) + b"\4" * bb)
        s.sendall(wire.pack(Op.FLUSH, prep.job_id))
        assert recv_frame(s)[:4] == (Op.ACK, prep.job_id, 0, Status.UNKNOWN_JOB)
    done = ctx.call("CompleteStore", pb.CompleteStoreRequest(session_id=other, job_id=prep.job_id, ok=True))
    assert (done.committed, done.aborted) == (0, 1)


def test_data_channel_empty_write_of_a_reserved_key_is_reported(daemon: DaemonProcess, ctx: Ctx) -> None:
    prep = ctx.prepare_store(1, transport=pb.TRANSPORT_TCP)
    with data_socket(daemon) as s:
        hello(s, ctx.tcp_session_id)
        s.sendall(wire.pack(Op.WRITE, prep.job_id, 0, length=0))
        s.sendall(wire.pack(Op.FLUSH, prep.job_id))
        assert recv_frame(s)[:4] == (Op.ACK, prep.job_id, 0, Status.BAD_LENGTH)


def test_data_channel_read_of_a_store_job_is_refused(daemon: DaemonProcess, ctx: Ctx) -> None:
    prep = ctx.prepare_store(1, transport=pb.TRANSPORT_TCP)
    with data_socket(daemon) as s:
        hello(s, ctx.tcp_session_id)
        s.sendall(wire.pack(Op.READ, prep.job_id))
        expect_error_and_close(s, "job_id")
    assert ctx.state()["writing_blocks"] == 1  # the job itself is untouched


# ---- runs (FEATURE_RUNS): many blocks under one header ---------------------------------------


def hello_runs(s: socket.socket, session_id: int) -> int:
    s.sendall(wire.hello(session_id, DATA_SECRETS[session_id], wire.FEATURE_RUNS))
    op, sid, _index, status, _body = recv_frame(s)
    assert (op, sid) == (Op.HELLO_OK, session_id)
    return status


def test_a_run_round_trips_and_a_daemon_accepts_the_feature(daemon: DaemonProcess, ctx: Ctx) -> None:
    bb = ctx.block_bytes
    prep = ctx.prepare_store(1, 2, 3, transport=pb.TRANSPORT_TCP)
    with data_socket(daemon) as s:
        assert hello_runs(s, ctx.tcp_session_id) & wire.FEATURE_RUNS
        s.sendall(
            wire.pack(Op.WRITE_RUN, prep.job_id, 0, status=3, length=3 * bb)
            + b"\1" * bb
            + b"\2" * bb
            + b"\3" * bb
        )
        s.sendall(wire.pack(Op.FLUSH, prep.job_id))
        assert recv_frame(s)[:4] == (Op.ACK, prep.job_id, 0, Status.OK)
    done = ctx.call(
        "CompleteStore", pb.CompleteStoreRequest(session_id=ctx.tcp_session_id, job_id=prep.job_id, ok=True)
    )
    assert done.committed == 3 and ctx.lookup(1, 2, 3) == 3


def test_a_run_is_refused_unless_the_feature_was_agreed(daemon: DaemonProcess, ctx: Ctx) -> None:
    bb = ctx.block_bytes
    prep = ctx.prepare_store(1, 2, transport=pb.TRANSPORT_TCP)
    with data_socket(daemon) as s:
        hello(s, ctx.tcp_session_id)  # no features offered
        s.sendall(wire.pack(Op.WRITE_RUN, prep.job_id, 0, status=2, length=2 * bb) + bytes(2 * bb))
        op, _job, _index, _status, body = recv_frame(s)
        assert op is Op.ERROR and b"WRITE_RUN" in body, body
        try:  # closed; with the run's bytes still unread the close may come as a reset
            assert s.recv(1) == b""
        except ConnectionResetError:
            pass
    assert ctx.lookup(1) == 0


@pytest.mark.parametrize(
    ("count", "length_of", "status"),
    [
        (0, lambda bb: bb, Status.BAD_LENGTH),  # a run of no blocks
        (2, lambda bb: 2 * bb - 1, Status.BAD_LENGTH),  # not a whole number of blocks
        (2, lambda bb: 2 * bb + 2, Status.BAD_LENGTH),  # parts of the wrong size
        (3, lambda bb: 3 * bb, Status.BAD_INDEX),  # reaches past the job's reserved keys
    ],
)
def test_a_bad_run_is_reported_and_nothing_of_it_committed(
    daemon: DaemonProcess, ctx: Ctx, count: int, length_of: Callable[[int], int], status: Status
) -> None:
    bb = ctx.block_bytes
    prep = ctx.prepare_store(1, 2, transport=pb.TRANSPORT_TCP)
    length = length_of(bb)
    with data_socket(daemon) as s:
        hello_runs(s, ctx.tcp_session_id)
        s.sendall(wire.pack(Op.WRITE_RUN, prep.job_id, 0, status=count, length=length) + b"\7" * length)
        s.sendall(wire.pack(Op.FLUSH, prep.job_id))
        assert recv_frame(s)[:4] == (Op.ACK, prep.job_id, 0, status)
    done = ctx.call(
        "CompleteStore", pb.CompleteStoreRequest(session_id=ctx.tcp_session_id, job_id=prep.job_id, ok=True)
    )
    assert done.committed == 0 and ctx.lookup(1) == 0
