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

{{/* "true" when a worker role runs pods: replicas above 0, or an autoscaler (which keeps at
     least minReplicas, 1 or more); else "", and nothing of the role is rendered. */}}
{{- define "tandem.workerRuns" -}}
{{- $w := index .root.Values .role }}
{{- if or (gt (int $w.replicas) 0) $w.autoscaling.enabled }}true{{ end }}
{{- end }}

{{/* The worker roles that serve: prefill and decode together (a prefill worker serves only
     paired with a decode worker, and the reverse: one role alone never becomes ready), and
     aggregated workers alone or beside them. None at all is a parked release. */}}
{{- define "tandem.validateRoles" -}}
{{- range $pair := list (list "prefill" "decode") (list "decode" "prefill") }}
{{- $role := index $pair 0 }}
{{- $peer := index $pair 1 }}
{{- if and (include "tandem.workerRuns" (dict "root" $ "role" $role)) (not (include "tandem.workerRuns" (dict "root" $ "role" $peer))) }}
{{- $w := index $.Values $role }}
{{- $given := ternary (printf "%s.autoscaling on" $role) (printf "%s.replicas %d" $role (int $w.replicas)) $w.autoscaling.enabled }}
{{- fail (printf "%s.replicas: 0 (and %s.autoscaling off) with %s: a %s worker serves only paired with a %s worker, so the %s pods would never become ready; give %s.replicas too, or run no %s worker and serve with aggregated.replicas" $peer $peer $given $role $peer $role $peer $role) }}
{{- end }}
{{- end }}
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
{{- include "tandem.validateCredentials" . }}
{{- include "tandem.validateRoles" . }}
{{- range $role := list "prefill" "decode" "aggregated" }}
{{- $host := (index $.Values $role).hostKvCache | default dict }}
{{- $tp := include "tandem.tp" (dict "root" $ "role" $role) | int }}
{{- if and (gt (int ($host.mb | default 0)) 0) (gt $tp 1) }}
{{- fail (printf "%s.hostKvCache.mb: the host KV tier's page copies are not mirrored to tensor-parallel ranks; use it with tp 1, not %d" $role $tp) }}
{{- end }}
{{- include "tandem.validateMemory" (dict "root" $ "role" $role) }}
{{- end }}
{{- range $component := list "router" "prefill" "decode" "aggregated" }}
{{- range (index $.Values $component).extraArgs }}
{{- if hasPrefix "--unsafe-forced-acceptance" . }}
{{- fail (printf "%s.extraArgs: --unsafe-forced-acceptance is for benchmarks only (the outputs are not the target model's); the chart refuses it: run it with tandem up or tandem worker" $component) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* A worker role's KV memory: kvCacheMb or gpuMemoryUtilization, the second on cuda only. */}}
{{- define "tandem.validateMemory" -}}
{{- $w := index .root.Values .role }}
{{- $fraction := $w.gpuMemoryUtilization }}
{{- if not (kindIs "invalid" $fraction) }}
{{- if gt (int ($w.kvCacheMb | default 0)) 0 }}
{{- fail (printf "%s.gpuMemoryUtilization: %v sizes the KV cache from the GPU's memory, and %s.kvCacheMb %v sizes it already; give one of them" .role $fraction .role $w.kvCacheMb) }}
{{- end }}
{{- if ne .root.Values.engine.device "cuda" }}
{{- fail (printf "%s.gpuMemoryUtilization: sizes the KV cache from a GPU's memory, and engine.device is %s: give %s.kvCacheMb" .role .root.Values.engine.device .role) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Environment of a component's container (dict "root" $ "component" "router|prefill|decode|aggregated"):
     its pod's IP and name, the credentials from their Secrets, extraEnv, then the ConfigMap. */}}
{{- define "tandem.env" -}}
{{- $v := .root.Values }}
{{- $c := index $v .component -}}
env:
  - name: POD_IP
    valueFrom:
      fieldRef: {fieldPath: status.podIP}
  - name: POD_NAME
    valueFrom:
      fieldRef: {fieldPath: metadata.name}
  {{- if and (eq .component "router") $v.auth.clientToken.existingSecret }}
  - name: TANDEM_TOKEN
    valueFrom:
      secretKeyRef: {name: {{ $v.auth.clientToken.existingSecret }}, key: {{ $v.auth.clientToken.key }}}
  {{- end }}
  {{- $own := dig "workerToken" "existingSecret" "" $c }}
  {{- if $own }}
  - name: TANDEM_WORKER_TOKEN
    valueFrom:
      secretKeyRef: {name: {{ $own }}, key: {{ $c.workerToken.key }}}
  {{- else if $v.auth.serviceToken.existingSecret }}
  - name: TANDEM_SERVICE_TOKEN
    valueFrom:
      secretKeyRef: {name: {{ $v.auth.serviceToken.existingSecret }}, key: {{ $v.auth.serviceToken.key }}}
  {{- end }}
  {{- with $c.extraEnv }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
envFrom:
  - configMapRef:
      name: {{ include "tandem.configName" .root }}
{{- end }}

{{/* A component's volumes and mounts: model, TLS, then its extraVolumes / extraVolumeMounts. */}}
{{- define "tandem.volumes" -}}
{{- $c := index .root.Values .component }}
{{- include "tandem.modelVolume" .root }}
{{- include "tandem.tlsVolume" .root }}
{{- with $c.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "tandem.volumeMounts" -}}
{{- $c := index .root.Values .component }}
{{- include "tandem.modelMount" .root }}
{{- include "tandem.tlsMount" .root }}
{{- with $c.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Health probes on a port; readiness asks for probes.readiness.service. Kubernetes' gRPC
     probes speak plaintext, so under mutual TLS each probe is an exec of tandem.tlsProbe. */}}
{{- define "tandem.probes" -}}
{{- $p := .root.Values.probes -}}
{{- $t := .root.Values.tls -}}
startupProbe:
  {{- include "tandem.probeCheck" (dict "root" .root "port" .port "service" "") | nindent 2 }}
  periodSeconds: {{ $p.startup.periodSeconds }}
  failureThreshold: {{ $p.startup.failureThreshold }}
readinessProbe:
  {{- include "tandem.probeCheck" (dict "root" .root "port" .port "service" $p.readiness.service) | nindent 2 }}
  periodSeconds: {{ $p.readiness.periodSeconds }}
  failureThreshold: {{ $p.readiness.failureThreshold }}
livenessProbe:
  {{- include "tandem.probeCheck" (dict "root" .root "port" .port "service" "") | nindent 2 }}
  periodSeconds: {{ $p.liveness.periodSeconds }}
  {{- if not $t.enabled }}
  timeoutSeconds: {{ $p.liveness.timeoutSeconds }}
  {{- end }}
  failureThreshold: {{ $p.liveness.failureThreshold }}
{{- end }}

{{- define "tandem.probeCheck" -}}
{{- $t := .root.Values.tls -}}
{{- if $t.enabled -}}
exec:
  command: ["python", "-c", {{ include "tandem.tlsProbe" .root | quote }}, {{ .port | quote }}, {{ .service | quote }}]
timeoutSeconds: {{ $t.probeTimeoutSeconds }}
{{- else -}}
grpc:
  port: {{ .port }}
  {{- with .service }}
  service: {{ . | quote }}
  {{- end }}
{{- end }}
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
