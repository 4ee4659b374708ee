{{/* Names and labels. */}}
{{- define "tandem.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}{{ .Release.Name | trunc 40 | trimSuffix "-" }}{{- else -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "tandem.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "tandem.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The engine pools as a list of dicts: name, role (--kv-role), replicas, extraArgs. */}}
{{- define "tandem.pools" -}}
{{- $pools := list -}}
{{- if .Values.disaggregated.enabled -}}
{{- $pools = append $pools (dict "name" "prefill" "role" "producer" "replicas" .Values.disaggregated.prefill.replicas "extraArgs" .Values.disaggregated.prefill.extraArgs) -}}
{{- $pools = append $pools (dict "name" "decode" "role" "consumer" "replicas" .Values.disaggregated.decode.replicas "extraArgs" .Values.disaggregated.decode.extraArgs) -}}
{{- else -}}
{{- $pools = append $pools (dict "name" "engine" "role" "none" "replicas" .Values.pools.engine.replicas "extraArgs" .Values.pools.engine.extraArgs) -}}
{{- end -}}
{{- toYaml (dict "pools" $pools) -}}
{{- end -}}

{{/* A pool's StatefulSet and headless Service name. */}}
{{- define "tandem.poolName" -}}
{{ include "tandem.fullname" .root }}-{{ .pool }}
{{- end -}}

{{/* The frontend's dns:/// target for a pool: its headless Service, every ready pod. */}}
{{- define "tandem.poolTarget" -}}
dns:///{{ include "tandem.poolName" . }}.{{ .root.Release.Namespace }}.svc.cluster.local:{{ .root.Values.engine.port }}
{{- end -}}

{{/* A gRPC health probe: the kubelet's own on a plaintext port; on a TLS port an exec of the
image's Python with the mounted certificates (the kubelet's probe speaks plaintext only). */}}
{{- define "tandem.probe" -}}
{{- if .tls }}
exec:
  command:
    - python
    - -c
    - |
      import grpc, sys
      from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g
      read = lambda p: open(p, "rb").read()
      creds = grpc.ssl_channel_credentials(read("{{ .dir }}/ca.crt"), read("{{ .clientDir }}/tls.key"), read("{{ .clientDir }}/tls.crt"))
      ch = grpc.secure_channel("127.0.0.1:{{ .port }}", creds, options=[("grpc.ssl_target_name_override", "{{ .serverName }}")])
      s = g.HealthStub(ch).Check(h.HealthCheckRequest(service="{{ .service }}"), timeout=4).status
      sys.exit(0 if s == h.HealthCheckResponse.SERVING else 1)
{{- else }}
grpc:
  port: {{ .port }}
  service: {{ .service | quote }}
{{- end }}
{{- end -}}

{{- define "tandem.podSecurity" -}}
runAsNonRoot: true
runAsUser: {{ .Values.runAsUser }}
runAsGroup: {{ .Values.runAsUser }}
fsGroup: {{ .Values.runAsUser }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "tandem.containerSecurity" -}}
allowPrivilegeEscalation: false
capabilities:
  drop: [ALL]
{{- end -}}
