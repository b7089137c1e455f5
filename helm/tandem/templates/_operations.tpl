{{/* What each role's pod adds for operating it: its priority class, topology spread,
     security contexts, the preStop hook and the grace period, and the ops values' checks.
     Every helper takes (dict "root" $ "component" "router"|"prefill"|"decode"|"aggregated"). */}}

{{/* The grace period: preStop sleep + drain + 10 s, unless terminationGracePeriodSeconds
     is set (then at least preStop + drain). */}}
{{- define "tandem.gracePeriod" -}}
{{- $s := .Values.shutdown }}
{{- $least := add (int $s.preStopSleepSeconds) (int $s.drainSeconds) }}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds }}
{{- add $least 10 }}
{{- else }}
{{- .Values.terminationGracePeriodSeconds }}
{{- end }}
{{- end }}

{{/* Pod-level: priorityClassName, securityContext (the role's, else the chart-wide one),
     topologySpreadConstraints (each without a labelSelector selects the role's pods) and
     terminationGracePeriodSeconds. */}}
{{- define "tandem.podOperations" -}}
{{- $root := .root }}
{{- $c := index $root.Values .component }}
{{- with $c.priorityClassName }}
priorityClassName: {{ . | quote }}
{{- end }}
{{- with (default $root.Values.podSecurityContext $c.podSecurityContext) }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- range . }}
  {{- $constraint := deepCopy . }}
  {{- if not (hasKey $constraint "labelSelector") }}
  {{- $labels := fromYaml (include "tandem.selectorLabels" $root) }}
  {{- $_ := set $labels "app.kubernetes.io/component" $.component }}
  {{- $_ := set $constraint "labelSelector" (dict "matchLabels" $labels) }}
  {{- end }}
  - {{ toYaml $constraint | indent 4 | trim }}
  {{- end }}
{{- end }}
terminationGracePeriodSeconds: {{ include "tandem.gracePeriod" $root }}
{{- end }}

{{/* Container-level: securityContext (the role's, else the chart-wide one) and the preStop
     hook: a sleep, so Services and load balancers drop the pod before SIGTERM reaches the
     process (none at 0 s). */}}
{{- define "tandem.containerOperations" -}}
{{- $root := .root }}
{{- $c := index $root.Values .component }}
{{- with (default $root.Values.securityContext $c.securityContext) }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $sleep := int $root.Values.shutdown.preStopSleepSeconds }}
{{- if gt $sleep 0 }}
lifecycle:
  preStop:
    exec:
      command: ["sleep", {{ $sleep | quote }}]
{{- end }}
{{- end }}

{{/* Refusals of the ops values: what would deploy but not work. */}}
{{- define "tandem.validateOperations" -}}
{{- $s := .Values.shutdown }}
{{- $grace := .Values.terminationGracePeriodSeconds }}
{{- $least := add (int $s.preStopSleepSeconds) (int $s.drainSeconds) }}
{{- if and (not (kindIs "invalid" $grace)) (lt (int $grace) (int $least)) }}
{{- fail (printf "terminationGracePeriodSeconds: %d is shorter than shutdown.preStopSleepSeconds + shutdown.drainSeconds (%d): the kubelet would kill the process mid-drain; raise it, or leave it null (%d)" (int $grace) (int $least) (int (add $least 10))) }}
{{- end }}
{{- if and .Values.ingress.enabled (kindIs "invalid" .Values.router.httpPort) }}
{{- fail "ingress.enabled: the Ingress routes to the router's HTTP port, and router.httpPort is null (off): set a port, or leave the Ingress off" }}
{{- end }}
{{- range $role := list "prefill" "decode" "aggregated" }}
{{- $w := index $.Values $role }}
{{- if and $w.autoscaling.enabled (dig "workerToken" "existingSecret" "" $w) }}
{{- fail (printf "%s.autoscaling.enabled: a worker token names one instance id, and the autoscaler would add replicas that all register as it; use the service secret alone" $role) }}
{{- end }}
{{- end }}
{{- range $component := list "router" "prefill" "decode" "aggregated" }}
{{- $hpa := (index $.Values $component).autoscaling }}
{{- if and $hpa.enabled (gt (int $hpa.minReplicas) (int $hpa.maxReplicas)) }}
{{- fail (printf "%s.autoscaling: minReplicas %d is above maxReplicas %d" $component (int $hpa.minReplicas) (int $hpa.maxReplicas)) }}
{{- end }}
{{- end }}
{{- end }}
