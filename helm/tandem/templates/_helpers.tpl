{{/* Names and labels. */}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "tandem.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The ConfigMap every pod loads, and the router address workers register with. */}}

{{- define "tandem.configName" -}}
{{- printf "%s-config" (include "tandem.fullname" .) }}
{{- end }}

{{- define "tandem.routerInternal" -}}
{{- printf "%s-router-internal" (include "tandem.fullname" .) }}
{{- end }}

{{/* The folder holding the target and drafter folders, as the pods see it. */}}
{{- define "tandem.modelRoot" -}}
{{- if eq .Values.model.source "bundled" }}/opt/tandem/models{{ else }}{{ .Values.model.mountPath }}{{ end }}
{{- end }}

{{/* GPUs (tensor-parallel ranks) per pod of a worker role: the role's tp, else engine.tp. */}}
{{- define "tandem.tp" -}}
{{- $role := index .root.Values .role }}
{{- if $role.tp }}{{ $role.tp }}{{ else }}{{ .root.Values.engine.tp }}{{ end }}
{{- end }}

{{/* Refuse values the services would refuse, with the reason, before anything is created. */}}
{{- define "tandem.validate" -}}
{{- $e := .Values.engine }}
{{- if and (eq $e.layout "unified") (or (not .Values.model.drafter) (eq (int $e.numSpecTokens) 0)) }}
{{- fail (printf "engine.layout: unified keeps the drafter's KV pages in the target's cache manager and transfer, but no drafter runs (model.drafter %q, engine.numSpecTokens %d); use layout separate, or give a drafter and K > 0" .Values.model.drafter (int $e.numSpecTokens)) }}
{{- end }}
{{- if and (eq .Values.model.source "pvc") (not .Values.model.pvc.claimName) }}
{{- fail "model.pvc.claimName: required when model.source is pvc" }}
{{- end }}
{{- if and (eq .Values.model.source "image") (not .Values.model.image.repository) }}
{{- fail "model.image.repository: required when model.source is image" }}
{{- end }}
{{- range $role := list "prefill" "decode" }}
{{- $host := (index $.Values $role).hostKvCache | default dict }}
{{- $tp := include "tandem.tp" (dict "root" $ "role" $role) | int }}
{{- if and (gt (int ($host.mb | default 0)) 0) (gt $tp 1) }}
{{- fail (printf "%s.hostKvCache.mb: the host KV tier's page copies are not mirrored to tensor-parallel ranks; use it with tp 1, not %d" $role $tp) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Environment every Tandem container gets: its pod's IP and name, then the ConfigMap. */}}
{{- define "tandem.env" -}}
env:
  - name: POD_IP
    valueFrom:
      fieldRef: {fieldPath: status.podIP}
  - name: POD_NAME
    valueFrom:
      fieldRef: {fieldPath: metadata.name}
envFrom:
  - configMapRef:
      name: {{ include "tandem.configName" . }}
{{- end }}

{{/* gRPC health probes on a port; readiness asks for probes.readiness.service. */}}
{{- define "tandem.probes" -}}
{{- $p := .root.Values.probes -}}
startupProbe:
  grpc: {port: {{ .port }}}
  periodSeconds: {{ $p.startup.periodSeconds }}
  failureThreshold: {{ $p.startup.failureThreshold }}
readinessProbe:
  grpc:
    port: {{ .port }}
    {{- with $p.readiness.service }}
    service: {{ . | quote }}
    {{- end }}
  periodSeconds: {{ $p.readiness.periodSeconds }}
  failureThreshold: {{ $p.readiness.failureThreshold }}
livenessProbe:
  grpc: {port: {{ .port }}}
  periodSeconds: {{ $p.liveness.periodSeconds }}
  timeoutSeconds: {{ $p.liveness.timeoutSeconds }}
  failureThreshold: {{ $p.liveness.failureThreshold }}
{{- end }}

{{/* An initContainer running `script` in the model image, with the model volume at
     /model-volume (not mountPath: that would hide the image's own folder of the same name). */}}
{{- define "tandem.modelCopy" -}}
- name: copy-model
  image: {{ printf "%s:%s" .root.Values.model.image.repository .root.Values.model.image.tag }}
  imagePullPolicy: {{ .root.Values.model.image.pullPolicy }}
  command: ["sh", "-c", {{ .script | quote }}]
  volumeMounts:
    - {name: model, mountPath: /model-volume}
{{- end }}

{{/* The model volume: the PVC (read-only) or the emptyDir the initContainer fills. */}}
{{- define "tandem.modelVolume" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "image" }}
- name: model
  emptyDir:
    sizeLimit: {{ $m.image.sizeLimit }}
{{- end }}
{{- end }}

{{- define "tandem.modelMount" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "pvc" }}
- name: model
  mountPath: {{ $m.mountPath }}
  readOnly: true
  {{- with $m.pvc.subPath }}
  subPath: {{ . }}
  {{- end }}
{{- else if eq $m.source "image" }}
- name: model
  mountPath: {{ $m.mountPath }}
  readOnly: true
{{- end }}
{{- end }}
