"""The disk seam: real files in a temporary directory, faults injected by wrapping the real device.

Files are tiny (16 x 4 KiB). ``tmp_path`` lives on the working filesystem (/tmp); the tmpfs
scenarios use /dev/shm when the machine has it.
"""

from __future__ import annotations

import ast
import ctypes
import errno
import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvtier_contract.directio import aligned_buffer
from kvtierd.testing.faults import FaultyDevice, FaultyFileSystem
from kvtierd.tiers.nvme import device as device_mod
from kvtierd.tiers.nvme.device import (
    Device,
    DiskFull,
    DiskIOError,
    FileDevice,
    FileSystem,
    SyncFailed,
    UnsafeFile,
)

A = 4096
FILE = 16 * A
SHM = Path("/dev/shm")


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[FileSystem]:
    f = FileSystem(str(tmp_path / "nvme"), create=True)
    yield f
    f.close()


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    if not SHM.is_dir():
        pytest.skip("no /dev/shm")
    d = SHM / f"kvtier-test-{os.getpid()}-{threading.get_ident()}"
    d.mkdir()
    yield d
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


def pattern(n: int, seed: int = 1) -> bytes:
    return bytes((i * 31 + seed) % 251 for i in range(n))


def staged(data: bytes, align: int = A) -> memoryview:
    buf = aligned_buffer(len(data), align)
    buf[:] = data
    return buf


def on_disk(dev: Device, offset: int = 0, n: int = FILE) -> bytes:
    with open(dev.path, "rb") as f:
        f.seek(offset)
        return f.read(n)


