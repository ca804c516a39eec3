"""DaemonConfig: data validated once; every bad value is a ValueError that names its field."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from kvtierd.config import DaemonConfig, flat_keys, load_config, with_overrides

GIB, MIB = 1 << 30, 1 << 20


def test_the_embedded_default_is_valid() -> None:
    cfg = DaemonConfig()
    assert cfg.host_tier.host_bytes == GIB and cfg.host_tier.slab_bytes == 64 * MIB
    assert cfg.host_tier.eviction_policy == "prefix"
    assert cfg.shm_socket_path == "run/kvtier.sock.shm"
    assert load_config(None) == cfg


def test_the_local_default_is_private(tmp_path: Path) -> None:
    """``make serve``: gRPC on an owner-only Unix socket and on no TCP port (loopback TCP lets
    every local user in); the data channel needs a session's secret from that socket."""
    cfg = DaemonConfig()
    assert cfg.grpc.socket_path == "run/kvtier.sock" and cfg.grpc.socket_mode == 0o600
    assert cfg.grpc.listen == ""
    assert cfg.transports.data_listen == "127.0.0.1:0" and cfg.metrics.metrics_host == "127.0.0.1"
    path = tmp_path / "k.toml"
    path.write_text("socket_mode = 0o660\n")  # a DaemonSet's engines of the daemon's group
    assert load_config(path).grpc.socket_mode == 0o660
    from kvtierd.cli import build_parser

    assert build_parser().parse_args(["serve", "--socket-mode", "660"]).socket_mode == 0o660
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--socket-mode", "rw-rw----"])


def test_the_shm_socket_sits_beside_the_grpc_socket() -> None:
    assert DaemonConfig.from_flat(socket_path="/x/k.sock").shm_socket_path == "/x/k.sock.shm"
    cfg = DaemonConfig.from_flat(socket_path="", listen="127.0.0.1:1", run_dir="/r")
    assert cfg.shm_socket_path == "/r/kvtier.sock.shm"


BAD: list[tuple[str, dict[str, Any]]] = [
    ("slot_align_bytes", {"slot_align_bytes": 3000}),
    ("slot_align_bytes", {"slot_align_bytes": 0}),
    ("slab_bytes", {"slab_bytes": 4096 * 3 + 1}),
    ("slab_bytes", {"slab_bytes": 2048}),  # smaller than the alignment
    ("host_bytes", {"host_bytes": 32 * MIB}),  # less than one 64 MiB slab
    ("eviction_policy", {"eviction_policy": "fifo"}),
    ("min_lease_ttl_s", {"min_lease_ttl_s": 0.0}),
    ("max_lease_ttl_s", {"max_lease_ttl_s": 0.1}),  # below min_lease_ttl_s = 0.2
    ("lease_ttl_s", {"lease_ttl_s": 0.1}),
    ("lease_ttl_s", {"lease_ttl_s": 301.0}),
    ("lease_ttl_s", {"lease_ttl_s": float("nan")}),
    ("lease_sweep_s", {"lease_sweep_s": 0}),
    ("max_batch_blocks", {"max_batch_blocks": 0}),
    ("max_batch_blocks", {"max_batch_blocks": 65537}),
    ("max_sessions", {"max_sessions": 0}),
    ("max_namespaces", {"max_namespaces": 0}),
    ("metrics_port", {"metrics_port": -2}),
    ("metrics_port", {"metrics_port": 65536}),
    ("drain_timeout_s", {"drain_timeout_s": -1.0}),
    ("listen", {"listen": "127.0.0.1"}),
    ("listen", {"listen": ":50051"}),
    ("listen", {"listen": "127.0.0.1:99999"}),
    ("listen", {"listen": "", "socket_path": ""}),  # no way to reach the daemon
    ("data_listen", {"data_listen": "localhost:port"}),
    # (metrics_host with tenants: tests/unit/kvtierd/tenancy/test_metrics_exposure.py, once the file is read)
    ("tenant_arena_bytes", {"tenant_arena_bytes": -1}),
    ("shm_handshakes_per_uid", {"shm_handshakes_per_uid": 0}),
    ("data_max_unauthenticated", {"data_max_unauthenticated": 0}),
    ("data_max_connections_per_tenant", {"data_max_connections_per_tenant": -1}),
    ("data_max_connections_per_tenant", {"data_max_connections": 8, "data_max_connections_per_tenant": 9}),
    ("hots_bytes", {"extra": {"hots_bytes": 1}}),  # an unknown key, named
    # wrong types are named too (a config file can hold anything)
    ("host_bytes", {"host_bytes": "1GiB"}),
    ("max_batch_blocks", {"max_batch_blocks": 1.5}),
    ("max_sessions", {"max_sessions": True}),
    ("lease_ttl_s", {"lease_ttl_s": "10"}),
    ("prefault", {"prefault": "no"}),
    ("shm_enabled", {"shm_enabled": 1}),
    ("socket_path", {"socket_path": None}),
    ("socket_mode", {"socket_mode": 0o400}),  # the owner itself could not connect
    ("socket_mode", {"socket_mode": 0o1777}),
    ("socket_mode", {"socket_mode": "0600"}),
]


