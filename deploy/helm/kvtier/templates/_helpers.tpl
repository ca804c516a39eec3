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

{{/* The scrape token (no existingSecret): metrics.scrape.token, else the one the chart's Secret
     already holds in the cluster (lookup: kept across upgrades), else a new random one. Set
     into .Values on first use, so that the tenants file's digest, the Secret and the checksum
     of every template agree within one render. */}}
{{- define "kvtier.scrapeToken" -}}
{{- $s := .Values.metrics.scrape }}
{{- if not $s.token }}
{{- $old := lookup "v1" "Secret" .Release.Namespace (include "kvtier.scrapeSecret" .) }}
{{- $kept := dig "data" $s.key "" ($old | default dict) }}
{{- $_ := set $s "token" (ternary (b64dec $kept) (randAlphaNum 43) (ne $kept "")) }}
{{- end }}
{{- $s.token }}
{{- end }}

{{/* Whether a scrape needs a bearer token: /metrics of a daemon with tenants. */}}
{{- define "kvtier.scrapeNeedsToken" -}}
{{- if and .Values.metrics.enabled .Values.metrics.exposed .Values.tenants.enabled }}true{{ end }}
{{- end }}

{{/* A size as text: a number in a values file (JSON: a float) written as an integer. */}}
{{- define "kvtier.sizeText" -}}
{{- if or (kindIs "float64" .) (kindIs "int64" .) (kindIs "int" .) }}{{ int64 . }}{{ else }}{{ toString . }}{{ end }}
{{- end }}

