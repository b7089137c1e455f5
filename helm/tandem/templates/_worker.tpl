{{/* A worker role (prefill, decode or aggregated): its Deployment and a headless Service.
     Call with (dict "root" $ "role" "prefill"). The role names its values key, its objects
     and its component label; aggregated runs `tandem worker --role both`. */}}
{{- define "tandem.worker" -}}
{{- $root := .root }}
{{- $v := $root.Values }}
{{- $w := index $v .role }}
{{- $roleFlag := get (dict "aggregated" "both") .role | default .role }}  {{- /* the CLI's name for it */}}
{{- $m := $v.model }}
{{- $tp := include "tandem.tp" . | int }}
{{- $name := printf "%s-%s" (include "tandem.fullname" $root) .role }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  labels:
    {{- include "tandem.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .role }}
spec:
  {{- if not $w.autoscaling.enabled }}  {{- /* else the HorizontalPodAutoscaler owns it */}}
  replicas: {{ $w.replicas }}
  {{- end }}
  strategy:  # replace pods in place: a surge pod would need GPUs the old one still holds
    type: RollingUpdate
    rollingUpdate: {maxSurge: 0, maxUnavailable: 1}
  selector:
    matchLabels:
      {{- include "tandem.selectorLabels" $root | nindent 6 }}
      app.kubernetes.io/component: {{ .role }}
  template:
    metadata:
      labels:
        {{- include "tandem.selectorLabels" $root | nindent 8 }}
        app.kubernetes.io/component: {{ .role }}
      annotations:
        checksum/config: {{ include (print $root.Template.BasePath "/configmap.yaml") $root | sha256sum }}
        {{- with $w.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      {{- include "tandem.podIdentity" $root | nindent 6 }}
      {{- with $v.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- include "tandem.podOperations" (dict "root" $root "component" .role) | trim | nindent 6 }}
      {{- if eq $m.source "image" }}
      initContainers:
        {{- $script := printf "cp -a %s/. /model-volume/" $m.image.path }}
        {{- include "tandem.modelCopy" (dict "root" $root "script" $script) | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ .role }}
          image: {{ include "tandem.image" $root }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          {{- with (include "tandem.containerOperations" (dict "root" $root "component" .role) | trim) }}
          {{- . | nindent 10 }}
          {{- end }}
          args:
            - worker
            - --role
            - {{ $roleFlag }}
            - --router
            - $(TANDEM_ROUTER)
            - --host
            - $(POD_IP)
            - --port
            - {{ $w.port | quote }}
            - --metrics-port
            - {{ $w.metricsPort | quote }}
            {{- if not (dig "workerToken" "existingSecret" "" $w) }}
            - --instance-id  # a worker token names the instance id itself
            - $(POD_NAME)
            {{- end }}
            - --model
            - $(TANDEM_MODEL)
            - --drafter
            - $(TANDEM_DRAFTER)
            {{- if $m.tokenizer }}
            - --tokenizer
            - $(TANDEM_TOKENIZER)
            {{- end }}
            {{- if $m.servedModelName }}
            - --served-model-name
            - $(TANDEM_SERVED_MODEL_NAME)
            {{- end }}
            - -k
            - $(TANDEM_NUM_SPEC_TOKENS)
            - --layout
            - $(TANDEM_LAYOUT)
            - --tokens-per-page
            - $(TANDEM_TOKENS_PER_PAGE)
            - --device
            - $(TANDEM_DEVICE)
            - --dtype
            - $(TANDEM_DTYPE)
            - --max-num-seqs
            - $(TANDEM_MAX_NUM_SEQS)
            - --stream-interval
            - $(TANDEM_STREAM_INTERVAL)
            - --max-num-batched-tokens
            - $(TANDEM_MAX_NUM_BATCHED_TOKENS)
            - --scheduling-policy
            - $(TANDEM_SCHEDULING_POLICY)
            - --max-model-len
            - $(TANDEM_MAX_MODEL_LEN)
            - --log-level
            - $(TANDEM_LOG_LEVEL)
            - --log-format
            - $(TANDEM_LOG_FORMAT)
            - --log-stats-interval-s
            - $(TANDEM_LOG_STATS_INTERVAL_S)
            {{- if not $v.logRequests }}
            - --disable-log-requests
            {{- end }}
            - --shutdown-timeout-s
            - $(TANDEM_SHUTDOWN_TIMEOUT_S)
            {{- /* the KV memory: kvCacheMb, else gpuMemoryUtilization of the GPU (the worker's default without either) */}}
            {{- if gt (int ($w.kvCacheMb | default 0)) 0 }}
            - --kv-cache-mb
            - {{ $w.kvCacheMb | quote }}
            {{- end }}
            {{- if not (kindIs "invalid" $w.gpuMemoryUtilization) }}
            - --gpu-memory-utilization
            - {{ $w.gpuMemoryUtilization | quote }}
            {{- end }}
            {{- /* each host tier flag only off its default (deploy/options.py EngineOptions) */}}
            {{- $host := $w.hostKvCache | default dict }}
            {{- if gt (int ($host.mb | default 0)) 0 }}
            - --host-kv-cache-mb
            - {{ $host.mb | quote }}
            {{- end }}
            {{- if ne ($host.writePolicy | default "evict") "evict" }}
            - --host-kv-write-policy
            - {{ $host.writePolicy | quote }}
            {{- end }}
            {{- if ne (int ($host.recallMinPages | default 1)) 1 }}
            - --host-kv-recall-min-pages
            - {{ $host.recallMinPages | quote }}
            {{- end }}
            {{- if not $v.engine.prefixCache }}
            - --no-prefix-cache
            {{- end }}
            {{- if not $v.engine.cudaGraphs }}
            - --enforce-eager
            {{- end }}
            {{- if not $v.engine.adaptiveK }}
            - --no-adaptive-k
            {{- end }}
            {{- if $v.engine.overlapDecode }}
            - --overlap-decode
            {{- end }}
            {{- if ne $v.engine.quantization "none" }}
            - --quantization
            - {{ $v.engine.quantization | quote }}
            {{- end }}
            {{- if ne $v.engine.draftQuantization "none" }}
            - --draft-quantization
            - {{ $v.engine.draftQuantization | quote }}
            {{- end }}
            {{- if gt $tp 1 }}
            - --tp
            - {{ $tp | quote }}
            {{- end }}
            {{- with (include "tandem.tlsArgs" $root) }}
            {{- . | trim | nindent 12 }}
            {{- end }}
            {{- range $w.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          {{- include "tandem.env" (dict "root" $root "component" .role) | nindent 10 }}
          ports:
            - {name: grpc, containerPort: {{ $w.port }}}
            - {name: metrics, containerPort: {{ $w.metricsPort }}}
          {{- include "tandem.probes" (dict "root" $root "port" $w.port) | nindent 10 }}
          resources:
            {{- $resources := deepCopy (default dict $w.resources) }}
            {{- if eq $v.engine.device "cuda" }}
            {{- $limits := merge (dict $v.gpuResource $tp) (default dict $resources.limits) }}
            {{- $_ := set $resources "limits" $limits }}
            {{- end }}
            {{- toYaml $resources | nindent 12 }}
          volumeMounts:
            - {name: shm, mountPath: /dev/shm}
            {{- with (include "tandem.volumeMounts" (dict "root" $root "component" .role)) }}
            {{- . | trim | nindent 12 }}
            {{- end }}
      volumes:
        - name: shm
          emptyDir: {medium: Memory, sizeLimit: {{ $v.shmSizeLimit }}}
        {{- with (include "tandem.volumes" (dict "root" $root "component" .role)) }}
        {{- . | trim | nindent 8 }}
        {{- end }}
      {{- with $w.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $w.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $w.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
---
# Stable DNS and a "metrics" port for a ServiceMonitor. Workers advertise their pod IPs in
# RankInfo; nothing routes through this Service.
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}
  labels:
    {{- include "tandem.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .role }}
spec:
  clusterIP: None
  publishNotReadyAddresses: true
  selector:
    {{- include "tandem.selectorLabels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .role }}
  ports:
    - {name: grpc, port: {{ $w.port }}, targetPort: grpc}
    - {name: metrics, port: {{ $w.metricsPort }}, targetPort: metrics}
{{- end }}