@pytest.mark.parametrize(("field", "values"), BAD, ids=[f"{f}={v}" for f, v in BAD])
def test_each_bad_field_is_named(field: str, values: dict[str, Any]) -> None:
    with pytest.raises(ValueError) as exc:
        DaemonConfig.from_flat(**values)
    assert str(exc.value).startswith(f"{field}: "), str(exc.value)


def test_good_edge_values_are_accepted() -> None:
    cfg = DaemonConfig.from_flat(
        host_bytes=64 * MIB,
        metrics_port=-1,
        listen="",
        max_batch_blocks=65536,
        lease_ttl_s=5,
        min_lease_ttl_s=5,
        max_lease_ttl_s=5,
        drain_timeout_s=0,
        data_listen="",
        slot_align_bytes=1 << 12,
        slab_bytes=4096,
    )
    assert cfg.sessions.lease_ttl_s == 5 and cfg.host_tier.slab_bytes == 4096


def test_prefix_eviction_is_the_default_and_names_its_field_when_misspelt() -> None:
    assert DaemonConfig().host_tier.eviction_policy == "prefix"  # measured: docs/benchmarks.md §25
    cfg = with_overrides(DaemonConfig(), eviction_policy="lru")
    assert cfg.host_tier.eviction_policy == "lru"
    with pytest.raises(ValueError, match="^eviction_policy: .*'prefix'"):
        with_overrides(cfg, eviction_policy="prefixes")


def test_with_overrides_applies_non_none_values_and_validates() -> None:
    cfg = with_overrides(DaemonConfig(), host_bytes="2GiB", slab_bytes=None, listen="", eviction_policy="arc")
    assert (cfg.host_tier.host_bytes, cfg.host_tier.slab_bytes, cfg.grpc.listen) == (2 * GIB, 64 * MIB, "")
    assert cfg.host_tier.eviction_policy == "arc"
    with pytest.raises(ValueError, match="^eviction_policy: "):
        with_overrides(cfg, eviction_policy="mru")
    with pytest.raises(ValueError, match="^slab_bytes: "):
        with_overrides(cfg, slab_bytes="lots")


def test_load_config_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "kvtierd.toml"
    path.write_text(
        'host_bytes = "1GiB"\nslab-bytes = "16 MiB"\neviction_policy = "arc"\n'
        "lease_ttl_s = 3\nprefault = false\n"
    )
    cfg = load_config(path)
    # sizes parsed, dashes accepted, the rest from the default
    assert (cfg.host_tier.host_bytes, cfg.host_tier.slab_bytes) == (GIB, 16 * MIB)
    assert cfg.host_tier.eviction_policy == "arc" and cfg.sessions.lease_ttl_s == 3
    assert cfg.host_tier.prefault is False
    assert cfg.requests.max_batch_blocks == DaemonConfig().requests.max_batch_blocks


def test_load_config_from_a_kvtierd_table(tmp_path: Path) -> None:
    path = tmp_path / "all.toml"
    path.write_text('[kvtierd]\nhost_bytes = "2GiB"\nslot_align_bytes = "16KiB"\n')
    cfg = load_config(path)
    assert (cfg.host_tier.host_bytes, cfg.host_tier.slot_align_bytes) == (2 * GIB, 16 << 10)


def test_load_config_from_json(tmp_path: Path) -> None:
    path = tmp_path / "kvtierd.json"
    path.write_text(
        json.dumps({"host_bytes": "1GiB", "slab_bytes": 8 * MIB, "max_batch_blocks": 128, "metrics_port": -1})
    )
    cfg = load_config(path)
    assert (cfg.host_tier.host_bytes, cfg.host_tier.slab_bytes) == (GIB, 8 * MIB)
    assert cfg.requests.max_batch_blocks == 128
    assert cfg.metrics.metrics_port == -1


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('{"host_bytes": "1GiB", "hots_bytes": 1}', "hots_bytes"),  # unknown key named
        ('{"host_bytes": "1 GiBs"}', "host_bytes"),  # unparsable size
        ('{"host_bytes": -1}', "host_bytes"),
        ('{"max_batch_blocks": "10"}', "max_batch_blocks"),  # a string where an int belongs
        ('{"eviction_policy": "lfu"}', "eviction_policy"),
        ('{"extra": {}}', "extra"),  # not a settable field
    ],
)
def test_load_config_rejects_bad_files_naming_the_field(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=field):
        load_config(path)


