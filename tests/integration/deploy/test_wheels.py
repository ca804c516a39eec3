"""The two wheels, built and installed as a user would (issue 29, items 4 and 5): not the editable tree.

``scripts/build_wheels.py`` builds ``kvtier`` (SDK + contract) and ``kvtierd`` (daemon) with
``pip wheel --no-deps --no-build-isolation``; a fresh venv (no system site packages, no
PYTHONPATH, run outside the repository) gets the SDK wheel alone, then the daemon's; their
dependencies come from the package index. The daemon is then started by ``make serve`` from that
venv with a chosen metrics port, and the README's client snippet runs in it against the daemon.

Needs the index (pip's configured one) and ``make``; about 30 s on 2 cores, most of it pip.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
import zipfile
from collections.abc import Iterator
from email.parser import Parser
from pathlib import Path
from typing import Any

import pytest

from kvtier_contract.version import __version__

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
pytestmark = pytest.mark.wheels

PROBE = """
import importlib.util, json, sys
import kvtier
print(json.dumps({"file": kvtier.__file__, "version": kvtier.__version__,
                  "torch_loaded": "torch" in sys.modules,
                  "torch_installed": importlib.util.find_spec("torch") is not None,
                  "kvtierd_installed": importlib.util.find_spec("kvtierd") is not None}))
"""


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without what would put the repository (or a make) on the path."""
    drop = {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "MAKEFLAGS", "MFLAGS", "MAKELEVEL"}
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


def run(argv: list[str | Path], cwd: Path, timeout: float = 120) -> str:
    done = subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{argv} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def metadata(wheel: Path) -> Any:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(z.read(name).decode())


