"""Refusals around KV events. Settings: events on without pyzmq, or with a bad endpoint, are
refused at start naming the setting. PrepareStore's optional token ids and parent key: checked
by a real daemon whether events are on or not. A wrong count or a parent that is not a key is INVALID_ARGUMENT
naming the field, and nothing changes (Stats before and after are equal); right ones reserve as
before. The control channels carry the same message, so they check the same way."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import DaemonProcess, make_namespace
from tests_helpers import serve_cmd, serve_exits

from kvtier_contract.protoutil import to_dict
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtier_contract.v1 import kvtier_pb2_grpc as pb_grpc


def keys(*ids: int) -> bytes:
    return b"".join(i.to_bytes(32, "big") for i in ids)


def test_token_ids_and_parent_key_are_checked_and_a_refusal_changes_nothing(daemon: DaemonProcess) -> None:
    with grpc.insecure_channel(daemon.grpc) as channel:
        stub = pb_grpc.KvtierStub(channel)
        ns = make_namespace()  # 16 tokens a block
        spec = pb.NamespaceSpec(**{k: v for k, v in ns.to_dict().items() if v is not None})
        reg = stub.RegisterNamespace(pb.RegisterNamespaceRequest(spec=spec, digest=ns.digest), timeout=5)
        sid = stub.OpenSession(
            pb.OpenSessionRequest(client_name="origin", lease_ttl_ms=60_000, transport=pb.TRANSPORT_SHM),
            timeout=5,
        ).session_id

        def state() -> dict[str, Any]:
            d = to_dict(stub.Stats(pb.StatsRequest(), timeout=5))
            del d["uptime_s"]
            return d

        def prepare(**kw: Any) -> Any:
            return stub.PrepareStore(
                pb.PrepareStoreRequest(
                    session_id=sid,
                    namespace_id=reg.namespace_id,
                    keys=keys(1, 2),
                    transport=pb.TRANSPORT_SHM,
                    **kw,
                ),
                timeout=5,
            )

        for bad, field in (
            ({"token_ids": list(range(31))}, "token_ids"),
            ({"token_ids": list(range(48))}, "token_ids"),
            ({"parent_key": b"\x01" * 31}, "parent_key"),
        ):
            before = state()
            with pytest.raises(grpc.RpcError) as err:
                prepare(**bad)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (err.value.details() or "").startswith(f"{field}: "), err.value.details()
            assert state() == before
        ok = prepare(token_ids=list(range(32)), parent_key=b"\x07" * 32)
        assert ok.job_id and list(ok.status) == [pb.STORE_RESERVED] * 2


def serve(run: Path, *args: str, pythonpath: str = "") -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    run.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        serve_cmd(run, "--host-bytes", "64MiB", "--slab-bytes", "1MiB", *args),
        cwd=run,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_events_without_pyzmq_are_refused_at_start_naming_the_setting(tmp_path: Path) -> None:
    fake = tmp_path / "nozmq" / "zmq"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named zmq (test)')\n")
    out = serve(
        tmp_path / "run", "--events-endpoint", f"ipc://{tmp_path}/ev.sock", pythonpath=str(fake.parent)
    )
    assert out.returncode == 2, out.stderr
    assert "events_endpoint: KV events need pyzmq and msgpack" in out.stderr, out.stderr
    assert "whl[events]" in out.stderr and "(--events-endpoint)" in out.stderr


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("--events-endpoint", "tcp://0.0.0.0:5557"), "events_endpoint"),
        (("--events-endpoint", "tcp://127.0.0.1:5557"), "events_endpoint"),  # every local user
        (("--events-endpoint", "ipc:///tmp/e.sock", "--events-socket-mode", "400"), "events_socket_mode"),
        (
            ("--events-endpoint", "ipc:///tmp/e.sock", "--events-buffer-bytes", "1MiB"),
            "events_buffer_bytes",  # below a stream's 4 MiB
        ),
        (("--events-endpoint", "udp://x"), "events_endpoint"),
        (("--events-tenant-endpoint", "ipc:///tmp/ev.sock"), "events_tenant_endpoint"),
        (("--events-endpoint", "ipc:///tmp/e.sock", "--events-buffer-batches", "0"), "events_buffer_batches"),
    ],
)
def test_bad_event_settings_are_refused_naming_the_field(
    tmp_path: Path, args: tuple[str, ...], field: str
) -> None:
    out = serve(tmp_path / "run", *args)
    assert out.returncode == 2, out.stderr
    assert f"configuration error: {field}: " in out.stderr, out.stderr


def test_a_tenant_stream_naming_the_grpc_socket_through_a_symlink_is_refused_at_start(tmp_path: Path) -> None:
    """Events bind before gRPC: a tenant ``kvtier`` whose stream path is the gRPC socket through
    a symlinked directory was bound, then replaced by gRPC (the stream lost, nothing logged).
    Now the start is refused, naming the setting."""
    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "alias").symlink_to(run)
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(
        "".join(
            f'[[tenant]]\nname = "{n}"\ntokens_sha256 = ["{c * 64}"]\n\n'
            for n, c in (("team-a", "a"), ("kvtier", "b"))
        )
    )
    out = serve_exits(
        run,
        "--host-bytes",
        "64MiB",
        "--slab-bytes",
        "1MiB",
        "--tenants-file",
        str(tenants),
        "--events-tenant-endpoint",
        f"ipc://{tmp_path}/alias/{{tenant}}.sock",
    )
    assert out.returncode == 2, out.stderr
    assert "events_tenant_endpoint" in out.stderr and "the daemon's own sockets" in out.stderr, out.stderr
