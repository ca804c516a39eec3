"""What kvtierd refuses at start comes before it reserves host memory, and is one line.

* an NVMe tier that opens degraded (a truncated block file) is refused before the host arena is
  made (the arena's constructor is watched: it is never called), its directory unlocked;
* a tenants file that changed after the CLI read it, and a /metrics exposure that file does not
  allow, are ``kvtierd serve: ...`` on one line, exit 2, from ``run(cfg)`` (no traceback);
* a --disk-dir this user may write and enter but not read (its block files cannot be listed) is
  one line naming --disk-dir, before anything is made;
* a start that fails after the NVMe tier was opened (a port taken since the checks) closes the
  tier: its directory's lock is free again in the same process.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
from tests_helpers import serve_exits

from kvtierd import app, preflight
from kvtierd.app import build
from kvtierd.config import DaemonConfig
from kvtierd.preflight import StartupError, nvme_config
from kvtierd.tiers import Arena
from kvtierd.tiers.nvme.tier import NvmeTier


def config(tmp_path: Path, **kw: Any) -> DaemonConfig:
    fields: dict[str, Any] = dict(
        host_bytes=8 << 20,
        slab_bytes=1 << 20,
        prefault=False,
        socket_path=str(tmp_path / "run" / "kvtier.sock"),
        listen="",
        metrics_port=-1,
    )
    fields.update(kw)
    return DaemonConfig.from_flat(**fields)


@pytest.fixture
def arenas(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every host arena the daemon makes from now on (real arenas, watched)."""
    made: list[int] = []

    class Watched(Arena):
        def __init__(self, size: int, **kw: Any) -> None:
            made.append(size)
            super().__init__(size, **kw)

    monkeypatch.setattr(build, "Arena", Watched)
    return made


def unlocked(cfg: DaemonConfig) -> bool:
    """Whether the NVMe directory's lock can be taken now (a flock: held by another open file
    of this process too, until that one is closed)."""
    tier = NvmeTier(nvme_config(cfg))
    try:
        tier.lock()
    except Exception:  # noqa: BLE001  (lockfile.InUse)
        return False
    tier.close()
    return True


def test_a_tier_that_opens_degraded_is_refused_before_the_arena_is_reserved(
    tmp_path: Path, arenas: list[int]
) -> None:
    cfg = config(tmp_path, disk_dir=str(tmp_path / "nvme"), disk_bytes=16 << 20)
    tier = NvmeTier(nvme_config(cfg))
    tier.open()
    tier.close()
    os.truncate(tmp_path / "nvme" / "blocks-00000.kvt", 4096)
    with pytest.raises(StartupError) as e:
        app.Daemon(cfg)
    assert "the NVMe tier opened degraded: " in str(e.value) and "--disk-optional" in str(e.value)
    assert arenas == []  # refused first: no host memory reserved, none prefaulted
    assert unlocked(cfg)
    d = app.Daemon(config(tmp_path, disk_dir=cfg.nvme_tier.disk_dir, disk_bytes=16 << 20, disk_optional=True))
    assert arenas == [8 << 20] and not d.cache.chain[0].tier.admitting  # degraded, serving
    d.cache.chain[0].tier.close()
    d.host.close()


def exits_in_one_line(cfg: DaemonConfig, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        app.run(cfg)
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1, lines
    return lines[0]


TENANT = '[[tenant]]\nname = "a"\ntokens_sha256 = ["' + "ab" * 32 + '"]\n'


def test_a_tenants_file_changed_since_the_cli_read_it_is_one_line(
    tmp_path: Path, arenas: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANT + "bogus = 1\n")  # (valid when the CLI read it; edited since)
    line = exits_in_one_line(config(tmp_path, tenants_file=str(tenants)), capsys)
    assert line.startswith("kvtierd serve: ") and "bogus" in line, line
    assert arenas == []


def test_metrics_off_loopback_without_a_scrape_token_is_one_line_before_the_arena(
    tmp_path: Path, arenas: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANT)
    cfg = config(
        tmp_path,
        tenants_file=str(tenants),
        metrics_host="0.0.0.0",
        metrics_port=0,
        metrics_plaintext_remote=True,
    )
    line = exits_in_one_line(cfg, capsys)
    assert line.startswith("kvtierd serve: metrics_host: 0.0.0.0 is not a loopback address"), line
    assert arenas == []


def test_a_disk_dir_that_cannot_be_listed_is_one_line_naming_the_flag(tmp_path: Path) -> None:
    disk = tmp_path / "nvme"
    disk.mkdir(mode=0o300)  # writable and enterable, not readable
    disk.chmod(0o300)
    # root reads any directory: drop the capabilities that let it (setpriv, util-linux)
    drop = (
        [
            "setpriv",
            "--inh-caps=-dac_override,-dac_read_search",
            "--bounding-set=-dac_override,-dac_read_search",
        ]
        if os.geteuid() == 0
        else []
    )
    done = serve_exits(
        tmp_path / "run",
        "--listen",
        "",
        "--host-bytes",
        "8MiB",
        "--slab-bytes",
        "1MiB",
        "--disk-dir",
        str(disk),
        "--disk-bytes",
        "16MiB",
        prefix=drop,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done
    assert lines[0].startswith(
        f"kvtierd serve: disk_dir {disk} (--disk-dir) cannot be used: {disk} is not readable by uid "
    ), lines[0]
    assert "Traceback" not in done.stderr


def test_a_start_failing_after_the_tier_opened_closes_it(
    tmp_path: Path, held: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The port check passed (skipped here), then another process took the port: the bind fails
    after the NVMe tier was opened; the tier is closed (its lock free), the error one line."""
    monkeypatch.setattr(preflight, "check_ports", lambda cfg: None)
    cfg = config(tmp_path, disk_dir=str(tmp_path / "nvme"), disk_bytes=16 << 20, metrics_port=held)
    with pytest.raises(StartupError) as e:
        asyncio.run(app.serve_daemon(cfg))
    assert str(e.value).startswith(f"metrics_port {held} (--metrics-port) is in use: ")
    assert unlocked(cfg)
