# kvtierd container image: the daemon only (no torch, no CUDA; the shm transport needs neither),
# installed from the two wheels this repository builds: kvtier (the SDK with the shared contract,
# which the daemon imports) and kvtierd (the daemon), as `pip install` would from an index.
#
#   docker build -t kvtier:0.2.0 .
#   docker run --rm -v kvtier-run:/run/kvtier -p 50052:50052 -p 9464:9464 kvtier:0.2.0 --host-bytes 8GiB
#
# 50052 is gRPC health only (probes): an SDK or `kvtier stats` pointed there is told so. Clients
# use the Unix socket in the kvtier-run volume, or gRPC on 50051, which listens on the container's
# loopback (not EXPOSEd) until --listen opens it with TLS and credentials (see below).
#
# Arguments after the image name are appended to `kvtierd serve` (a later flag wins), so the host
# tier size and policy can be set per deployment; see docs/configuration.md for every flag.
# The host tier is a memfd arena charged to this container's memory: give it a memory limit above
# --host-bytes (about 1 GiB of headroom). Static checks of this file: tests/unit/repository/test_deploy_files.py.

# ---- build: the two wheels (scripts/build_wheels.py; generated protobuf modules are committed) --
FROM python:3.11-slim AS build
WORKDIR /src
# The wheels are built offline (--no-build-isolation) with this setuptools.
RUN python -m pip install --no-cache-dir setuptools==84.2.1
COPY README.md ./
COPY packaging ./packaging
COPY scripts/build_wheels.py ./scripts/
COPY client ./client
COPY server ./server
RUN python scripts/build_wheels.py --out /wheels

# ---- runtime ----------------------------------------------------------------------------------
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KVTIER_LOG_LEVEL=INFO
# The daemon's pinned requirements (packaging/kvtierd/requirements.txt), the SDK wheel of the same
# version, the cluster tier's extra (redis-py, hiredis, blake3: used only when --cluster is
# given) and the KV events' extra (pyzmq, msgpack: used only when --events-endpoint is given);
# torch is not among them.
COPY --from=build /wheels /wheels
RUN python -m pip install --no-cache-dir /wheels/kvtier-*.whl "$(ls /wheels/kvtierd-*.whl)[cluster,events]" \
    && rm -rf /wheels \
    && groupadd --system --gid 10001 kvtier \
    && useradd --system --uid 10001 --gid kvtier --home-dir /var/lib/kvtier --create-home \
       --shell /usr/sbin/nologin kvtier \
    && mkdir -p /run/kvtier \
    && chown kvtier:kvtier /run/kvtier \
    && chmod 1770 /run/kvtier
WORKDIR /var/lib/kvtier
# Numeric, so that Kubernetes' runAsNonRoot can verify it.
USER 10001:10001

# /run/kvtier holds the gRPC Unix socket and the shm fd socket (kvtier.sock.shm) beside it: mount
# a volume there that the engine containers share, at the same path (the path is advertised).
VOLUME ["/run/kvtier"]
# 50052: gRPC health only (plaintext, for kubelet probes); 9464: Prometheus /metrics (plaintext
# HTTP: --allow-plaintext-metrics in the ENTRYPOINT says so explicitly). The control plane (50051) and the TCP data channel listen on 127.0.0.1 (pod-local; see docs).
EXPOSE 50052 9464

# Health: the standard gRPC health service, asked for the Kvtier service (NOT_SERVING while
# draining), on the health-only listener (--health-listen, port 50052): plaintext whatever --listen
# serves, so the probe stays right when the control plane serves TLS (see ENTRYPOINT below). Exits 0
# only on SERVING; any error (refused, deadline) exits 1.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; r = g.HealthStub(grpc.insecure_channel('127.0.0.1:50052')).Check(h.HealthCheckRequest(service='kvtier.v1.Kvtier'), timeout=3); sys.exit(0 if r.status == h.HealthCheckResponse.SERVING else 1)"]

# SIGTERM drains (stores refused, in-flight jobs get drain_timeout_s, 5 s by default); a second
# signal exits at once. Docker's default stop timeout (10 s) leaves room for the drain.
STOPSIGNAL SIGTERM
# gRPC listens on loopback only: same-pod engines use the Unix socket. For remote replicas, mount
# a certificate (a Kubernetes Secret) and append `--listen 0.0.0.0:50051 --tls-cert /etc/kvtier/
# tls.crt --tls-key /etc/kvtier/tls.key [--tls-client-ca ... --tls-require-client-cert]`; a
# non-loopback listener without TLS is refused (docs/security.md). 50052 serves gRPC health only,
# plaintext (the HEALTHCHECK and kubelet probes): keep --health-listen when overriding flags.
# /metrics on 0.0.0.0 is plaintext HTTP, refused without --allow-plaintext-metrics (with
# --tenants-file it then takes only the file's scrape tokens: docs/security.md).
ENTRYPOINT ["kvtierd", "serve", "--socket", "/run/kvtier/kvtier.sock", "--listen", "127.0.0.1:50051", "--health-listen", "0.0.0.0:50052", "--metrics-host", "0.0.0.0", "--allow-plaintext-metrics", "--metrics-port", "9464"]
CMD []
