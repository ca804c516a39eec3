"""A real Redis Cluster (3 masters, 3 replicas) on loopback, for tests (importable: tests/ is on sys.path).

Lifecycle: ``with RedisCluster(tmp_path / "redis") as cluster:`` picks six free loopback ports (each
with its cluster-bus port, port + 10000, free too), starts six ``redis-server`` processes, each in
its own directory under ``run_dir`` (``node-0`` ... ``node-5``: ``nodes.conf``, ``redis.log``,
``stdio.log``), joins them with ``redis-cli --cluster create --cluster-replicas 1`` and returns once
every node reports ``cluster_state:ok`` with all 16384 slots assigned and every replica's link to its
master is up. Persistence is off (no RDB, no AOF): a node restarted with ``restart`` or
``start_all`` comes back from its ``nodes.conf`` with its place in the cluster but none of its data,
except what it copies from a master as a replica.

Ownership: the instance owns the processes it starts and nothing else. ``__exit__`` SIGKILLs and
reaps every one of them, whether or not the test failed; a ``weakref.finalize`` and a module
``atexit`` hook do the same for an instance never exited, and on Linux each server started from the
main thread also gets ``PR_SET_PDEATHSIG`` so it dies with the test process. Clients handed out by
``client`` and ``cluster_client`` are closed on exit. ``run_dir`` (logs, ``nodes.conf``) is left
for the caller (usually pytest's ``tmp_path``) to inspect or remove.

Every wait polls every 0.05 s; a timeout raises ``RuntimeError`` naming what was not ready and
ending with the tail of the log of the node concerned.

Options: ``password=`` runs every node with ``requirepass`` and ``masterauth``; ``tls=True`` makes a
throw-away CA under ``run_dir/tls`` (``openssl`` CLI) with a server certificate (subjectAltName
IP:127.0.0.1, DNS:localhost; shared by every node, which also presents it as a client on the
cluster bus and to its master) and a client certificate, and runs every node TLS-only
(``--port 0 --tls-port P``, TLS on the cluster bus at P + 10000 and on replication). Every client
the harness makes (its own, ``client``, ``cluster_client``) authenticates and, under TLS, verifies
the server against the CA and presents the client certificate; ``connection_kwargs`` gives the same
redis-py keyword arguments to a test that builds its own client.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import redis
import redis.cluster
from redis.crc import key_slot

HOST = "127.0.0.1"
SLOTS = 16384
BUS_OFFSET = 10000
POLL_S = 0.05
N_MASTERS = 3
N_NODES = 6
REDIS_SERVER = "redis-server"
REDIS_CLI = "redis-cli"
OPENSSL = "openssl"
TLS_AUTH_CLIENTS = ("no", "optional", "yes")

# Extensions of the throw-away certificates (strict enough for X509_STRICT verifiers).
_OPENSSL_CNF = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = kvtier-test
[v3_ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[v3_server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = IP:127.0.0.1, DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
[v3_client]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
"""

_LIVE: set[subprocess.Popen[bytes]] = set()  # every server started here and not yet reaped
_LIVE_LOCK = threading.Lock()


def available() -> bool:
    """Whether ``redis-server`` and ``redis-cli`` are on PATH (tests skip cleanly without them)."""
    return shutil.which(REDIS_SERVER) is not None and shutil.which(REDIS_CLI) is not None


def _reap(procs: Iterable[subprocess.Popen[bytes]]) -> None:
    """SIGKILL and wait for each process; never raises."""
    for proc in list(procs):
        with contextlib.suppress(OSError):
            if proc.poll() is None:
                proc.kill()
    for proc in list(procs):
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            proc.wait(10)
        with _LIVE_LOCK:
            _LIVE.discard(proc)


@atexit.register
def _reap_all() -> None:
    with _LIVE_LOCK:
        procs = list(_LIVE)
    _reap(procs)


