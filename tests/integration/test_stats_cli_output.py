"""``kvtier stats`` for an operator on a daemon without tenants: every identity field, tenant ""
(no tenants file), and output cut short by its reader (``kvtier stats | head -1``) ends quietly."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import DaemonProcess, make_namespace

import kvtier


def test_stats_json_shows_the_identity_and_no_tenant_without_a_tenants_file(daemon: DaemonProcess) -> None:
    with kvtier.Client.connect(daemon.unix, "tcp") as c:
        c.register(
            make_namespace(
                tenant="not-in-any-file", adapter_id="lora-1", adapter_revision="r7", tp_size=2, tp_rank=1
            )
        )
        out = subprocess.run(
            [sys.executable, "-m", "kvtier.cli", "stats", "--address", daemon.unix, "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        text = subprocess.run(
            [sys.executable, "-m", "kvtier.cli", "stats", "--address", daemon.unix],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    stats = json.loads(out)
    [ns] = stats["namespaces"]
    assert ns["tenant"] == "" and stats["tenants"] == []  # no tenants file holds it
    assert (
        ns["spec"]
        == make_namespace(
            tenant="not-in-any-file", adapter_id="lora-1", adapter_revision="r7", tp_size=2, tp_rank=1
        ).to_dict()
    )
    assert "adapter lora-1@r7" in text and "tp rank 1/2" in text and "tenant -" in text
    assert "identity tenant not-in-any-file" in text


def test_a_reader_that_goes_away_ends_stats_without_a_traceback(daemon: DaemonProcess) -> None:
    for flags in ((), ("--json",)):
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.cli", "stats", "--address", daemon.unix, *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        proc.stdout.close()  # `| head -1` gone before the table is written
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 141, err  # 128 + SIGPIPE, as a shell reports it
        assert "Traceback" not in err and "BrokenPipe" not in err, err
