"""``kvtier stats`` for an operator on a daemon without tenants: every identity field, tenant ""
(no tenants file), the cache salt only as a tag (never the salt: the Stats reply, the table and
``--json``), and output cut short by its reader (``kvtier stats | head -1``) ends quietly."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import DaemonProcess, make_namespace

import kvtier

SALT, OTHER_SALT = "user-4711-salt", "user-4712-salt"


def _stats(daemon: DaemonProcess, *flags: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "stats", "--address", daemon.unix, *flags],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout


def test_cache_salts_are_shown_as_tags_never_themselves(daemon: DaemonProcess) -> None:
    with kvtier.Client.connect(daemon.unix, "tcp") as c:
        for model, salt in (("m/a", SALT), ("m/b", SALT), ("m/c", OTHER_SALT), ("m/d", None)):
            c.register(make_namespace(model_id=model, cache_salt=salt))
        reply = c.stats()
        text, out = _stats(daemon), _stats(daemon, "--json")
    for shown in (json.dumps(reply), text, out):
        assert SALT not in shown and OTHER_SALT not in shown and "4711" not in shown
    tags = {ns["model_id"]: ns["spec"]["cache_salt"] for ns in json.loads(out)["namespaces"]}
    assert tags["m/d"] is None and all(re.fullmatch(r"hmac:[0-9a-f]{12}", tags[m]) for m in "m/a m/c".split())
    assert tags["m/a"] == tags["m/b"] != tags["m/c"]  # equal salts: equal tags, so told apart
    sdk = {ns["model_id"]: ns["spec"].get("cache_salt") or None for ns in reply["namespaces"]}
    assert sdk == tags  # the SDK's reply: the same tags
    for tag in (tags["m/a"], tags["m/c"]):
        assert f"cache salt {tag}" in text
    assert "cache salt -" in text


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


def test_a_tenants_stats_and_a_missing_credential_read_right(daemon_factory: Any, tmp_path: Path) -> None:
    """Issue 39: `kvtier stats` printed "policy " with nothing after it for a tenant (its reply
    has no policy: the daemon's) and told a client without credential to pass
    "--unix-loginTrue"."""
    token = tmp_path / "token"
    token.write_text("tok-stats-39\n")
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(
        f'[[tenant]]\nname = "team-a"\ntokens_sha256 = ["{hashlib.sha256(b"tok-stats-39").hexdigest()}"]\n'
    )
    d = daemon_factory("--tenants-file", str(tenants), "--host-bytes", "64MiB", "--slab-bytes", "1MiB")
    text = _stats(d, "--token-file", str(token))
    first, second = text.splitlines()[:2]
    assert "policy" not in first and "  sessions " in first, first
    assert "(this tenant's blocks" in second and "pinned" not in second, second
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "stats", "--address", d.unix],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "--unix-login on its Unix socket" in out.stderr, out.stderr
    assert "True" not in out.stderr and "unix_login" not in out.stderr
