"""ClientSettings (kvtier.settings): the SDK's settings as data; a Client uses a Session built from
them; the batch operations use only the SessionPort of a session."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import kvtier
from kvtier.calls import SessionPort
from kvtier.session import Session
from kvtier.settings import ClientSettings
from kvtier_contract import errors

KVTIER = Path(kvtier.__file__).parent


def test_the_defaults_are_the_clients_and_every_field_is_documented() -> None:
    s = ClientSettings()
    assert (s.transport, s.timeout_s, s.lease_ttl_s, s.op_timeout_s, s.backoff_s) == (
        "shm",
        1.0,
        10.0,
        30.0,
        (0.05, 1.0),
    )
    assert s.probe_s == 0.5 and ClientSettings(timeout_s=0.2).probe_s == 0.2
    assert (s.heartbeat, s.local_lookups, s.verify_bytes, s.control_channel, s.pipeline_bytes) == (
        True,
        True,
        True,
        True,
        0,
    )
    source = (KVTIER / "settings.py").read_text()
    for f in dataclasses.fields(ClientSettings):  # a docstring under each field
        assert f"    {f.name}: " in source
        after = source.split(f"    {f.name}: ", 1)[1].split("\n", 2)[1]
        assert after.strip().startswith('"""'), f.name


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"transport": "rdma"}, "transport"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"lease_ttl_s": -1.0}, "lease_ttl_s"),
        ({"op_timeout_s": 0.0}, "op_timeout_s"),
        ({"probe_timeout_s": -0.1}, "probe_timeout_s"),
        ({"backoff_s": (1.0, 0.5)}, "backoff_s"),
        ({"pipeline_bytes": -1}, "pipeline_bytes"),
    ],
)
def test_a_bad_value_names_its_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(errors.InvalidArgument) as e:
        ClientSettings(**changes)  # type: ignore[arg-type]
    assert e.value.field == field


def test_secrets_stay_out_of_the_repr() -> None:
    text = repr(ClientSettings(token="s3cret", tenant_key=b"k3y"))
    assert "s3cret" not in text and "k3y" not in text


def test_a_clients_keyword_arguments_are_its_settings(tmp_path: Path) -> None:
    address = f"unix://{tmp_path}/none.sock"  # never connected: the client is only built
    c = kvtier.Client(address, "tcp", timeout_s=0.3, heartbeat=False, client_name="x")
    try:
        assert not isinstance(c, Session) and isinstance(c.session, Session)
        assert c.settings == ClientSettings(transport="tcp", timeout_s=0.3, heartbeat=False, client_name="x")
        assert c.session.settings is c.settings and c.session.connection.settings is c.settings  # one
        c.pipeline_bytes = 1 << 20  # settable per client, as before
        assert c.session.pipeline_bytes == 1 << 20
    finally:
        c.close()
    with pytest.raises(TypeError, match="no_such"):
        kvtier.Client(address, no_such=1)
    with pytest.raises(TypeError):
        kvtier.Client(address, settings=ClientSettings(), timeout_s=2.0)  # one or the other
    same = kvtier.Client(address, settings=ClientSettings(transport="tcp", heartbeat=False))
    try:
        assert same.settings.transport == "tcp"
    finally:
        same.close()


def test_the_batch_operations_use_only_the_session_port() -> None:
    port = {name for name in dir(SessionPort) if not name.startswith("__")}
    for module in ("batches.py", "batch_jobs.py", "batch_store.py", "batch_load.py"):
        tree = ast.parse((KVTIER / module).read_text())
        used = {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "session"
        }
        used |= {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "session"
        }
        assert used, module
        assert used <= port, (module, used - port)
