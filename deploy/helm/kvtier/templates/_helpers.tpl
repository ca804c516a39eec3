{{/* Names and labels. */}}
{{- define "kvtier.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvtier.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "kvtier.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "kvtier.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "kvtier.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvtier.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvtier.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "kvtier.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Secret names. */}}
{{- define "kvtier.tlsSecret" -}}
{{- .Values.tls.existingSecret | default (printf "%s-tls" (include "kvtier.fullname" .)) }}
{{- end }}
{{- define "kvtier.tenantsSecret" -}}
{{- .Values.tenants.existingSecret | default (printf "%s-tenants" (include "kvtier.fullname" .)) }}
{{- end }}
{{- define "kvtier.scrapeSecret" -}}
{{- .Values.metrics.scrape.existingSecret | default (printf "%s-metrics-token" (include "kvtier.fullname" .)) }}
{{- end }}

{{/* Whether a scrape needs a bearer token: /metrics of a daemon with tenants. */}}
{{- define "kvtier.scrapeNeedsToken" -}}
{{- if and .Values.metrics.enabled .Values.metrics.exposed .Values.tenants.enabled }}true{{ end }}
{{- end }}

{{/* Bytes of a kvtierd size ("16GiB", "512MiB", "4096"); the schema allows no other form. */}}
{{- define "kvtier.bytes" -}}
{{- $s := toString . }}
{{- $n := regexFind "^[0-9]+" $s | int64 }}
{{- $unit := trimPrefix (regexFind "^[0-9]+" $s) $s }}
{{- $mul := dict "" 1 "B" 1 "KiB" 1024 "MiB" 1048576 "GiB" 1073741824 "TiB" 1099511627776 }}
{{- if not (hasKey $mul $unit) }}{{ fail (printf "size %q: use B, KiB, MiB, GiB or TiB" $s) }}{{ end }}
{{- mul $n (get $mul $unit) }}
{{- end }}

{{/* Bytes of a Kubernetes memory quantity ("18Gi"). */}}
{{- define "kvtier.quantity" -}}
{{- $s := toString . }}
{{- $n := regexFind "^[0-9]+" $s | int64 }}
{{- $unit := trimPrefix (regexFind "^[0-9]+" $s) $s }}
{{- $mul := dict "" 1 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 }}
{{- if not (hasKey $mul $unit) }}{{ fail (printf "resources.limits.memory %q: use Ki, Mi, Gi or Ti" $s) }}{{ end }}
{{- mul $n (get $mul $unit) }}
{{- end }}

{{/* Checks that span several values: one clear line each, nothing rendered. */}}
{{- define "kvtier.validate" -}}
{{- $v := .Values }}
{{- if and $v.tls.enabled (not $v.tls.existingSecret) (or (not $v.tls.cert) (not $v.tls.key)) }}
{{- fail "tls.enabled: set tls.existingSecret (a kubernetes.io/tls Secret) or both tls.cert and tls.key" }}
{{- end }}
{{- if and $v.tls.requireClientCert (not $v.tls.existingSecret) (not $v.tls.clientCA) }}
{{- fail "tls.requireClientCert: set tls.clientCA (PEM), or tls.existingSecret with a ca.crt key" }}
{{- end }}
{{- if and $v.tenants.enabled (not $v.tenants.existingSecret) (not $v.tenants.list) }}
{{- fail "tenants.enabled: set tenants.list or tenants.existingSecret (a Secret with key tenants.toml)" }}
{{- end }}
{{- if and (include "kvtier.scrapeNeedsToken" .) (not $v.metrics.scrape.token) (not (and $v.metrics.scrape.existingSecret $v.metrics.scrape.tokenSha256)) }}
{{- fail "metrics.scrape: with tenants, /metrics asks for a token: set metrics.scrape.token, or metrics.scrape.existingSecret and metrics.scrape.tokenSha256 (or metrics.exposed=false: loopback only)" }}
{{- end }}
{{- range $v.daemon.extraArgs }}
{{- if has (regexReplaceAll "=.*" . "") (list "--listen" "--data-listen" "--allow-plaintext-remote" "--allow-plaintext-metrics" "--tenants-file" "--tls-cert" "--tls-key" "--metrics-host" "--socket") }}
{{- fail (printf "daemon.extraArgs: %s is set by the chart (tls, tenants, metrics, daemon.socketDir): use those values" .) }}
{{- end }}
{{- end }}
{{- $arenas := 0 }}
{{- if not $v.tenants.existingSecret }}
{{- range $v.tenants.list }}
{{- $maps := or (not .transports) (has "shm" .transports) (has "cuda_ipc" .transports) }}
{{- if $maps }}
{{- $size := .arenaBytes | default (dig "quotas" "host_bytes" "" .) | default "256MiB" }}
{{- $arenas = add $arenas (include "kvtier.bytes" $size | int64) }}
{{- end }}
{{- end }}
{{- end }}
{{- $need := add (include "kvtier.bytes" $v.daemon.hostBytes | int64) $arenas }}
{{- $limit := include "kvtier.quantity" (dig "limits" "memory" "0" $v.resources) | int64 }}
{{- if le $limit $need }}
{{- fail (printf "resources.limits.memory (%d bytes) must exceed daemon.hostBytes plus every tenant arena (%d bytes): the arenas are prefaulted and charged to the kvtier container" $limit $need) }}
{{- end }}
{{- end }}

{{/* `kvtierd serve` arguments (tests/unit/repository/test_helm_chart.py parses them with kvtierd's own parser). */}}
{{- define "kvtier.args" -}}
{{- $v := .Values }}
{{- $args := list "--socket" (printf "%s/kvtier.sock" $v.daemon.socketDir) "--socket-mode" (toString $v.daemon.socketMode) }}
{{- if $v.tls.enabled }}
{{- $args = concat $args (list "--listen" (printf "0.0.0.0:%d" (int $v.tls.listenPort)) "--data-listen" (printf "0.0.0.0:%d" (int $v.tls.dataPort))) }}
{{- $args = concat $args (list "--tls-cert" "/etc/kvtier/tls/tls.crt" "--tls-key" "/etc/kvtier/tls/tls.key") }}
{{- if $v.tls.requireClientCert }}
{{- $args = concat $args (list "--tls-client-ca" "/etc/kvtier/tls/ca.crt" "--tls-require-client-cert") }}
{{- end }}
{{- else if ne $v.mode "daemonset" }}
{{- $args = concat $args (list "--listen" (printf "127.0.0.1:%d" (int $v.tls.listenPort))) }}
{{- else }}
{{- $args = concat $args (list "--listen" "") }}
{{- end }}
{{- $args = concat $args (list "--health-listen" (printf "0.0.0.0:%d" (int $v.daemon.healthPort))) }}
{{- if $v.metrics.enabled }}
{{- $args = concat $args (list "--metrics-host" (ternary "0.0.0.0" "127.0.0.1" $v.metrics.exposed) "--metrics-port" (toString (int $v.metrics.port))) }}
{{- /* /metrics on the pod IP is plaintext HTTP: kvtierd refuses that without an explicit flag.
     --allow-plaintext-metrics, the narrow one: with tenants, /metrics then takes only the scrape
     token of the tenants file (metrics_tokens_sha256: figures, no action). Never
     --allow-plaintext-remote: it would let a tenant's or the operator's token, and plaintext
     gRPC, off the pod. */}}
{{- if $v.metrics.exposed }}
{{- $args = concat $args (list "--allow-plaintext-metrics") }}
{{- end }}
{{- else }}
{{- $args = concat $args (list "--metrics-port" "-1") }}
{{- end }}
{{- $args = concat $args (list "--host-bytes" (toString $v.daemon.hostBytes) "--eviction-policy" $v.daemon.evictionPolicy) }}
{{- if $v.daemon.disk.hostPath }}
{{- $args = concat $args (list "--disk-dir" "/var/lib/kvtier/nvme") }}
{{- if $v.daemon.disk.bytes }}{{ $args = concat $args (list "--disk-bytes" (toString $v.daemon.disk.bytes)) }}{{ end }}
{{- end }}
{{- if $v.tenants.enabled }}
{{- $args = concat $args (list "--tenants-file" "/etc/kvtier/tenants/tenants.toml") }}
{{- end }}
{{- $args = concat $args $v.daemon.extraArgs }}
{{- toJson $args }}
{{- end }}

{{/* The kvtier container. An engine chart that depends on this one (mode: external) puts it in
     its own pod: {{ include "kvtier.sidecar.container" .Subcharts.kvtier | nindent 8 }}, with
     the volumes of "kvtier.sidecar.volumes", an emptyDir "kvtier-run" mounted at
     daemon.socketDir in its engine too, and "kvtier.selectorLabels" on the pod for the metrics
     Service and monitors (tests/data/helm/engine-chart). */}}
{{- define "kvtier.sidecar.container" -}}
{{- $v := .Values -}}
- name: kvtier
  image: {{ printf "%s:%s" $v.image.repository ($v.image.tag | default .Chart.AppVersion) | quote }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  command: ["kvtierd", "serve"]
  args: {{ include "kvtier.args" . }}
  env:
    - name: KVTIER_LOG_LEVEL
      value: {{ $v.logLevel | quote }}
  ports:
    - name: health
      containerPort: {{ $v.daemon.healthPort }}
    {{- if and $v.metrics.enabled $v.metrics.exposed }}
    - name: metrics
      containerPort: {{ $v.metrics.port }}
    {{- end }}
    {{- if $v.tls.enabled }}
    - name: grpc-tls
      containerPort: {{ $v.tls.listenPort }}
    - name: data-tls
      containerPort: {{ $v.tls.dataPort }}
    {{- end }}
  resources: {{- toYaml $v.resources | nindent 4 }}
  # Prefaulting a large host tier takes seconds: the startup probe allows 3 minutes.
  startupProbe:
    grpc:
      port: {{ $v.daemon.healthPort }}
    periodSeconds: 2
    failureThreshold: 90
  # NOT_SERVING while draining after SIGTERM: the pod leaves endpoints at once.
  readinessProbe:
    grpc:
      port: {{ $v.daemon.healthPort }}
      service: kvtier.v1.Kvtier
    periodSeconds: 5
    timeoutSeconds: 2
  livenessProbe:
    grpc:
      port: {{ $v.daemon.healthPort }}
    periodSeconds: 10
    timeoutSeconds: 3
    failureThreshold: 3
  securityContext:
    runAsNonRoot: true
    runAsUser: 10001
    runAsGroup: 10001
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: true
    capabilities:
      drop: ["ALL"]
  volumeMounts:
    - name: kvtier-run
      mountPath: {{ $v.daemon.socketDir }}
    - name: kvtier-tmp
      mountPath: /tmp
    {{- if $v.tls.enabled }}
    - name: tls
      mountPath: /etc/kvtier/tls
      readOnly: true
    {{- end }}
    {{- if $v.tenants.enabled }}
    - name: tenants
      mountPath: /etc/kvtier/tenants
      readOnly: true
    {{- end }}
    {{- if $v.daemon.disk.hostPath }}
    - name: nvme
      mountPath: /var/lib/kvtier/nvme
    {{- end }}
{{- end }}

{{/* The pod volumes of the kvtier container, but the socket directory (kvtier-run: a hostPath
     for the DaemonSet, an emptyDir for a sidecar). */}}
{{- define "kvtier.sidecar.volumes" -}}
{{- $v := .Values -}}
- name: kvtier-tmp
  emptyDir:
    medium: Memory
    sizeLimit: 64Mi
{{- if $v.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "kvtier.tlsSecret" . }}
    defaultMode: 0440
{{- end }}
{{- if $v.tenants.enabled }}
- name: tenants
  secret:
    secretName: {{ include "kvtier.tenantsSecret" . }}
    defaultMode: 0440
{{- end }}
{{- if $v.daemon.disk.hostPath }}
- name: nvme
  hostPath:
    path: {{ $v.daemon.disk.hostPath }}
    type: Directory
{{- end }}
{{- end }}

{{/* A scrape endpoint's bearer token (the scrape-only token), when the daemon asks one. */}}
{{- define "kvtier.scrapeAuthorization" -}}
{{- if include "kvtier.scrapeNeedsToken" . }}
authorization:
  type: Bearer
  credentials:
    name: {{ include "kvtier.scrapeSecret" . }}
    key: {{ .Values.metrics.scrape.key }}
{{- end }}
{{- end }}
