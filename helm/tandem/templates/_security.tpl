{{/* Who the pods are and what they hold: the ServiceAccount, mutual TLS files and probe,
     and the credential combinations the services would refuse. */}}

{{/* The ServiceAccount every pod runs as. */}}
{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tandem.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "tandem.podIdentity" -}}
serviceAccountName: {{ include "tandem.serviceAccountName" . }}
automountServiceAccountToken: {{ .Values.serviceAccount.automountServiceAccountToken }}
{{- end }}

{{/* Mutual TLS: the flags (file paths, and the name every server's certificate is checked
     against instead of the dialled address: pod IPs are in no Secret's certificate), the volume
     and its mount. */}}
{{- define "tandem.tlsArgs" -}}
{{- $t := .Values.tls }}
{{- if $t.enabled }}
- --tls-cert
- {{ printf "%s/tls.crt" $t.mountPath }}
- --tls-key
- {{ printf "%s/tls.key" $t.mountPath }}
- --tls-ca
- {{ printf "%s/ca.crt" $t.mountPath }}
{{- with $t.serverName }}
- --tls-server-name
- {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* A volume named `name` holding tls.crt, tls.key and ca.crt from Secret `secret`'s keys. */}}
{{- define "tandem.tlsSecretVolume" -}}
{{- $t := .root.Values.tls }}
- name: {{ .name }}
  secret:
    secretName: {{ .secret }}
    items:
      - {key: {{ $t.certKey }}, path: tls.crt}
      - {key: {{ $t.keyKey }}, path: tls.key}
      - {key: {{ $t.caKey }}, path: ca.crt}
{{- end }}

{{- define "tandem.tlsVolume" -}}
{{- $t := .Values.tls }}
{{- if $t.enabled }}
{{- if $t.volume }}
- {{ merge (dict "name" "tls") (deepCopy $t.volume) | toYaml | nindent 2 | trim }}
{{- else }}
{{- include "tandem.tlsSecretVolume" (dict "root" . "name" "tls" "secret" $t.existingSecret) }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tandem.tlsMount" -}}
{{- if .Values.tls.enabled }}
- {name: tls, mountPath: {{ .Values.tls.mountPath }}, readOnly: true}
{{- end }}
{{- end }}

{{/* grpc.health.v1 Check of service argv[2] at $POD_IP:argv[1] over mutual TLS with the
     pod's own certificate, checking the server's against tls.serverName when set (as the
     services do); exit 0 when SERVING. */}}
{{- define "tandem.tlsProbe" -}}
import os, sys, grpc
from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as hg
d = {{ .Values.tls.mountPath | quote }}
r = lambda n: open(os.path.join(d, n), "rb").read()
c = grpc.ssl_channel_credentials(r("ca.crt"), r("tls.key"), r("tls.crt"))
n = {{ .Values.tls.serverName | quote }}
o = [("grpc.ssl_target_name_override", n)] if n else []
with grpc.secure_channel(os.environ["POD_IP"] + ":" + sys.argv[1], c, options=o) as ch:
    s = hg.HealthStub(ch).Check(h.HealthCheckRequest(service=sys.argv[2]), timeout={{ sub .Values.tls.probeTimeoutSeconds 1 | max 1 }}).status
sys.exit(0 if s == h.HealthCheckResponse.SERVING else 1)
{{- end }}

{{/* Credentials the router or a worker would refuse at startup, refused here naming the value. */}}
{{- define "tandem.validateCredentials" -}}
{{- $a := .Values.auth }}
{{- $t := .Values.tls }}
{{- if and $a.clientToken.existingSecret (not $a.serviceToken.existingSecret) (not $t.enabled) }}
{{- fail "auth.clientToken.existingSecret: the router refuses a client token without the service secret or mutual TLS (service_secret: required with a client token): set auth.serviceToken.existingSecret or tls.enabled too" }}
{{- end }}
{{- if and $t.serverName (not $t.enabled) }}
{{- fail "tls.serverName: names the certificate the mutual-TLS channels check, and the services refuse --tls-server-name without mutual TLS (tls_server_name: needs mutual TLS): set tls.enabled too, or leave tls.serverName empty" }}
{{- end }}
{{- if and $t.enabled (not $t.existingSecret) (not $t.volume) }}
{{- fail "tls.existingSecret: required when tls.enabled is true (a Secret holding the certificate, key and CA), unless tls.volume gives them" }}
{{- end }}
{{- if and $t.enabled .Values.test.enabled (not $t.clientSecret) }}
{{- fail "tls.clientSecret: the helm test pod calls the router's client API, which under mutual TLS needs an OU=client certificate: give a Secret holding one, or set test.enabled false" }}
{{- end }}
{{- range $role := list "prefill" "decode" "aggregated" }}
{{- $w := index $.Values $role }}
{{- if dig "workerToken" "existingSecret" "" $w }}
{{- if not $a.serviceToken.existingSecret }}
{{- fail (printf "%s.workerToken.existingSecret: the router checks worker tokens with the service secret: set auth.serviceToken.existingSecret too" $role) }}
{{- end }}
{{- if gt (int $w.replicas) 1 }}
{{- fail (printf "%s.workerToken.existingSecret: a worker token names one instance id, and %d replicas would all register as it; use replicas 1, or the service secret alone" $role (int $w.replicas)) }}
{{- end }}
{{- end }}
{{- end }}
{{- range $component := list "router" "prefill" "decode" "aggregated" }}
{{- $pdb := (index $.Values $component).podDisruptionBudget | default dict }}
{{- if and $pdb.enabled (ne $pdb.minAvailable nil) (ne $pdb.maxUnavailable nil) }}
{{- fail (printf "%s.podDisruptionBudget: give minAvailable or maxUnavailable, not both (set the other null)" $component) }}
{{- end }}
{{- end }}
{{- end }}
