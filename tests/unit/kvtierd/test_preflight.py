"""kvtierd's startup checks (kvtierd.preflight) over fake /proc and cgroup trees, real sockets
and real directories: each refusal is one line naming the setting, its flag and the fix."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvtierd.config import DaemonConfig, with_overrides
from kvtierd.preflight import (
    DAEMON_RESERVE_BYTES,
    MemorySource,
    StartupError,
    arenas_bytes,
    available_memory,
    check_disk_dir,
    check_memory,
    check_ports,
)
from kvtierd.tenants import token_digest

GiB, MiB = 1 << 30, 1 << 20


def fake_system(
    root: Path, *, available: int, cgroup_line: str = "0::/", files: dict[str, str] | None = None
) -> MemorySource:
    """A /proc with MemAvailable = ``available`` bytes and ``cgroup_line`` as this process's
    cgroup; ``files`` written under the cgroup mount (relative path -> content)."""
    proc, cg = root / "proc", root / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(
        f"MemTotal: {4 * available // 1024} kB\nMemFree: 1000 kB\nMemAvailable: {available // 1024} kB\n"
    )
    (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    cg.mkdir()
    for rel, text in (files or {}).items():
        (cg / rel).parent.mkdir(parents=True, exist_ok=True)
        (cg / rel).write_text(text)
    return MemorySource(proc=str(proc), cgroup=str(cg))


def test_mem_available_alone(tmp_path: Path) -> None:
    src = fake_system(tmp_path, available=10 * GiB)
    got = available_memory(src)
    assert got is not None and (got.bytes, got.source) == (10 * GiB, "MemAvailable")


def test_a_cgroup_v2_limit_below_mem_available_wins_and_its_page_cache_counts_as_free(tmp_path: Path) -> None:
    pod = "kubepods.slice/pod1"
    src = fake_system(
        tmp_path,
        available=10 * GiB,
        cgroup_line=f"0::/{pod}",
        files={
            "cgroup.controllers": "cpu memory\n",
            f"{pod}/memory.max": f"{2 * GiB}\n",
            f"{pod}/memory.current": f"{GiB + GiB // 2}\n",
            f"{pod}/memory.stat": f"anon 1\ninactive_file {GiB // 2}\nactive_file 7\n",
            "kubepods.slice/memory.max": "max\n",
            "kubepods.slice/memory.current": "5\n",
        },
    )
    got = available_memory(src)
    assert got is not None and got.bytes == GiB  # 2 GiB - (1.5 GiB - 0.5 GiB inactive)
    assert pod in got.source and "limit 2.0 GiB" in got.source


def test_a_parents_tighter_cgroup_v2_limit_wins(tmp_path: Path) -> None:
    src = fake_system(
        tmp_path,
        available=10 * GiB,
        cgroup_line="0::/a/b",
        files={
            "cgroup.controllers": "memory\n",
            "a/b/memory.max": f"{8 * GiB}\n",
            "a/b/memory.current": f"{GiB}\n",
            "a/memory.max": f"{3 * GiB}\n",
            "a/memory.current": f"{2 * GiB}\n",
        },
    )
    got = available_memory(src)
    assert got is not None and got.bytes == GiB and got.source.endswith(f"a: limit {3.0:.1f} GiB")


def test_cgroup_v1_memory_limit_and_its_no_limit_value(tmp_path: Path) -> None:
    src = fake_system(
        tmp_path,
        available=10 * GiB,
        cgroup_line="4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc",
        files={
            "memory/docker/abc/memory.limit_in_bytes": f"{4 * GiB}\n",
            "memory/docker/abc/memory.usage_in_bytes": f"{GiB}\n",
            "memory/docker/abc/memory.stat": "total_inactive_file 0\n",
            "memory/memory.limit_in_bytes": "9223372036854771712\n",
            "memory/memory.usage_in_bytes": f"{9 * GiB}\n",
        },
    )
    got = available_memory(src)
    assert got is not None and got.bytes == 3 * GiB and "docker/abc" in got.source


def test_a_cgroup_namespace_whose_path_is_not_visible_reads_the_mount_root(tmp_path: Path) -> None:
    src = fake_system(
        tmp_path,
        available=10 * GiB,
        cgroup_line="0::/host/path/not/here",
        files={"cgroup.controllers": "memory\n", "memory.max": f"{GiB}\n", "memory.current": "0\n"},
    )
    got = available_memory(src)
    assert got is not None and got.bytes == GiB


def test_host_bytes_above_the_available_memory_is_refused_naming_the_flag_and_the_fix(tmp_path: Path) -> None:
    src = fake_system(tmp_path, available=4 * GiB)
    cfg = DaemonConfig.from_flat(host_bytes=8 * GiB)
    with pytest.raises(StartupError) as e:
        check_memory(cfg, arenas_bytes(cfg), src)
    line = str(e.value)
    assert "\n" not in line and line.startswith(
        "host_bytes 8.0 GiB (--host-bytes) exceeds the memory available, 4.0 GiB (MemAvailable)"
    )
    # at most: whole slabs of what is left after the daemon's own reserve
    assert f"at most {(4 * GiB - DAEMON_RESERVE_BYTES) // (64 * MiB) * 64}MiB" in line
    assert "allow_host_bytes_over_available = true (--allow-host-bytes-over-available)" in line
    # just fitting with the reserve: accepted
    fits = DaemonConfig.from_flat(host_bytes=4 * GiB - DAEMON_RESERVE_BYTES)
    assert check_memory(fits, arenas_bytes(fits), src) == []
    over = DaemonConfig.from_flat(host_bytes=4 * GiB - DAEMON_RESERVE_BYTES + 64 * MiB)
    with pytest.raises(StartupError):
        check_memory(over, arenas_bytes(over), src)


def test_the_override_turns_the_refusal_into_a_warning(tmp_path: Path) -> None:
    src = fake_system(tmp_path, available=4 * GiB)
    cfg = DaemonConfig.from_flat(host_bytes=8 * GiB, allow_host_bytes_over_available=True)
    warnings = check_memory(cfg, arenas_bytes(cfg), src)
    assert len(warnings) == 1 and "starting anyway (allow_host_bytes_over_available)" in warnings[0]


def test_tenant_arenas_count_with_the_host_tier(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(
        f'[[tenant]]\nname = "a"\ntokens_sha256 = ["{token_digest("a")}"]\narena_bytes = "1GiB"\n'
        f'[[tenant]]\nname = "b"\ntokens_sha256 = ["{token_digest("b")}"]\n'  # default arena
        f'[[tenant]]\nname = "c"\ntokens_sha256 = ["{token_digest("c")}"]\ntransports = ["tcp"]\n'
    )
    cfg = DaemonConfig.from_flat(host_bytes=GiB, tenants_file=str(tenants), tenant_arena_bytes=512 * MiB)
    assert arenas_bytes(cfg) == (GiB, GiB + 512 * MiB)  # c maps no memory: no arena
    src = fake_system(tmp_path, available=2 * GiB + 512 * MiB)  # fits the shared arena alone
    with pytest.raises(StartupError) as e:
        check_memory(cfg, arenas_bytes(cfg), src)
    assert "plus 1.5 GiB of tenant arenas" in str(e.value)
    assert "lower --host-bytes to at most 768MiB" in str(e.value)  # room left for the shared arena
    small = fake_system(tmp_path / "small", available=GiB + 512 * MiB)  # the tenants' arenas alone
    with pytest.raises(StartupError) as e:
        check_memory(cfg, arenas_bytes(cfg), small)
    assert "--host-bytes to at most" not in str(e.value)  # no host_bytes would do: say what would
    assert "the tenant arenas alone leave no room: lower them by at least 320.0 MiB" in str(e.value)


def test_no_figure_no_check(tmp_path: Path) -> None:
    src = MemorySource(proc=str(tmp_path / "none"), cgroup=str(tmp_path / "none"))
    assert available_memory(src) is None
    cfg = DaemonConfig.from_flat(host_bytes=1 << 50)
    assert check_memory(cfg, arenas_bytes(cfg), src) == []


@pytest.mark.parametrize("setting", ["listen", "data_listen", "health_listen", "metrics_port"])
def test_a_port_in_use_is_refused_naming_the_setting_and_the_flag(held: int, setting: str) -> None:
    values: dict[str, object] = {"listen": "127.0.0.1:0", "data_listen": "127.0.0.1:0", "metrics_port": 0}
    values[setting] = held if setting == "metrics_port" else f"127.0.0.1:{held}"
    with pytest.raises(StartupError) as e:
        check_ports(DaemonConfig.from_flat(**values))  # type: ignore[arg-type]
    flag = "--" + setting.replace("_", "-")
    where = str(held) if setting == "metrics_port" else f"127.0.0.1:{held}"
    assert str(e.value).startswith(
        f"{setting} {where} ({flag}) is in use: another process "
        f"listens on 127.0.0.1:{held}; stop it, or choose another port"
    )


def test_free_ports_and_port_zero_pass_and_two_settings_on_one_port_do_not(held: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    check_ports(DaemonConfig.from_flat(listen=f"127.0.0.1:{free}", data_listen="127.0.0.1:0", metrics_port=0))
    with pytest.raises(
        StartupError,
        match=r"^metrics_port \d+ \(--metrics-port\) names the port "
        r"of listen",
    ):
        check_ports(DaemonConfig.from_flat(listen=f"127.0.0.1:{free}", metrics_port=free))


def test_an_address_not_on_this_host_cannot_be_bound() -> None:
    with pytest.raises(StartupError, match=r"^listen 192\.0\.2\.1:5 \(--listen\): cannot bind "):
        check_ports(
            DaemonConfig.from_flat(listen="192.0.2.1:5", allow_plaintext_remote=True, tenants_file="t.toml")
        )


def test_disk_dir_that_is_a_file_is_refused_unless_optional(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(StartupError) as e:
        check_disk_dir(DaemonConfig.from_flat(disk_dir=str(tmp_path / "f" / "nvme"), disk_bytes=GiB))
    assert str(e.value).startswith(
        f"disk_dir {tmp_path}/f/nvme (--disk-dir) cannot be used: {tmp_path}/f is not a directory;"
    )
    assert "disk_optional = true (--disk-optional)" in str(e.value)
    check_disk_dir(
        DaemonConfig.from_flat(disk_dir=str(tmp_path / "f" / "nvme"), disk_bytes=GiB, disk_optional=True)
    )
    check_disk_dir(DaemonConfig.from_flat(disk_dir=str(tmp_path / "new" / "nvme"), disk_bytes=GiB))
    assert not (tmp_path / "new").exists()  # checked, not made
    assert [p.name for p in tmp_path.iterdir()] == ["f"]  # the probe directory is gone again


def test_a_disk_dir_on_a_pseudo_filesystem_is_refused_for_what_it_is() -> None:
    """/proc says yes to access() for root and has "0 B free": the reason is that nothing can
    be made there, not its space."""
    with pytest.raises(StartupError) as e:
        check_disk_dir(DaemonConfig.from_flat(disk_dir="/proc/kvtier-nvme", disk_bytes=GiB))
    why = str(e.value).split("cannot be used: ", 1)[1]
    assert why.startswith(("cannot create a directory in /proc", "/proc is not writable")), why
    assert "free" not in why


def test_a_disk_too_small_for_the_block_files_is_refused_before_any_is_made(tmp_path: Path) -> None:
    cfg = DaemonConfig.from_flat(disk_dir=str(tmp_path / "nvme"), disk_bytes=1 << 50)  # 1 PiB
    with pytest.raises(StartupError) as e:
        check_disk_dir(cfg)
    line = str(e.value)
    assert line.startswith(f"disk_dir {tmp_path}/nvme (--disk-dir) cannot be used: its filesystem has ")
    assert (
        "the NVMe tier needs 1024.0 TiB more (1048576 block file(s) of 1.0 GiB and a journal of 8.0 MiB)"
        in line
    )
    assert "lower --disk-bytes or free space" in line and not (tmp_path / "nvme").exists()
    check_disk_dir(with_overrides(cfg, disk_bytes=64 << 20))  # 64 MiB fits


def test_one_port_on_two_loopback_addresses_is_two_listeners() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    check_ports(
        DaemonConfig.from_flat(listen=f"127.0.0.1:{free}", metrics_host="127.0.0.2", metrics_port=free)
    )
    with pytest.raises(StartupError, match=r"names the port of listen"):
        listen = f"127.0.0.1:{free}"
        check_ports(
            DaemonConfig.from_flat(
                listen=listen, metrics_host="0.0.0.0", metrics_port=free, metrics_plaintext_remote=True
            )
        )  # off loopback: the flag


def test_a_journal_already_there_is_not_asked_for_again(tmp_path: Path) -> None:
    """Issue 39: the check asked for a new journal's room even when a crashed daemon's journal
    was there, which the open's checkpoint removes before it makes the next one."""
    disk = tmp_path / "nvme"
    disk.mkdir()
    cfg = DaemonConfig.from_flat(disk_dir=str(disk), disk_bytes=1 << 50)  # 1 PiB: never fits
    with pytest.raises(
        StartupError, match=r"\(1048576 block file\(s\) of 1.0 GiB and a journal of 8.0 MiB\)"
    ):
        check_disk_dir(cfg)
    with open(disk / "journal-00000001.kvj", "wb") as f:
        f.truncate(8 << 20)  # a crashed daemon's (sparse here: its size is what the open frees)
    with pytest.raises(StartupError) as e:
        check_disk_dir(cfg)
    assert "more (1048576 block file(s) of 1.0 GiB): lower --disk-bytes" in str(e.value), str(e.value)
