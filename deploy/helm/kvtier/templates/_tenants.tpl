{{/* The tenants file (docs/security.md "Tenants file"): when /metrics is scraped over the pod
     network, first (TOML: before any [[tenant]]) the scrape token's digest, a scrape-only
     credential: /metrics answers it with every figure, and every gRPC call and handshake
     refuses it like an unknown token, so the token a scrape sends in plaintext HTTP reads
     figures and acts on nothing. Then tenants.list, then tenants.groups ([[group]] tables:
     docs/security.md § Groups). */}}
{{- define "kvtier.tenantsToml" -}}
{{- if and .Values.metrics.enabled .Values.metrics.exposed }}
{{- $s := .Values.metrics.scrape -}}
metrics_tokens_sha256 = [{{ if $s.tokenSha256 }}{{ toJson $s.tokenSha256 }}{{ else }}{{ include "kvtier.scrapeToken" $ | sha256sum | toJson }}{{ end }}]
{{ end }}
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
arena_bytes = {{ include "kvtier.sizeText" . | toJson }}
{{- end }}
{{- with .maxLeaseS }}
max_lease_s = {{ float64 . }}
{{- end }}
{{- with .quotas }}
[tenant.quotas]
{{- range $k, $q := . }}
{{- if has $k (list "host_bytes" "pinned_bytes" "nvme_bytes" "buffered_bytes") }}
{{ $k }} = {{ include "kvtier.sizeText" $q | toJson }}
{{- else }}
{{ $k }} = {{ int64 $q }}
{{- end }}
{{- end }}
{{- end }}

{{ end }}
{{- range .Values.tenants.groups }}
[[group]]
name = {{ .name | toJson }}
publishers = {{ toJson .publishers }}
members = {{ toJson (.members | default list) }}
{{- with .arenaBytes }}
arena_bytes = {{ include "kvtier.sizeText" . | toJson }}
{{- end }}
{{- with .quotas }}
[group.quotas]
{{- range $k, $q := . }}
{{- if has $k (list "host_bytes" "nvme_bytes") }}
{{ $k }} = {{ include "kvtier.sizeText" $q | toJson }}
{{- else }}
{{ $k }} = {{ int64 $q }}
{{- end }}
{{- end }}
{{- end }}

{{ end }}
{{- end }}