def top_level(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return {n.split("/")[0] for n in z.namelist() if not n.split("/")[0].endswith(".dist-info")}


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    printed = run([sys.executable, ROOT / "scripts" / "build_wheels.py", "--out", out], cwd=out)
    paths = [Path(line) for line in printed.split()]
    return {metadata(p)["Name"]: p for p in paths}


@pytest.fixture(scope="module")
def venv(wheels: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A fresh venv with the SDK wheel alone (probed then), then the daemon's wheel as well."""
    work = tmp_path_factory.mktemp("venv")
    env = work / "venv"
    run([sys.executable, "-m", "venv", env], cwd=work)
    run([env / "bin" / "python", "-m", "pip", "install", "-q", wheels["kvtier"]], cwd=work, timeout=300)
    sdk_only = {
        "probe": json.loads(run([env / "bin" / "python", "-c", PROBE], cwd=work)),
        "version": run([env / "bin" / "kvtier", "--version"], cwd=work),
        "serve": subprocess.run(
            [env / "bin" / "kvtier", "serve", "--help"],
            cwd=work,
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=60,
        ),
    }
    run([env / "bin" / "python", "-m", "pip", "install", "-q", wheels["kvtierd"]], cwd=work, timeout=300)
    return {"env": env, "work": work, "sdk_only": sdk_only}


def test_each_wheel_holds_its_own_packages_and_the_one_version(wheels: dict[str, Path]) -> None:
    assert top_level(wheels["kvtier"]) == {"kvtier", "kvtier_contract"}
    assert top_level(wheels["kvtierd"]) == {"kvtierd"}
    sdk, daemon = metadata(wheels["kvtier"]), metadata(wheels["kvtierd"])
    assert sdk["Version"] == daemon["Version"] == __version__
    sdk_requires = sdk.get_all("Requires-Dist")
    base = [r for r in sdk_requires if "extra ==" not in r]
    assert base and not [r for r in base if re.match(r"(torch|kvtierd|grpcio-|prometheus|uvloop)", r)], base
    assert not [r for r in sdk_requires if r.startswith("torch")], "torch is the engine image's"
    assert f"kvtier=={__version__}" in daemon.get_all("Requires-Dist")
    assert "cluster" in daemon.get_all("Provides-Extra")
    assert f'kvtierd[cluster]=={__version__}; extra == "bench"' in sdk_requires, sdk_requires


def test_the_sdk_wheel_alone_imports_without_torch_or_the_daemon(venv: dict[str, Any]) -> None:
    probe = venv["sdk_only"]["probe"]
    assert Path(probe["file"]).is_relative_to(venv["env"]), probe  # the wheel, not this tree
    assert probe["version"] == __version__
    assert not probe["torch_loaded"] and not probe["torch_installed"], probe
    assert not probe["kvtierd_installed"], probe
    assert venv["sdk_only"]["version"].strip() == f"kvtier {__version__}"
    serve = venv["sdk_only"]["serve"]  # the alias names the missing wheel, in one line
    assert serve.returncode == 2 and "install the kvtierd wheel" in serve.stderr, serve
    assert "Traceback" not in serve.stderr


@contextlib.contextmanager
def port_taken(port: int) -> Iterator[None]:
    """``port`` on 127.0.0.1 listened on for the block (as another clone's daemon would), unless
    something listens there already."""
    with socket.socket() as s:
        with contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            s.listen()
        yield


def readme_snippet(address: str) -> str:
    """The README's client example, runnable: its address, a well-formed digest, the data it
    leaves to the reader (``token_ids``, ``blocks``, ``my_buffers``), then checks of its results."""
    section = README.read_text().split("## Using the client", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    code, n = re.subn(r'Client\.connect\("[^"]*"', f'Client.connect("{address}"', code)
    assert n == 1, 'the README\'s snippet no longer connects with Client.connect("...")'
    code = code.replace('"sha256:…"', '"sha256:' + "ab" * 32 + '"')

    def before(line_part: str, statement: str) -> None:
        nonlocal code
        m = re.search(rf"^( *).*{re.escape(line_part)}", code, re.M)
        assert m, f"the README's snippet has no {line_part!r}"
        code = code[: m.start()] + m.group(1) + statement + "\n" + code[m.start() :]

    before("ns.put(keys, blocks)", "blocks = [bytes([i + 1]) * ns.block_bytes for i in range(len(keys))]")
    before("ns.get_into(keys, my_buffers)", "my_buffers = [bytearray(ns.block_bytes) for _ in keys]")
    return (
        "token_ids = list(range(16 * 3))\n" + code + "assert result.stored == len(keys) == 3, result\n"
        "assert [bytes(b) for b in buffers] == blocks and all(found)\n"
        "assert [bytes(b) for b in my_buffers] == blocks\n"
        "print('SNIPPET_OK')\n"
    )


@contextlib.contextmanager
def make_serve(*variables: str) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    """``make serve VARIABLES...`` in the repository, in its own process group; (make, the ready
    line's JSON). Killed, with the daemon, if still running when the block exits."""
    argv = ["make", "-s", "--no-print-directory", "serve", *variables]
    env = clean_env(KVTIER_LOG_LEVEL="WARNING")
    make = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        assert make.stdout is not None
        lines = []
        for line in make.stdout:
            lines.append(line)
            if line.startswith("KVTIERD_READY "):
                break
        else:
            pytest.fail("make serve exited before the daemon was ready:\n" + "".join(lines))
        yield make, json.loads(line.split(" ", 1)[1])
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)
            make.wait(10)


def test_make_serve_from_the_wheels_serves_the_readme_snippet(venv: dict[str, Any]) -> None:
    env, work = venv["env"], venv["work"]
    assert run([env / "bin" / "kvtierd", "--version"], cwd=work).strip() == f"kvtierd {__version__}"
    assert json.loads(run([env / "bin" / "python", "-c", PROBE], cwd=work))["torch_installed"] is False
    (env / ".installed").touch()  # make serve's stamp: this venv is its environment, as installed
    args = f"--socket {work / 'kvtier.sock'} --host-bytes 64MiB --slab-bytes 4MiB"
    with port_taken(9464), make_serve(f"SERVE_VENV={env}", f"SERVE_ARGS={args}") as (make, info):
        # METRICS_PORT unset: a port the OS picked (9464 may be another clone's), named as bound
        host, _, port = str(info["metrics"]).removeprefix("http://").partition(":")
        assert host == "127.0.0.1" and int(port.removesuffix("/metrics")) > 0, info["metrics"]
        with urllib.request.urlopen(info["metrics"], timeout=10) as page:
            assert b"kvtier_" in page.read()
        script = work / "snippet.py"
        script.write_text(readme_snippet(info["unix"]))
        assert "SNIPPET_OK" in run([env / "bin" / "python", script], cwd=work, timeout=60)
        os.killpg(make.pid, signal.SIGINT)  # Ctrl-C: the daemon drains and stops, then make
        make.wait(30)
        with pytest.raises(ProcessLookupError):
            os.kill(info["pid"], 0)