@pytest.mark.parametrize(
    ("name", "text"), [("list.json", "[1, 2]"), ("broken.json", "{"), ("broken.toml", "host_bytes = ")]
)
def test_load_config_rejects_files_that_are_not_a_table(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError):
        load_config(path)


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        DaemonConfig().host_tier.host_bytes = 1  # type: ignore[misc]


def test_a_cluster_needs_a_fleet_key_file_of_32_hex_bytes(tmp_path: Path) -> None:
    """No cluster without a fleet key (it would serve values anyone with write access to the
    cluster planted); the file is read and checked at load, its content never quoted."""
    cfg = tmp_path / "kvtierd.toml"
    key = tmp_path / "fleet.key"
    for body, match in (
        ('cluster = "redis://127.0.0.1:7000"\n', "cluster_fleet_key_file: required with cluster"),
        (
            f'cluster = "redis://127.0.0.1:7000"\ncluster_fleet_key_file = "{tmp_path / "none"}"\n',
            "cluster_fleet_key_file: cannot read",
        ),
        (
            f'cluster = "redis://127.0.0.1:7000"\ncluster_fleet_key_file = "{key}"\n',
            "cluster_fleet_key_file: .* 16 bytes of key; at least 32",
        ),
    ):
        key.write_text("0f" * 16)
        cfg.write_text(body)
        with pytest.raises(ValueError, match=match) as e:
            load_config(cfg)
        assert "0f" * 16 not in str(e.value)
    key.write_text("a5" * 32 + "\n")
    cfg.write_text(cfg.read_text() + 'cluster_realm = "tests"\n')  # no tenants file: a realm
    assert load_config(cfg).cluster_tier.cluster_fleet_key_file == str(key)
    unused = DaemonConfig.from_flat(cluster_fleet_key_file="unused")
    assert unused.cluster_tier.cluster == ""  # no cluster: not read


@pytest.mark.parametrize(
    ("hostport", "loopback"),
    [
        ("127.0.0.1:1", True),
        ("127.8.9.10:1", True),
        ("[::1]:1", True),
        ("localhost:1", True),
        ("127.evil.example:1", False),
        ("127.0.0.1.nip.io:1", False),
        ("0.0.0.0:1", False),
        ("[::]:1", False),
        ("10.0.0.1:1", False),
        ("kvtier:1", False),
    ],
)
def test_the_loopback_check_reads_addresses_not_prefixes(hostport: str, loopback: bool) -> None:
    """Issue 26: any host name starting with "127." passed as loopback (plaintext allowed)."""
    from kvtierd.config import is_loopback

    assert is_loopback(hostport) is loopback


def test_an_optional_client_certificate_is_refused_not_ignored(tmp_path: Path) -> None:
    """Issue 26: with tls_client_ca set and certificates optional, gRPC never asked for one and
    mTLS tenants silently never matched. Now that combination is a config error naming it."""
    from kvtierd.config import DaemonConfig, validate

    for name in ("ca.crt", "s.crt", "s.key"):
        (tmp_path / name).write_text("x")
    tls = dict(
        tls_cert=str(tmp_path / "s.crt"),
        tls_key=str(tmp_path / "s.key"),
        tls_client_ca=str(tmp_path / "ca.crt"),
    )
    with pytest.raises(ValueError, match="tls_client_ca: gRPC does not ask for optional"):
        validate(DaemonConfig.from_flat(**tls))  # type: ignore[arg-type]
    validate(DaemonConfig.from_flat(**tls, tls_require_client_cert=True))  # type: ignore[arg-type]


def test_the_fleet_key_file_has_a_serve_flag(tmp_path: Path) -> None:
    """`kvtierd serve --cluster URL` alone is refused (no fleet key): the key file can be given
    on the command line too, not only in a config file."""

    from kvtierd.cli import build_parser
    from kvtierd.config import DaemonConfig, with_overrides

    key = tmp_path / "fleet.key"
    key.write_text("ab" * 32 + "\n")
    args = build_parser().parse_args(
        ["serve", "--cluster", "redis://127.0.0.1:7000", "--cluster-fleet-key-file", str(key)]
        + ["--cluster-realm", "tests"]
    )
    fields = set(flat_keys())
    cfg = with_overrides(DaemonConfig(), **{k: v for k, v in vars(args).items() if k in fields})
    assert cfg.cluster_tier.cluster_fleet_key_file == str(key)


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    from kvtierd.cli import build_parser

    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([*argv, "--help"])
    assert done.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines: one line of words


