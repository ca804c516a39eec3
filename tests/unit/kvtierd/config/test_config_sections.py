"""DaemonConfig's groups: every flat key belongs to exactly one group, flat and sectioned files
load the same config, and a key in the wrong section or given twice is refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvtierd.config import GROUP_OF, GROUPS, DaemonConfig, flat_keys, load_config, with_overrides

GIB = 1 << 30


def test_every_key_is_in_one_group_and_no_group_is_named_like_a_key() -> None:
    names = [f.name for cls in GROUPS.values() for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names)) == len(flat_keys())
    assert not set(GROUPS) & set(GROUP_OF)  # [cluster_tier] is a table, cluster a URL
    assert [f.name for f in dataclasses.fields(DaemonConfig)] == [*GROUPS, "extra"]


def test_a_sectioned_file_loads_as_its_flat_twin(tmp_path: Path) -> None:
    flat = tmp_path / "flat.toml"
    flat.write_text('host_bytes = "2GiB"\ndisk_dir = "/d"\ndisk_bytes = "1GiB"\nlisten = ""\n')
    sectioned = tmp_path / "sections.toml"
    sectioned.write_text(
        '[kvtierd]\nlisten = ""\n[kvtierd.host_tier]\nhost-bytes = "2GiB"\n'
        '[kvtierd.nvme_tier]\ndisk_dir = "/d"\ndisk_bytes = "1GiB"\n'
    )
    cfg = load_config(sectioned)
    assert cfg == load_config(flat)
    assert cfg.host_tier.host_bytes == 2 * GIB and cfg.nvme_tier.disk_dir == "/d"
    top = tmp_path / "top.toml"
    top.write_text('[host_tier]\nhost_bytes = "2GiB"\n')
    assert load_config(top).host_tier.host_bytes == 2 * GIB


def test_a_key_in_another_groups_section_or_given_twice_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "k.toml"
    path.write_text('[host_tier]\ndisk_dir = "/d"\n')
    with pytest.raises(
        ValueError, match=r"^host_tier.disk_dir: unknown setting \(disk_dir belongs in \[nvme_tier\]"
    ):
        load_config(path)
    path.write_text('host_bytes = "1GiB"\n[host_tier]\nhost_bytes = "2GiB"\n')
    with pytest.raises(ValueError, match="^host_bytes: given twice"):
        load_config(path)


def test_flat_construction_and_overrides_land_in_their_groups() -> None:
    cfg = DaemonConfig.from_flat(host_bytes=2 * GIB, lease_ttl_s=3.0, metrics_port=-1)
    assert (cfg.host_tier.host_bytes, cfg.sessions.lease_ttl_s) == (2 * GIB, 3.0)
    assert cfg.metrics.metrics_port == -1 and cfg.grpc == DaemonConfig().grpc
    assert with_overrides(DaemonConfig(), host_bytes="2GiB", lease_ttl_s=3.0, metrics_port=-1) == cfg
    with pytest.raises(TypeError, match="hots_bytes"):
        DaemonConfig.from_flat(hots_bytes=1)
