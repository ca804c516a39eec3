{{/* The tenants file (docs/security.md "Tenants"): tenants.list, then, when /metrics is scraped
     over the pod network, the scraper: an operator (it sees every tenant's
     figures) with every quota 0, so it can open no session, register no namespace and hold
     nothing; its token, sent in plaintext HTTP, opens no session (an operator could still act
     in a session whose random id it knew: deploy/kubernetes/README.md "Metrics"). */}}
{{- define "kvtier.tenantsToml" -}}
{{- range .Values.tenants.list }}
[[tenant]]
name = {{ .name | toJson }}
{{- with .tokensSha256 }}
tokens_sha256 = {{ toJson . }}
{{- end }}
{{- with .unixUids }}
unix_uids = {{ toJson . }}
{{- end }}
{{- with .unixGids }}
unix_gids = {{ toJson . }}
{{- end }}
{{- if hasKey . "unixLogin" }}
unix_login = {{ .unixLogin }}
{{- end }}
{{- with .mtlsNames }}
mtls_names = {{ toJson . }}
{{- end }}
{{- if hasKey . "operator" }}
operator = {{ .operator }}
{{- end }}
{{- with .transports }}
transports = {{ toJson . }}
{{- end }}
{{- with .arenaBytes }}
arena_bytes = {{ toString . | toJson }}
{{- end }}
{{- with .maxLeaseS }}
max_lease_s = {{ float64 . }}
{{- end }}
{{- with .quotas }}
[tenant.quotas]
{{- range $k, $q := . }}
{{- if has $k (list "host_bytes" "pinned_bytes" "nvme_bytes" "buffered_bytes") }}
{{ $k }} = {{ toString $q | toJson }}
{{- else }}
{{ $k }} = {{ int64 $q }}
{{- end }}
{{- end }}
{{- end }}

{{ end }}
{{- if and .Values.metrics.enabled .Values.metrics.exposed }}
{{- $s := .Values.metrics.scrape }}
[[tenant]]
name = {{ $s.tenantName | toJson }}
tokens_sha256 = [{{ $s.tokenSha256 | default (sha256sum $s.token) | toJson }}]
operator = true
transports = ["tcp"]
[tenant.quotas]
sessions = 0
namespaces = 0
open_jobs = 0
session_open_jobs = 0
host_bytes = "0"
pinned_bytes = "0"
nvme_bytes = "0"
buffered_bytes = "8MiB"   # the least a tenant may have (one control frame); it opens no channel
control_channels = 0
{{- end }}
{{- end }}