def raw_direct_works(directory: Path) -> bool:
    """Independent of the code under test: can this directory do an aligned O_DIRECT write?"""
    path = directory / "raw-probe"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.pwritev(fd, [aligned_buffer(A)], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        path.unlink()


def has_o_direct(dev: Device) -> bool:
    assert isinstance(dev, FileDevice)
    return bool(fcntl.fcntl(dev.fileno(), fcntl.F_GETFL) & os.O_DIRECT)


# -- O_DIRECT detection -----------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["tmp", "shm"])
def test_o_direct_detection_matches_the_filesystem(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # Found on the development host (Linux 6.18): ext4 /tmp and tmpfs /dev/shm both take O_DIRECT
    # (tmpfs does since Linux 6.6); older tmpfs refuses it at open() with EINVAL.
    directory = tmp_path if where == "tmp" else request.getfixturevalue("shm_dir")
    fs = FileSystem(str(directory))
    expected = raw_direct_works(directory)
    assert fs.direct_io is expected, fs.direct_io_note
    assert fs.direct_io_note.startswith("O_DIRECT" if expected else "buffered")
    dev = fs.create_file("f", FILE)
    assert dev.direct is expected and has_o_direct(dev) is expected
    assert dev.pwrite(A, [staged(pattern(A))]) == A
    back = aligned_buffer(A)
    assert dev.pread_into(A, [back]) == A and bytes(back) == pattern(A)
    assert sorted(os.listdir(directory)) == ["f"]  # the probe file is gone
    dev.close()
    fs.close()


def test_without_o_direct_support_files_open_buffered(
    fs: FileSystem, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def no_direct(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT not supported")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_direct)
    assert fs.direct_io is False
    assert "EINVAL" in fs.direct_io_note
    dev = fs.create_file("f", FILE)
    assert not dev.direct and not has_o_direct(dev)
    dev.pwrite(100, [b"unaligned is fine when buffered"])
    assert on_disk(dev, 100, 31) == b"unaligned is fine when buffered"
    with pytest.raises(DiskIOError):
        fs.open_file("f", direct=True)
    dev.close()


def test_o_direct_rejects_unaligned_transfers(fs: FileSystem) -> None:
    if not fs.direct_io:
        pytest.skip(f"no O_DIRECT here: {fs.direct_io_note}")
    dev = fs.create_file("f", FILE)
    with pytest.raises(AssertionError):
        dev.pwrite(100, [staged(pattern(A))])  # offset not aligned: a bug, caught before the kernel
    with pytest.raises(AssertionError):
        dev.pwrite(0, [b"x" * 100])
    dev.close()


# -- buffers and transfers --------------------------------------------------------------------------


@pytest.mark.parametrize("align", [512, 4096, 16384, 65536])
def test_aligned_buffer(align: int) -> None:
    buf = aligned_buffer(3 * align + 5, align)
    assert len(buf) == 3 * align + 5 and not buf.readonly
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert address % align == 0
    assert bytes(buf) == bytes(len(buf))


def test_gather_write_and_scatter_read(fs: FileSystem) -> None:
    dev = fs.create_file("f", FILE)
    header, payload = staged(pattern(A, 1)), staged(pattern(2 * A, 2))
    assert dev.pwrite(A, [header, payload]) == 3 * A  # one pwritev: header then payload
    assert on_disk(dev, A, 3 * A) == pattern(A, 1) + pattern(2 * A, 2)
    h, p = aligned_buffer(A), aligned_buffer(2 * A)
    assert dev.pread_into(A, [h, p]) == 3 * A
    assert bytes(h) == pattern(A, 1) and bytes(p) == pattern(2 * A, 2)
    dev.close()


def test_more_views_than_iov_max_and_short_read_at_eof(fs: FileSystem) -> None:
    dev = fs.create_file("f", FILE, direct=False)
    views = [bytes([i % 256]) * 8 for i in range(3000)]  # 3000 iovecs > IOV_MAX (1024)
    assert dev.pwrite(0, views) == 24_000
    assert on_disk(dev, 0, 24_000) == b"".join(views)
    tail = bytearray(2 * A)
    assert dev.pread_into(FILE - A, [tail]) == A  # only one block left before EOF
    dev.close()


def test_concurrent_writes_at_distinct_offsets_and_a_concurrent_sync(fs: FileSystem) -> None:
    dev = fs.create_file("f", FILE)
    with ThreadPoolExecutor(4) as pool:
        writes = [pool.submit(dev.pwrite, i * A, [staged(pattern(A, i))]) for i in range(16)]
        syncs = [pool.submit(dev.sync) for _ in range(4)]
        assert [f.result() for f in writes] == [A] * 16
        assert [f.result() for f in syncs] == [None] * 4
    dev.sync()
    assert on_disk(dev) == b"".join(pattern(A, i) for i in range(16))
    dev.close()


# -- files and the directory ------------------------------------------------------------------------


def test_create_file_preallocates_and_is_exclusive(fs: FileSystem) -> None:
    dev = fs.create_file("blocks-00000.kvt", FILE)
    st = os.stat(dev.path)
    assert dev.size == st.st_size == FILE
    assert st.st_blocks * 512 >= FILE  # allocated, not a sparse hole
    assert on_disk(dev) == bytes(FILE)
    with pytest.raises(DiskIOError) as info:
        fs.create_file("blocks-00000.kvt", FILE)
    assert info.value.errno == errno.EEXIST
    dev.close()


def test_symlinks_are_never_followed(fs: FileSystem, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious" * 512)
    os.symlink(outside, Path(fs.directory) / "blocks-00000.kvt")
    os.symlink(outside, Path(fs.directory) / "kvtier.meta.tmp")
    with pytest.raises(UnsafeFile):
        fs.open_file("blocks-00000.kvt")
    with pytest.raises(UnsafeFile):
        fs.read_file("blocks-00000.kvt")
    with pytest.raises(DiskIOError):  # O_EXCL: an existing name, even a symlink, is never reused
        fs.create_file("blocks-00000.kvt", FILE)
    with pytest.raises(UnsafeFile):  # the temporary file of an atomic write is a symlink
        fs.write_file_atomic("kvtier.meta", b"{}")
    assert [(e.name, e.kind) for e in fs.entries()] == [
        ("blocks-00000.kvt", "symlink"),
        ("kvtier.meta.tmp", "symlink"),
    ]
    fs.remove("blocks-00000.kvt")  # removes the link, not its target
    assert outside.read_bytes() == b"precious" * 512
    assert fs.listdir() == ["kvtier.meta.tmp"]


def test_a_fifo_is_refused_without_hanging(fs: FileSystem) -> None:
    os.mkfifo(Path(fs.directory) / "blocks-00000.kvt")
    with pytest.raises(UnsafeFile):
        fs.open_file("blocks-00000.kvt", readonly=True)
    assert [(e.name, e.kind) for e in fs.entries()] == [("blocks-00000.kvt", "other")]


def test_atomic_metadata_file(fs: FileSystem) -> None:
    assert fs.read_file("kvtier.meta") is None
    fs.write_file_atomic("kvtier.meta", b"one")
    fs.write_file_atomic("kvtier.meta", b"two, longer")
    assert fs.read_file("kvtier.meta") == b"two, longer"
    assert fs.listdir() == ["kvtier.meta"]
    fs.rename("kvtier.meta", "renamed")
    assert fs.listdir() == ["renamed"]


def test_atomic_write_whose_sync_fails_keeps_the_old_content(
    fs: FileSystem, monkeypatch: pytest.MonkeyPatch
) -> None:
    fs.write_file_atomic("kvtier.meta", b"old")
    monkeypatch.setattr(os, "fdatasync", failing(errno.EIO))
    with pytest.raises(SyncFailed):
        fs.write_file_atomic("kvtier.meta", b"new")
    assert fs.read_file("kvtier.meta") == b"old"
    assert fs.listdir() == ["kvtier.meta"]  # no temporary file left


def failing(err: int) -> Callable[..., None]:
    def fail(*args: object) -> None:
        raise OSError(err, os.strerror(err))

    return fail


def test_real_fdatasync_failure_is_sticky(fs: FileSystem, monkeypatch: pytest.MonkeyPatch) -> None:
    # Linux may report the fsync after a failed writeback as a success although the pages are
    # gone: once a sync failed, the device never reports its writes durable again.
    dev = fs.create_file("f", FILE)
    dev.pwrite(0, [staged(pattern(A))])
    monkeypatch.setattr(os, "fdatasync", failing(errno.EIO))
    with pytest.raises(SyncFailed) as info:
        dev.sync()
    assert info.value.errno == errno.EIO
    monkeypatch.undo()  # the kernel would now say "success"
    with pytest.raises(SyncFailed):
        dev.sync()
    dev.close()


def test_missing_directory_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(DiskIOError) as info:
        FileSystem(str(tmp_path / "absent"))
    assert info.value.errno == errno.ENOENT


# -- fault injection --------------------------------------------------------------------------------


@pytest.fixture
def faulty(tmp_path: Path) -> Iterator[tuple[FaultyFileSystem, FaultyDevice]]:
    fs = FaultyFileSystem(str(tmp_path / "nvme"), create=True)
    fs.create_file("f", FILE)
    dev = fs.devices["f"]
    yield fs, dev
    dev.close()
    fs.close()


def test_injected_eio_on_write_writes_nothing(faulty: tuple[FaultyFileSystem, FaultyDevice]) -> None:
    _, dev = faulty
    dev.fail_writes(1)
    with pytest.raises(DiskIOError) as info:
        dev.pwrite(0, [staged(pattern(A))])
    assert info.value.errno == errno.EIO
    assert on_disk(dev, 0, A) == bytes(A)
    dev.pwrite(0, [staged(pattern(A))])  # only the next write failed
    assert on_disk(dev, 0, A) == pattern(A)
    assert (dev.writes, dev.faults) == (2, 1)


def test_injected_eio_on_read(faulty: tuple[FaultyFileSystem, FaultyDevice]) -> None:
    _, dev = faulty
    dev.fail_reads(2)
    buf = aligned_buffer(A)
    for _ in range(2):
        with pytest.raises(DiskIOError):
            dev.pread_into(0, [buf])
    assert dev.pread_into(0, [buf]) == A


def test_disk_full_on_write_and_on_preallocation(faulty: tuple[FaultyFileSystem, FaultyDevice]) -> None:
    fs, dev = faulty
    dev.fail_writes(1, errno.ENOSPC)
    with pytest.raises(DiskFull):
        dev.pwrite(0, [staged(pattern(A))])
    fs.fail_allocate(errno.ENOSPC)
    with pytest.raises(DiskFull) as info:
        fs.create_file("g", FILE)
    assert info.value.errno == errno.ENOSPC
    assert fs.listdir() == ["f"]  # the partial file was removed
    fs.fail_allocate(errno.EDQUOT)
    with pytest.raises(DiskFull):
        fs.create_file("g", FILE)
    fs.create_file("g", FILE).close()  # space came back


def test_injected_sync_failure_is_sticky(faulty: tuple[FaultyFileSystem, FaultyDevice]) -> None:
    _, dev = faulty
    dev.pwrite(0, [staged(pattern(A))])
    dev.fail_syncs(1, errno.EIO)
    with pytest.raises(SyncFailed):
        dev.sync()
    with pytest.raises(SyncFailed):  # nothing on this device may be reported durable any more
        dev.sync()
    assert dev.syncs == 2


@pytest.mark.parametrize("direct", [False, True])
def test_torn_write(tmp_path: Path, direct: bool) -> None:
    fs = FaultyFileSystem(str(tmp_path), create=True)
    if direct and not fs.direct_io:
        pytest.skip(f"no O_DIRECT here: {fs.direct_io_note}")
    fs.create_file("f", FILE, direct=direct)
    dev = fs.devices["f"]
    dev.pwrite(0, [staged(pattern(2 * A, 1))])  # old content
    dev.tear_next_write(512)
    with pytest.raises(DiskIOError):
        dev.pwrite(0, [staged(pattern(2 * A, 2))])
    assert on_disk(dev, 0, 2 * A) == pattern(2 * A, 2)[:512] + pattern(2 * A, 1)[512:]
    dev.tear_next_write(A + 100, succeed=True)  # a tear the caller never hears about
    assert dev.pwrite(0, [staged(pattern(2 * A, 3))]) == 2 * A
    assert on_disk(dev, 0, 2 * A) == pattern(2 * A, 3)[: A + 100] + pattern(2 * A, 1)[A + 100 :]
    dev.close()
    fs.close()


def test_flipped_bytes(faulty: tuple[FaultyFileSystem, FaultyDevice]) -> None:
    _, dev = faulty
    dev.flip_on_write(A + 10)
    dev.pwrite(0, [staged(pattern(A))])  # does not cover A + 10
    assert on_disk(dev, 0, 2 * A) == pattern(A) + bytes(A)
    dev.pwrite(A, [staged(pattern(A, 5))])
    got = on_disk(dev, A, A)
    assert got[10] == pattern(A, 5)[10] ^ 0xFF
    assert got[:10] + got[11:] == pattern(A, 5)[:10] + pattern(A, 5)[11:]
    dev.flip_byte(0)  # bit rot now, no write needed
    assert on_disk(dev, 0, 1) == bytes([pattern(A)[0] ^ 0xFF])


def test_latency(faulty: tuple[FaultyFileSystem, FaultyDevice]) -> None:
    _, dev = faulty
    dev.latency_s = 0.05
    start = time.monotonic()
    dev.pwrite(0, [staged(pattern(A))])
    dev.sync()
    assert time.monotonic() - start >= 0.1
    dev.latency_s = 0.0


def test_faults_are_mapped_like_the_real_ones() -> None:
    assert isinstance(device_mod.disk_error(OSError(errno.EDQUOT, "quota"), "w"), DiskFull)
    assert isinstance(device_mod.disk_error(OSError(errno.ELOOP, "loop"), "o"), UnsafeFile)
    assert isinstance(device_mod.disk_error(OSError(errno.ENOSPC, "full"), "s", sync=True), SyncFailed)
    assert type(device_mod.disk_error(OSError(errno.EROFS, "ro"), "w")) is DiskIOError


def test_the_daemon_never_imports_the_fault_doubles() -> None:
    """kvtierd.testing is for tests and tooling: no module of the daemon imports it, lazily or not."""
    package = Path(device_mod.__file__).resolve().parents[2]  # server/kvtierd
    importers = []
    for path in package.rglob("*.py"):
        if path.parent.name == "testing":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            if any(n == "kvtierd.testing" or n.startswith("kvtierd.testing.") for n in names):
                importers.append(f"{path.relative_to(package)}:{node.lineno}")
    assert importers == []
