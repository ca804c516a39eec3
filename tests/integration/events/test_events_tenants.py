"""KV events per tenant: a tenant's stream carries its own blocks and nothing else.

A real daemon with a tenants file publishes an operator stream (every tenant's blocks, each
event with its ``tenant_id``) and one ipc:// stream per tenant. Tenants A and B store; A's
subscriber receives every key of A and not one key of B (and B's the converse); the operator's
receives both; the tenant sockets are owner-only files.
"""

from __future__ import annotations

import hashlib
import signal
import stat
from pathlib import Path
from typing import Any

import pytest
from conftest import make_namespace
from tests_helpers import event_streams, wait_for

import kvtier

pytest.importorskip("zmq")
pytest.importorskip("msgpack")
from events_follower import Follower  # noqa: E402  (needs pyzmq and msgpack)

TOKENS = {"team-a": "tok-a-e1", "team-b": "tok-b-e2"}


def tenants_toml(path: Path) -> Path:
    path.write_text(
        "".join(
            f'[[tenant]]\nname = "{n}"\ntokens_sha256 = ["{hashlib.sha256(t.encode()).hexdigest()}"]'
            '\ntransports = ["tcp"]\n\n'
            for n, t in TOKENS.items()
        )
    )
    return path


def test_a_tenants_subscriber_never_sees_another_tenants_keys(daemon_factory: Any, tmp_path: Path) -> None:
    d = daemon_factory(
        "--host-bytes",
        "64MiB",
        "--slab-bytes",
        "1MiB",
        "--tenants-file",
        str(tenants_toml(tmp_path / "tenants.toml")),
        *event_streams(tmp_path),
        run_dir=tmp_path / "run",
    )
    for name in ("ev-team-a.sock", "ev-team-b.sock", "replay-team-a.sock"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
    follow = {
        t: Follower(f"ipc://{tmp_path}/ev-{t}.sock", f"ipc://{tmp_path}/replay-{t}.sock") for t in TOKENS
    }
    operator = Follower(f"ipc://{tmp_path}/ev.sock", f"ipc://{tmp_path}/replay.sock")
    keys: dict[str, list[bytes]] = {}
    try:
        for t, token in TOKENS.items():
            with kvtier.Client.connect(d.unix, transport="tcp", token=token) as c:
                ns = c.register(make_namespace(tenant=t))
                # the same tokens in both tenants: different keys (the tenant is in the key)
                keys[t] = ns.block_keys(list(range(16 * 24)))
                assert ns.put(keys[t], [bytes(ns.block_bytes)] * 24).stored == 24
        a, b = set(keys["team-a"]), set(keys["team-b"])
        assert not a & b
        follow["team-a"].settle(lambda: set(follow["team-a"].held) >= a)
        follow["team-b"].settle(lambda: set(follow["team-b"].held) >= b)
        operator.settle(lambda: set(operator.held) >= a | b)
        for f in (*follow.values(), operator):
            f.pump(0.3)  # anything still on its way
        assert set(follow["team-a"].held) == a  # all of A's, none of B's
        assert set(follow["team-b"].held) == b
        assert follow["team-a"].tenants == {"team-a"}
        assert follow["team-b"].tenants == {"team-b"}
        assert operator.tenants == {"team-a", "team-b"}
        # a late joiner of A's stream replays A's history only
        late = Follower(f"ipc://{tmp_path}/ev-team-a.sock", f"ipc://{tmp_path}/replay-team-a.sock")
        try:
            with kvtier.Client.connect(d.unix, transport="tcp", token=TOKENS["team-b"]) as c:
                ns = c.register(make_namespace(tenant="team-b"))
                more = ns.block_keys(list(range(1000, 1000 + 16 * 4)))
                ns.put(more, [bytes(ns.block_bytes)] * 4)
            with kvtier.Client.connect(d.unix, transport="tcp", token=TOKENS["team-a"]) as c:
                ns = c.register(make_namespace(tenant="team-a"))
                mine = ns.block_keys(list(range(2000, 2000 + 16 * 4)))
                ns.put(mine, [bytes(ns.block_bytes)] * 4)
            late.settle(lambda: set(late.held) >= a | set(mine))
            assert not set(late.held) & (b | set(more))
        finally:
            late.close()
    finally:
        for f in (*follow.values(), operator):
            f.close()


def test_a_tenant_added_by_a_reload_gets_a_private_stream_and_never_the_daemons_socket(
    daemon_factory: Any, tmp_path: Path
) -> None:
    """The template puts tenant streams beside the gRPC socket (``{run}/{tenant}.sock``): a
    reload adding tenant "kvtier" would make its path the gRPC socket's, which libzmq unlinks
    at bind. It gets no stream, engines still connect; tenant "team-c" added alongside gets its
    stream at the reload, 0600 from the start (bound private, renamed into place)."""
    run = tmp_path / "run"
    toml = tenants_toml(tmp_path / "tenants.toml")
    d = daemon_factory(
        "--host-bytes",
        "64MiB",
        "--slab-bytes",
        "1MiB",
        "--tenants-file",
        str(toml),
        "--events-tenant-endpoint",
        f"ipc://{run}/{{tenant}}.sock",
        run_dir=run,
    )
    assert stat.S_IMODE((run / "team-a.sock").stat().st_mode) == 0o600
    more = {"kvtier": "tok-k-e3", "team-c": "tok-c-e4"}
    with toml.open("a") as f:
        for n, t in more.items():
            f.write(
                f'[[tenant]]\nname = "{n}"\ntokens_sha256 = ["{hashlib.sha256(t.encode()).hexdigest()}"]\n\n'
            )
    assert d.proc is not None
    d.proc.send_signal(signal.SIGHUP)
    wait_for("team-c's stream", lambda: (run / "team-c.sock").exists())
    assert stat.S_IMODE((run / "team-c.sock").stat().st_mode) == 0o600
    for name, token in (("kvtier", more["kvtier"]), ("team-a", TOKENS["team-a"])):
        with kvtier.Client.connect(d.unix, transport="tcp", token=token) as c:  # gRPC still the daemon's
            ns = c.register(make_namespace(tenant=name))
            assert ns.put(ns.block_keys(list(range(16))), [bytes(ns.block_bytes)]).stored == 1
    assert stat.S_ISSOCK((run / "kvtier.sock").stat().st_mode)
    assert not [p.name for p in run.iterdir() if p.name.startswith(".kv")]  # no private dir left


def test_a_groups_blocks_go_on_the_groups_own_stream(daemon_factory: Any, tmp_path: Path) -> None:
    """A group of tenants (issue 43) has a stream of its own, named as a tenant's: its blocks
    (``tenant_id`` the group) go there and on the operator's, never on a member's stream, so a
    member's router that credits the group's shared prompt follows the group's stream too."""
    path = tenants_toml(tmp_path / "tenants.toml")
    path.write_text(
        path.read_text() + '[[group]]\nname = "shared"\npublishers = ["team-a"]\nmembers = ["team-b"]\n'
    )
    d = daemon_factory(
        "--host-bytes", "64MiB", "--slab-bytes", "1MiB", "--tenants-file", str(path),
        *event_streams(tmp_path), run_dir=tmp_path / "run",
    )  # fmt: skip
    group = Follower(f"ipc://{tmp_path}/ev-shared.sock", f"ipc://{tmp_path}/replay-shared.sock")
    member = Follower(f"ipc://{tmp_path}/ev-team-b.sock", f"ipc://{tmp_path}/replay-team-b.sock")
    try:
        with kvtier.Client.connect(d.unix, transport="tcp", token=TOKENS["team-a"]) as c:
            ns = c.register(make_namespace(group="shared"))
            keys = ns.block_keys(list(range(16 * 8)))
            assert ns.put(keys, [bytes(ns.block_bytes)] * 8).stored == 8
        group.settle(lambda: set(group.held) >= set(keys))
        member.pump(0.3)
        assert group.tenants == {"shared"} and set(group.held) == set(keys)
        assert not set(member.held) & set(keys)
    finally:
        group.close()
        member.close()
