"""usable_cores: the least of the affinity mask and the cgroup CPU quotas, read under a fake
cgroup root here; "max", -1, missing files and garbage are no limit, a fraction rounds up."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier_contract import cores


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(cores, "affinity_cores", lambda: 64)  # a 64-core node
    return tmp_path


def v2(root: Path, text: str) -> None:
    (root / "cpu.max").write_text(text)


def v1(root: Path, quota: str, period: str = "100000", folder: str = "cpu") -> None:
    (root / folder).mkdir()
    (root / folder / "cpu.cfs_quota_us").write_text(quota)
    (root / folder / "cpu.cfs_period_us").write_text(period)


def test_no_cgroup_files_leave_the_affinity_mask(root: Path) -> None:
    assert cores.cores_allowed(root) == 64


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("max 100000\n", 64),  # no limit
        ("200000 100000\n", 2),  # a pod limited to 2 CPUs
        ("150000 100000\n", 2),  # 1.5 CPUs: rounded up
        ("50000 100000\n", 1),  # half a CPU: still one
        ("12800000 100000\n", 64),  # a quota above the mask: the mask
        ("garbage", 64),  # ignored
        ("200000 100000 7", 64),  # not two fields: ignored
        ("-5 100000", 64),
        ("200000 0", 64),
        ("", 64),
    ],
)
def test_the_cgroup_v2_quota(root: Path, text: str, expected: int) -> None:
    v2(root, text)
    assert cores.cores_allowed(root) == expected


@pytest.mark.parametrize(
    ("quota", "period", "expected"),
    [("-1", "100000", 64), ("300000", "100000", 3), ("250000", "100000", 3), ("x", "100000", 64)],
)
def test_the_cgroup_v1_quota(root: Path, quota: str, period: str, expected: int) -> None:
    v1(root, quota, period)
    assert cores.cores_allowed(root) == expected


def test_the_least_limit_wins(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    v2(root, "400000 100000")
    v1(root, "300000", folder="cpu,cpuacct")
    assert cores.cores_allowed(root) == 3  # v1 quota under v2's, under the mask
    monkeypatch.setattr(cores, "affinity_cores", lambda: 2)  # e.g. taskset -c 0,1
    assert cores.cores_allowed(root) == 2


def test_at_least_one_core(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cores, "affinity_cores", lambda: 0)
    assert cores.cores_allowed(root) == 1


def test_usable_cores_is_read_once_and_within_the_affinity_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    n = cores.usable_cores()
    assert 1 <= n <= cores.affinity_cores()
    monkeypatch.setattr(cores, "cores_allowed", lambda _root: n + 1)  # the limits change: not read again
    assert cores.usable_cores() == n