def _die_with_parent() -> None:
    """``preexec_fn``: ask Linux to SIGKILL the server when the thread that forked it exits."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _openssl(*args: str, cwd: Path) -> None:
    try:
        res = subprocess.run(
            [OPENSSL, *args], cwd=cwd, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
        )
    except FileNotFoundError as e:
        raise RuntimeError("tls=True needs the openssl CLI on PATH") from e
    if res.returncode != 0:
        raise RuntimeError(
            f"openssl {' '.join(args)} failed (rc {res.returncode}):\n{res.stdout}\n{res.stderr}"
        )


def make_test_pki(tls_dir: Path, days: int = 7) -> None:
    """Write a throw-away CA (``ca.crt``, ``ca.key``), a server certificate for 127.0.0.1 and
    localhost (``server.crt``, ``server.key``) and a client certificate (``client.crt``,
    ``client.key``), both signed by the CA, into ``tls_dir`` (P-256 keys, unencrypted)."""
    tls_dir.mkdir(parents=True, exist_ok=True)
    (tls_dir / "openssl.cnf").write_text(_OPENSSL_CNF)
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        "req",
        "-config",
        "openssl.cnf",
        "-x509",
        "-new",
        *key,
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        str(days),
        "-subj",
        "/CN=kvtier test CA",
        "-extensions",
        "v3_ca",
        cwd=tls_dir,
    )
    for name, cn in (("server", "localhost"), ("client", "kvtier test client")):
        _openssl(
            "req",
            "-config",
            "openssl.cnf",
            "-new",
            *key,
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={cn}",
            cwd=tls_dir,
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-set_serial",
            str(random.getrandbits(63)),
            "-days",
            str(days),
            "-sha256",
            "-extfile",
            "openssl.cnf",
            "-extensions",
            f"v3_{name}",
            "-out",
            f"{name}.crt",
            cwd=tls_dir,
        )
        (tls_dir / f"{name}.csr").unlink(missing_ok=True)


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as redis does: TIME_WAIT is fine
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _port_range() -> tuple[int, int]:
    """Ports to draw from: below the kernel's ephemeral range (bus port included) when it allows."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    if low - BUS_OFFSET > 12000:
        return 10000, low - BUS_OFFSET - 1
    return 10000, 65535 - BUS_OFFSET


def pick_ports(n: int, avoid: Iterable[int] = ()) -> list[int]:
    """``n`` loopback ports that are free, as are their cluster-bus ports (port + 10000)."""
    lo, hi = _port_range()
    taken = set(avoid)
    taken |= {p + BUS_OFFSET for p in taken}
    ports: list[int] = []
    rng = random.Random()
    for _ in range(5000):
        if len(ports) == n:
            return ports
        p = rng.randint(lo, hi)
        if {p, p + BUS_OFFSET} & taken or not (_port_free(p) and _port_free(p + BUS_OFFSET)):
            continue
        ports.append(p)
        taken |= {p, p + BUS_OFFSET}
    raise RuntimeError(f"could not find {n} free loopback port pairs in {lo}..{hi}")


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return f"({path.name} missing)"
    except OSError as e:
        return f"({path.name} unreadable: {e})"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class NodeView:
    """One line of ``CLUSTER NODES``."""

    node_id: str
    port: int
    flags: frozenset[str]
    master_id: str | None
    link_state: str
    slots: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_master(self) -> bool:
        return "master" in self.flags

    @property
    def failed(self) -> bool:
        return bool(self.flags & {"fail", "fail?", "noaddr", "handshake"})


def parse_cluster_nodes(text: str) -> list[NodeView]:
    nodes: list[NodeView] = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 8:
            continue
        addr = parts[1].split("@", 1)[0].split(",", 1)[0]
        slots: list[tuple[int, int]] = []
        for s in parts[8:]:
            if s.startswith("["):  # a slot being migrated or imported
                continue
            lo, _, hi = s.partition("-")
            slots.append((int(lo), int(hi or lo)))
        nodes.append(
            NodeView(
                node_id=parts[0],
                port=int(addr.rpartition(":")[2]),
                flags=frozenset(parts[2].split(",")),
                master_id=None if parts[3] == "-" else parts[3],
                link_state=parts[7],
                slots=slots,
            )
        )
    return nodes