def test_serve_help_shows_every_flags_default_from_daemon_config(capsys: pytest.CaptureFixture[str]) -> None:
    """The flags' own defaults are None ("not set": a --config file may set the field); the
    help shows the field's embedded default instead, written as a person writes it."""
    from kvtierd.cli import build_parser, config_default

    text = _help(capsys, "serve")
    for shown in (
        "--host-bytes HOST_BYTES host tier size, e.g. 1GiB (GiB = 2^30 bytes, GB = 10^9) (default: 1GiB)",
        "(largest block), e.g. 64MiB (default: 64MiB)",
        "'' disables) (default: run/kvtier.sock)",
        "its group too) (default: 0600)",
        "--listen LISTEN gRPC TCP HOST:PORT ('' disables); off loopback it needs --tenants-file or "
        "--tls-require-client-cert (and TLS) (default: none)",
        "0 picks one) (default: 9464)",
        "(default: 127.0.0.1:0)",
        "at start (default: prefault = true)",
        "(default: disk_optional = false)",
        "(default: allow_host_bytes_over_available = false)",
        "(default: 4KiB)",
        "(default: write-back)",
        "--eviction-policy {lru,arc,prefix} host tier eviction order (default: prefix)",
        "(default: 10.0)",
    ):
        assert shown in text, shown
    serve = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    fields = set(flat_keys())
    parser = serve.choices["serve"]
    flags = [a for a in parser._actions if a.dest in fields]
    assert len(flags) >= 30
    for a in flags:  # every flag that sets a field says its default
        said = parser._get_formatter()._get_help_string(a)  # type: ignore[attr-defined]
        assert said is not None and said.endswith(f"(default: {config_default(a.dest)})"), said


def test_the_new_flags_set_their_fields() -> None:
    from kvtierd.cli import build_parser

    args = build_parser().parse_args(["serve", "--disk-optional", "--allow-host-bytes-over-available"])
    assert args.disk_optional is True and args.allow_host_bytes_over_available is True
    cfg = with_overrides(
        DaemonConfig(),
        disk_optional=args.disk_optional,
        allow_host_bytes_over_available=args.allow_host_bytes_over_available,
    )
    assert cfg.nvme_tier.disk_optional and cfg.host_tier.allow_host_bytes_over_available
    assert not DaemonConfig().nvme_tier.disk_optional
    assert not DaemonConfig().host_tier.allow_host_bytes_over_available