{{/* Bytes of a kvtierd size, as kvtier_contract.units.parse_bytes reads it (values.schema.json
     admits the same forms): an integer, or digits with an optional fraction and an optional
     unit, case-insensitive, blanks around: "16GiB", "512 mib", "1.5GiB", "4k" (1000), "4Ki"
     (1024), "100GB" (10^11). A fraction must come to a whole number of bytes. */}}
{{- define "kvtier.bytes" -}}
{{- $s := include "kvtier.sizeText" . }}
{{- $ok := regexMatch "^\\s*[0-9]+(\\.[0-9]+)?\\s*[a-zA-Z]*\\s*$" $s }}
{{- $mul := dict "" 1 "b" 1 "k" 1000 "kb" 1000 "m" 1000000 "mb" 1000000 "g" 1000000000 "gb" 1000000000 "t" 1000000000000 "tb" 1000000000000 "ki" 1024 "kib" 1024 "mi" 1048576 "mib" 1048576 "gi" 1073741824 "gib" 1073741824 "ti" 1099511627776 "tib" 1099511627776 }}
{{- $unit := lower (regexReplaceAll "^[\\s0-9.]*([a-zA-Z]*)\\s*$" $s "${1}") }}
{{- if or (not $ok) (not (hasKey $mul $unit)) }}{{ fail (printf "size %q: cannot parse it (examples: 16GiB, 512MiB, 4096)" $s) }}{{ end }}
{{- $n := regexFind "[0-9]+" $s | int64 }}
{{- $frac := regexReplaceAll "^\\s*[0-9]+\\.?([0-9]*).*$" $s "${1}" }}
{{- $u := get $mul $unit | int64 }}
{{- $bytes := mul $n $u }}
{{- if $frac }}
{{- $scale := printf "1%s" (repeat (len $frac) "0") | int64 }}
{{- $part := mul (atoi $frac) $u }}
{{- if mod $part $scale }}{{ fail (printf "size %q is not a whole number of bytes" $s) }}{{ end }}
{{- $bytes = add $bytes (div $part $scale) }}
{{- end }}
{{- $bytes }}
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
{{- /* Issue 39: TLS listeners on the pod IP need a client credential: a tenant's token or
     mTLS name, or a client certificate signed by the client CA. */}}
{{- if and $v.tls.enabled (not $v.tenants.enabled) (not $v.tls.requireClientCert) }}
{{- fail "tls.enabled: gRPC and the data channel would listen on the pod IP with no client credential (anyone holding the CA certificate reads every block): set tenants.enabled (engines present a tenant's token or mTLS name) or tls.requireClientCert (engines present a certificate signed by tls.clientCA)" }}
{{- end }}
{{- /* Issue 39: a node daemon without tenants lets every engine pod that mounts the socket
     directory read and write every block, and /metrics can ask no token. */}}
{{- if and (eq $v.mode "daemonset") (not $v.tenants.enabled) (not $v.daemonset.allowWithoutTenants) }}
{{- fail (printf "mode daemonset: without tenants every engine pod of the node that mounts %s reads and writes every block, and /metrics on the pod IP asks no token: set tenants.enabled with tenants.list (e.g. one tenant for the node's engines, run with runAsGroup 10001: name, unixLogin: true, unixGids: [10001], arenaBytes; or a token per team) or tenants.existingSecret; or daemonset.allowWithoutTenants=true when every such pod is one trust domain (deploy/kubernetes/README.md, Helm)" $v.daemon.socketDir) }}
{{- end }}
{{- if and (include "kvtier.scrapeNeedsToken" .) $v.metrics.scrape.existingSecret (not $v.metrics.scrape.tokenSha256) }}
{{- fail "metrics.scrape.existingSecret: also set metrics.scrape.tokenSha256, the token's SHA-256 (echo -n \"$TOKEN\" | kvtierd hash-token), for the tenants file" }}
{{- end }}
{{- range $v.daemon.extraArgs }}
{{- if has (regexReplaceAll "=.*" . "") (list "--listen" "--data-listen" "--allow-plaintext-remote" "--allow-plaintext-metrics" "--tenants-file" "--tls-cert" "--tls-key" "--metrics-host" "--socket") }}
{{- fail (printf "daemon.extraArgs: %s is set by the chart (tls, tenants, metrics, daemon.socketDir): use those values" .) }}
{{- end }}
{{- end }}
{{- $arenas := 0 }}
{{- $mapping := list }}
{{- if not $v.tenants.existingSecret }}
{{- range $v.tenants.list }}
{{- $maps := or (not .transports) (has "shm" .transports) (has "cuda_ipc" .transports) }}
{{- if $maps }}
{{- $mapping = append $mapping .name }}
{{- $size := .arenaBytes | default (dig "quotas" "host_bytes" "" .) | default "256MiB" }}
{{- $arenas = add $arenas (include "kvtier.bytes" $size | int64) }}
{{- end }}
{{- end }}
{{- range $v.tenants.groups }}{{/* a group one of whose readers maps memory: an arena too */}}
{{- $group := . }}
{{- $reads := false }}
{{- range concat .publishers (.members | default list) }}
{{- if has . $mapping }}{{ $reads = true }}{{ end }}
{{- end }}
{{- if $reads }}
{{- $size := $group.arenaBytes | default (dig "quotas" "host_bytes" "" $group) | default "256MiB" }}
{{- $arenas = add $arenas (include "kvtier.bytes" $size | int64) }}
{{- end }}
{{- end }}
{{- end }}
{{- $need := add (include "kvtier.bytes" $v.daemon.hostBytes | int64) $arenas }}
{{- $limit := include "kvtier.quantity" (dig "limits" "memory" "0" $v.resources) | int64 }}
{{- if le $limit $need }}
{{- fail (printf "resources.limits.memory (%d bytes) must exceed daemon.hostBytes plus every tenant's and group's arena (%d bytes): the arenas are prefaulted and charged to the kvtier container" $limit $need) }}
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
{{- $args = concat $args (list "--host-bytes" (include "kvtier.sizeText" $v.daemon.hostBytes) "--eviction-policy" $v.daemon.evictionPolicy) }}
{{- if $v.daemon.disk.hostPath }}
{{- $args = concat $args (list "--disk-dir" "/var/lib/kvtier/nvme") }}
{{- if $v.daemon.disk.bytes }}{{ $args = concat $args (list "--disk-bytes" (include "kvtier.sizeText" $v.daemon.disk.bytes)) }}{{ end }}
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

{{/* The init container that makes the socket directory (the kvtier-run volume) the daemon's,
     uid and group 10001 (the engines' way in), mode 1770: kvtierd refuses a socket directory
     others may write without the sticky bit (any of them could rename its socket away and
     serve a fake one at its path, collecting tokens). Root with only CHOWN and FOWNER. */}}
{{- define "kvtier.prepareSocketDir" -}}
# The socket directory: the daemon's (10001), the engines' group (10001), 1770 (sticky).
- name: prepare-socket-dir
  image: {{ printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) | quote }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["sh", "-c", "chown 10001:10001 \"$0\" && chmod 1770 \"$0\"", {{ .Values.daemon.socketDir | quote }}]
  securityContext:
    runAsUser: 0
    runAsNonRoot: false
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: true
    capabilities:
      drop: ["ALL"]
      add: ["CHOWN", "FOWNER"]
  volumeMounts:
    - name: kvtier-run
      mountPath: {{ .Values.daemon.socketDir }}
{{- end }}