def _info_fields(raw: bytes | str) -> dict[str, str]:
    text = raw.decode() if isinstance(raw, bytes) else raw
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


class RedisCluster:
    """Six ``redis-server`` processes forming a 3-master, 3-replica cluster; a context manager."""

    def __init__(
        self,
        run_dir: Path,
        *,
        maxmemory: str | None = None,
        node_timeout_ms: int = 1000,
        ready_timeout_s: float = 30.0,
        password: str | None = None,
        tls: bool = False,
        tls_auth_clients: str = "optional",
    ) -> None:
        self.run_dir = Path(run_dir)
        self.maxmemory = maxmemory
        self.node_timeout_ms = node_timeout_ms
        self.ready_timeout_s = ready_timeout_s
        if tls_auth_clients not in TLS_AUTH_CLIENTS:
            raise ValueError(f"tls_auth_clients must be one of {TLS_AUTH_CLIENTS}, not {tls_auth_clients!r}")
        self.password = password  # requirepass and masterauth of every node; None: no auth
        self.tls = tls
        self.tls_auth_clients = tls_auth_clients  # redis' tls-auth-clients (no, optional, yes)
        # Under TLS (written by start): the CA, the nodes' certificate and a client certificate.
        tls_dir = self.run_dir / "tls"
        self.ca_file: Path | None = tls_dir / "ca.crt" if tls else None
        self.server_cert_file: Path | None = tls_dir / "server.crt" if tls else None
        self.server_key_file: Path | None = tls_dir / "server.key" if tls else None
        self.client_cert_file: Path | None = tls_dir / "client.crt" if tls else None
        self.client_key_file: Path | None = tls_dir / "client.key" if tls else None
        self.tls_setup_s = 0.0  # how long making the certificates took
        self.ports: list[int] = []
        self.initial_masters: list[int] = []
        self._dirs: dict[int, Path] = {}
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._clients: list[Any] = []
        self._owned_slots: dict[int, list[tuple[int, int]]] = {}  # a killed master's slots
        self._heirs: dict[int, list[int]] = {}  # a killed master's replicas
        self._finalizer = weakref.finalize(self, _reap, self._procs.values())
        self.startup_s = 0.0  # how long __enter__ took

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> RedisCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def start(self) -> None:
        """Start six fresh nodes, create the cluster and wait until it is ready."""
        if not available():
            raise RuntimeError("redis-server / redis-cli not on PATH")
        t0 = time.monotonic()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.tls:
            make_test_pki(self.run_dir / "tls")
            self.tls_setup_s = time.monotonic() - t0
        ports = pick_ports(N_NODES)
        for i in range(N_NODES):
            d = self.run_dir / f"node-{i}"
            d.mkdir(parents=True, exist_ok=True)
            for attempt in range(5):  # another process may grab a port between the check and bind
                port = ports[i]
                self._dirs[port] = d
                self._spawn(port)
                try:
                    self._wait_ping(port)
                    break
                except RuntimeError:
                    if attempt == 4 or "Address already in use" not in _tail(d / "redis.log", 200):
                        raise
                    self._reap_node(port)
                    del self._dirs[port]
                    (d / "nodes.conf").unlink(missing_ok=True)
                    ports[i] = pick_ports(1, avoid=ports)[0]
        self.ports = ports
        cmd = [
            REDIS_CLI,
            "--cluster",
            "create",
            *(f"{HOST}:{p}" for p in ports),
            "--cluster-replicas",
            "1",
            "--cluster-yes",
            *self._cli_args(),
        ]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(
                f"redis-cli --cluster create timed out: {e.stdout!r}{self._log_note(ports[0])}"
            ) from e
        if res.returncode != 0:
            raise RuntimeError(
                f"redis-cli --cluster create failed (rc {res.returncode}):\n"
                f"{res.stdout}\n{res.stderr}{self._log_note(ports[0])}"
            )
        self.wait_ready()
        self.initial_masters = self.masters()
        self.startup_s = time.monotonic() - t0

    def close(self) -> None:
        """Close handed-out clients and SIGKILL + reap every node (idempotent)."""
        for c in self._clients:
            with contextlib.suppress(Exception):
                c.close()
        self._clients.clear()
        _reap(self._procs.values())
        self._procs.clear()

    # -- processes -------------------------------------------------------------------------------

    def _cli_args(self) -> list[str]:
        """``redis-cli`` options for the password and TLS settings."""
        args: list[str] = []
        if self.password is not None:
            args += ["-a", self.password, "--no-auth-warning"]
        if self.tls:
            args += [
                "--tls",
                "--cacert",
                str(self.ca_file),
                "--cert",
                str(self.client_cert_file),
                "--key",
                str(self.client_key_file),
            ]
        return args

    def _listen_args(self, port: int) -> list[str]:
        if not self.tls:
            return ["--port", str(port)]
        return [
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--cluster-port",
            str(port + BUS_OFFSET),
            "--tls-cluster",
            "yes",
            "--tls-replication",
            "yes",
            "--tls-cert-file",
            str(self.server_cert_file),
            "--tls-key-file",
            str(self.server_key_file),
            "--tls-ca-cert-file",
            str(self.ca_file),
            "--tls-auth-clients",
            self.tls_auth_clients,
        ]

    def _argv(self, port: int) -> list[str]:
        d = self._dirs[port]
        argv = [
            REDIS_SERVER,
            *self._listen_args(port),
            "--bind",
            HOST,
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            str(self.node_timeout_ms),
            "--save",
            "",
            "--appendonly",
            "no",
            # No persistence means none: a replica would otherwise keep the RDB of its last full
            # sync as dump.rdb and reload it on restart (stale data, a partial resync).
            "--rdb-del-sync-files",
            "yes",
            # Full syncs start at once instead of waiting 5 s for more replicas to join.
            "--repl-diskless-sync-delay",
            "0",
            "--cluster-require-full-coverage",
            "no",
            "--cluster-allow-reads-when-down",
            "yes",
            "--protected-mode",
            "no",
            "--daemonize",
            "no",
            "--logfile",
            str(d / "redis.log"),
            "--dir",
            str(d),
        ]
        if self.maxmemory is not None:
            argv += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        if self.password is not None:
            argv += ["--requirepass", self.password, "--masterauth", self.password]
        return argv

    def _spawn(self, port: int) -> None:
        d = self._dirs[port]
        preexec: Callable[[], None] | None = None
        if threading.current_thread() is threading.main_thread() and os.uname().sysname == "Linux":
            preexec = _die_with_parent
        with open(d / "stdio.log", "ab") as stdio:
            proc = subprocess.Popen(
                self._argv(port),
                cwd=d,
                stdin=subprocess.DEVNULL,
                stdout=stdio,
                stderr=subprocess.STDOUT,
                preexec_fn=preexec,
            )
        with _LIVE_LOCK:
            _LIVE.add(proc)
        self._procs[port] = proc

    def _reap_node(self, port: int) -> None:
        proc = self._procs.pop(port, None)
        if proc is not None:
            _reap([proc])

    def alive(self, port: int) -> bool:
        proc = self._procs.get(port)
        return proc is not None and proc.poll() is None

    def live_ports(self) -> list[int]:
        return [p for p in self.ports if self.alive(p)]

    def pause(self, port: int) -> None:
        """SIGSTOP the node: it keeps its sockets but answers nothing (a slow or hung node)."""
        self._procs[port].send_signal(signal.SIGSTOP)

    def resume(self, port: int) -> None:
        """SIGCONT a node stopped by ``pause``."""
        self._procs[port].send_signal(signal.SIGCONT)

    def node_dir(self, port: int) -> Path:
        return self._dirs[port]

    def log_tail(self, port: int, lines: int = 30) -> str:
        d = self._dirs[port]
        return _tail(d / "redis.log", lines) + "\n" + _tail(d / "stdio.log", 5)

    def _log_note(self, port: int | None) -> str:
        if port is None or port not in self._dirs:
            return ""
        return f"\n--- tail of {self._dirs[port] / 'redis.log'} (port {port}) ---\n{self.log_tail(port)}"

    def _wait_ping(self, port: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        c = self._raw(port)
        try:
            while True:
                proc = self._procs[port]
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"redis-server on port {port} exited with {proc.returncode} "
                        f"before answering PING{self._log_note(port)}"
                    )
                with contextlib.suppress(redis.RedisError, OSError):
                    if c.ping():
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis-server on port {port} did not answer PING within "
                        f"{timeout:.0f} s{self._log_note(port)}"
                    )
                time.sleep(POLL_S)
        finally:
            c.close()

    def kill(self, port: int) -> None:
        """SIGKILL one node (its slots and replicas are remembered for ``wait_failover``)."""
        self._owned_slots.pop(port, None)
        self._heirs.pop(port, None)
        with contextlib.suppress(RuntimeError):
            view = self.nodes()
            me = next((n for n in view if n.port == port and n.is_master and n.slots), None)
            if me is not None:
                self._owned_slots[port] = me.slots
                self._heirs[port] = [n.port for n in view if n.master_id == me.node_id]
        self._reap_node(port)

    def restart(self, port: int, *, wait: bool = True) -> None:
        """Start a killed node again from its dir and ``nodes.conf``; by default wait until the
        whole cluster is ready again (the node rejoined; a former master comes back as a replica
        of the one promoted in its place, once that failover happened)."""
        if self.alive(port):
            raise RuntimeError(f"node {port} is still running")
        self._spawn(port)
        self._wait_ping(port)
        if wait:
            self.wait_ready()

    def stop_all(self) -> None:
        """SIGKILL every node (the cluster is lost; ``start_all`` brings it back, empty)."""
        for p in self.ports:
            self._reap_node(p)

    def start_all(self, *, wait: bool = True) -> None:
        """Start every node that is not running from its ``nodes.conf`` and wait until ready."""
        down = [p for p in self.ports if not self.alive(p)]
        for p in down:
            self._spawn(p)
        for p in down:
            self._wait_ping(p)
        if wait:
            self.wait_ready()

    # -- views -----------------------------------------------------------------------------------

    def connection_kwargs(self, *, client_cert: bool = True) -> dict[str, Any]:
        """redis-py keyword arguments (sync, asyncio, cluster) for the password and TLS settings:
        ``password``; under TLS ``ssl``, ``ssl_ca_certs`` and, with ``client_cert``, the client
        certificate (``ssl_certfile``, ``ssl_keyfile``). Empty for a plain cluster."""
        kw: dict[str, Any] = {}
        if self.password is not None:
            kw["password"] = self.password
        if self.tls:
            kw.update(ssl=True, ssl_ca_certs=str(self.ca_file))
            if client_cert:
                kw.update(ssl_certfile=str(self.client_cert_file), ssl_keyfile=str(self.client_key_file))
        return kw

    def _raw(self, port: int, timeout: float = 5.0) -> redis.Redis:
        return redis.Redis(
            host=HOST,
            port=port,
            decode_responses=False,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            **self.connection_kwargs(),
        )

    def _command(self, port: int, *args: str) -> Any:
        c: Any = self._raw(port)  # redis-py's execute_command is untyped
        try:
            return c.execute_command(*args)
        finally:
            c.close()

    def _any_live(self) -> list[int]:
        live = self.live_ports()
        if not live:
            raise RuntimeError("no redis node is running")
        return live

    def nodes(self, port: int | None = None) -> list[NodeView]:
        """``CLUSTER NODES`` as seen by ``port`` (by default, the first live node that answers)."""
        last: Exception | None = None
        for p in [port] if port is not None else self._any_live():
            try:
                return parse_cluster_nodes(self._command(p, "CLUSTER", "NODES").decode())
            except (redis.RedisError, OSError) as e:
                last = e
        raise RuntimeError(f"no node answered CLUSTER NODES: {last!r}")

    def cluster_info(self, port: int) -> dict[str, str]:
        return _info_fields(self._command(port, "CLUSTER", "INFO"))

    def _usable(self, n: NodeView) -> bool:
        return not n.failed and self.alive(n.port)

    def masters(self) -> list[int]:
        """Ports of the masters (per ``CLUSTER NODES`` of a live node) that run and are not failed."""
        return sorted(n.port for n in self.nodes() if n.is_master and self._usable(n))

    def replicas_of(self, port: int) -> list[int]:
        """Ports of the running, non-failed replicas of the master on ``port``."""
        view = self.nodes()
        mid = next((n.node_id for n in view if n.port == port), None)
        if mid is None:
            raise RuntimeError(f"port {port} is not a cluster node")
        return sorted(n.port for n in view if n.master_id == mid and self._usable(n))

    def master_for_key(self, key: bytes) -> int:
        """The port of the master serving ``key``'s slot, per ``CLUSTER SLOTS`` of a live node."""
        slot = key_slot(key)
        for p in self._any_live():
            try:
                ranges = self._command(p, "CLUSTER", "SLOTS")
            except (redis.RedisError, OSError):
                continue
            for entry in ranges:
                if int(entry[0]) <= slot <= int(entry[1]):
                    return int(entry[2][1])
            raise RuntimeError(f"slot {slot} of {key!r} is not assigned (asked port {p})")
        raise RuntimeError("no node answered CLUSTER SLOTS")

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [(HOST, p) for p in self.ports]

    @property
    def url(self) -> str:
        """``redis://h:p,h:p,h:p`` (``rediss://`` under TLS) of the current masters (the initial
        ones when none answers); the password is not in it (see ``password``)."""
        try:
            masters = self.masters() or self.initial_masters
        except RuntimeError:
            masters = self.initial_masters
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://" + ",".join(f"{HOST}:{p}" for p in masters)

    # -- clients ---------------------------------------------------------------------------------

    def client(self, port: int) -> redis.Redis:
        """A plain single-node client (bytes in, bytes out); closed when the cluster exits."""
        c = self._raw(port, timeout=10.0)
        self._clients.append(c)
        return c

    def cluster_client(self) -> redis.cluster.RedisCluster:
        """A redis-py cluster client over the running nodes; closed when the cluster exits."""
        node_cls: Any = redis.cluster.ClusterNode  # untyped in redis-py
        nodes = [node_cls(HOST, p) for p in (self.live_ports() or self.ports)]
        c = redis.cluster.RedisCluster(
            startup_nodes=nodes,
            decode_responses=False,
            socket_timeout=10.0,
            socket_connect_timeout=5.0,
            **self.connection_kwargs(),
        )
        self._clients.append(c)
        return c

    # -- waits -----------------------------------------------------------------------------------

    def _problem(self) -> tuple[int | None, str] | None:
        """Why the live part of the cluster is not ready yet (port concerned, words), or None."""
        live = self.live_ports()
        if not live:
            return None, "no node is running"
        ids: dict[str, int] = {}
        for p in live:
            try:
                info = self.cluster_info(p)
            except (redis.RedisError, OSError) as e:
                return p, f"CLUSTER INFO failed: {e!r}"
            if info.get("cluster_state") != "ok":
                return p, f"cluster_state:{info.get('cluster_state')}"
            for k in ("cluster_slots_assigned", "cluster_slots_ok"):
                if info.get(k) != str(SLOTS):
                    return p, f"{k}:{info.get(k)}"
            try:
                view = self.nodes(p)
            except RuntimeError as e:
                return p, str(e)
            for n in view:
                ids[n.node_id] = n.port
                if self.alive(n.port) and n.failed:
                    return p, f"sees running node {n.port} as {','.join(sorted(n.flags))}"
            if len(view) < len(self.ports):
                return p, f"knows {len(view)} of {len(self.ports)} nodes"
        if len(live) == len(self.ports):  # all up: N_MASTERS masters, each with a live replica
            view = self.nodes(live[0])
            masters = [n for n in view if n.is_master and n.slots]
            if len(masters) != N_MASTERS:
                return live[0], f"{len(masters)} masters own slots, expected {N_MASTERS}"
            for m in masters:
                if not any(n.master_id == m.node_id for n in view):
                    return m.port, "master without a replica"
        for p in live:
            me = next(n for n in self.nodes(p) if "myself" in n.flags)
            if me.is_master:
                continue
            try:
                link = self._replication(p).get("master_link_status")
            except (redis.RedisError, OSError) as e:
                return p, f"INFO replication failed: {e!r}"
            if link != "up":
                return p, f"replica of {ids.get(me.master_id or '', '?')}: master_link_status:{link}"
        return None

    def _replication(self, port: int) -> dict[str, Any]:
        c = self._raw(port)
        try:
            info: dict[str, Any] = c.info("replication")
        finally:
            c.close()
        return info

    def _wait(self, what: str, check: Callable[[], tuple[int | None, str] | None], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            problem = check()
            if problem is None:
                return
            if time.monotonic() > deadline:
                port, words = problem
                where = f"node {port}: " if port is not None else ""
                raise RuntimeError(
                    f"{what} not reached within {timeout:.0f} s; last: {where}{words}{self._log_note(port)}"
                )
            time.sleep(POLL_S)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until every running node reports ``cluster_state:ok`` with all slots assigned and
        served, sees no running node as failed, and every running replica's master link is up."""
        self._wait("cluster ready", self._problem, self.ready_timeout_s if timeout is None else timeout)

    def wait_failover(self, dead_port: int, timeout: float = 30.0) -> int:
        """Wait until the slots the dead master on ``dead_port`` served are served by another,
        running master, in the view of every running node, and the cluster is ready; return that
        master's port."""
        slots = self._owned_slots.get(dead_port)
        if not slots:
            slots = next((n.slots for n in self.nodes() if n.port == dead_port), [])
        if not slots:
            raise RuntimeError(f"no slots known for port {dead_port} (was it a master?)")
        probe = slots[0][0]
        found: list[int] = []

        def check() -> tuple[int | None, str] | None:
            owners: set[int] = set()
            for p in self.live_ports():
                try:
                    view = self.nodes(p)
                except RuntimeError as e:
                    return p, str(e)
                owner = next(
                    (n for n in view if n.is_master and any(lo <= probe <= hi for lo, hi in n.slots)), None
                )
                if owner is None or owner.port == dead_port or not self.alive(owner.port):
                    heirs = [h for h in self._heirs.get(dead_port, []) if self.alive(h)]
                    return (
                        (heirs[0] if heirs else p),
                        f"slot {probe} still served by {owner.port if owner else 'nobody'} per node {p}"
                        f" (running replicas of {dead_port}: {heirs})",
                    )
                owners.add(owner.port)
            if len(owners) != 1:
                return None, f"nodes disagree on who serves slot {probe}: {sorted(owners)}"
            problem = self._problem()
            if problem is not None:
                return problem
            found[:] = list(owners)
            return None

        self._wait(f"failover of {dead_port}", check, timeout)
        return found[0]