def test_fsck_help_says_what_it_does_its_exit_codes_and_that_it_refuses_a_live_daemon(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = _help(capsys, "fsck")
    assert "offline, read-only" in text and "slot by slot" in text
    assert "exit status: 0 clean, 1 problems found, 2 unusable directory" in text
    assert "3 refused: a live daemon holds the directory" in text
    assert "It refuses a directory a live daemon holds" in text
    assert "--progress-interval SECONDS" in text and "--max-problems" in text


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--disk-dir", "X"], "disk_bytes: must be > 0 with disk_dir (--disk-bytes)"),
        (["--listen", "127.0.0.1:99999"], "listen: expected HOST:PORT with a port in 0..65535"),
        (
            ["--config", "/nonexistent/kvtierd.toml"],
            "config: cannot read /nonexistent/kvtierd.toml: No such file or directory (--config)",
        ),
        (
            ["--tenants-file", "/nonexistent/t.toml"],
            "tenants_file: cannot read /nonexistent/t.toml: No such file or directory (--tenants-file)",
        ),
    ],
)
def test_serve_configuration_errors_name_the_flag_in_one_line(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvtierd.cli import main

    assert main(["serve", "--socket", "/nonexistent/k.sock", "--metrics-port", "-1", *argv]) == 2
    err = capsys.readouterr().err
    assert err == f"kvtierd serve: configuration error: {says}" + err.split(says, 1)[1]
    assert err.count("\n") == 1, err


@pytest.mark.parametrize(
    "values",
    [
        {"listen": "0.0.0.0:50051"},  # TLS proves the daemon to its clients, not them to it
        {"listen": "10.0.0.5:50051"},
        {"listen": "", "data_listen": "0.0.0.0:50053"},
        {"listen": "127.0.0.1:50051", "data_listen": "[::]:50053"},
    ],
)
def test_a_network_listener_without_client_authentication_is_refused(values: dict[str, str]) -> None:
    """Issue 39 (HIGH): a non-loopback listen/data_listen with a certificate and no tenants
    served every block to any client that trusted the CA. Now it needs a tenants file or
    required client certificates; the error names the listener and both ways out."""
    tls = {"tls_cert": "/pki/s.crt", "tls_key": "/pki/s.key"}
    field = "listen" if values.get("listen", "").split(":")[0] not in ("", "127.0.0.1") else "data_listen"
    with pytest.raises(ValueError) as e:
        DaemonConfig.from_flat(**tls, **values)
    msg = str(e.value)
    assert msg.startswith(f"{field}: {values[field]} is not a loopback address and nothing authenticates"), (
        msg
    )
    assert "--tenants-file" in msg and "--tls-require-client-cert" in msg
    # with plaintext allowed it is refused all the same: plaintext is another question
    with pytest.raises(ValueError, match=f"^{field}: .* nothing authenticates"):
        DaemonConfig.from_flat(**values, allow_plaintext_remote=True)
    # a tenants file (tokens), or required client certificates, authenticate the clients
    assert DaemonConfig.from_flat(**tls, **values, tenants_file="/etc/kvtier/tenants.toml")
    assert DaemonConfig.from_flat(**tls, **values, tls_client_ca="/pki/ca.crt", tls_require_client_cert=True)
    assert DaemonConfig.from_flat(**values, tenants_file="/t.toml", allow_plaintext_remote=True)


def test_loopback_listeners_need_no_client_authentication() -> None:
    cfg = DaemonConfig.from_flat(listen="127.0.0.1:50051", data_listen="[::1]:0")
    assert cfg.grpc.listen == "127.0.0.1:50051" and not cfg.tenancy.tenants_file


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('hots_bytes = "1GiB"\n', "hots_bytes: unknown setting (did you mean host_bytes?)"),
        ("tenant_file = 'x'\n", "tenant_file: unknown setting (did you mean tenants_file?)"),
        ("[grpc]\nhost_bytes = 1\n", "grpc.host_bytes: unknown setting (host_bytes belongs in [host_tier]"),
        ("[host_tier]\nslab_byte = 1\n", "host_tier.slab_byte: unknown setting (did you mean slab_bytes?)"),
        ("zzz = 1\nlisen = 'x'\n", "lisen: unknown setting (did you mean listen?); also unknown: zzz"),
        ("qqqqq = 1\n", "qqqqq: unknown setting (docs/configuration.md and kvtierd serve --help list"),
    ],
)
def test_a_misspelt_key_is_named_with_the_setting_it_was_meant_to_be(
    tmp_path: Path, text: str, says: str
) -> None:
    path = tmp_path / "k.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        load_config(path)
    assert str(e.value).startswith(says), str(e.value)


def test_a_misspelt_key_comes_before_what_it_would_have_changed(tmp_path: Path) -> None:
    """``tenant_file`` misspelt beside a network listener: the typo is the error, not the
    listener's missing tenants file."""
    path = tmp_path / "k.toml"
    path.write_text('listen = "0.0.0.0:50051"\ntenant_file = "/t.toml"\n')
    with pytest.raises(ValueError, match="^tenant_file: unknown setting .did you mean tenants_file"):
        load_config(path)
    with pytest.raises(TypeError, match="no field 'hots_bytes' .did you mean host_bytes"):
        DaemonConfig.from_flat(hots_bytes=1)


def test_the_documented_config_file_loads() -> None:
    """docs/configuration.md §3's kvtierd.toml is a configuration the daemon accepts (its
    network listener with TLS and a tenants file; the files named are not read here)."""
    text = (Path(__file__).parents[4] / "docs" / "configuration.md").read_text()
    example = next(
        block.split("\n", 1)[1]
        for block in text.split("```toml")[1:]
        if block.split("\n", 1)[1].startswith("# kvtierd.toml")
    ).split("```")[0]
    import tomllib

    raw = tomllib.loads(example)["kvtierd"]
    cfg = with_overrides(DaemonConfig(), **{k: v for k, v in raw.items() if k != "socket_mode"})
    assert cfg.grpc.listen == "0.0.0.0:50051" and cfg.tenancy.tenants_file
    from kvtierd.app.start_warnings import start_warnings

    assert start_warnings(cfg) == []  # nothing in the example is seldom meant
