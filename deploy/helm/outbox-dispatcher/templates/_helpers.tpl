{{/* Names and labels (https://helm.sh/docs/chart_best_practices/labels). */}}

{{- define "outbox-dispatcher.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "outbox-dispatcher.fullname" -}}
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

{{- define "outbox-dispatcher.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "outbox-dispatcher.selectorLabels" -}}
app.kubernetes.io/name: {{ include "outbox-dispatcher.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "outbox-dispatcher.labels" -}}
helm.sh/chart: {{ include "outbox-dispatcher.chart" . }}
{{ include "outbox-dispatcher.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: outbox-dispatcher
{{- end }}

{{/* The console's pods (console.enabled): a name of their own, so that the dispatchers'
Deployment, Service and PodDisruptionBudget never select them. */}}
{{- define "outbox-dispatcher.consoleName" -}}
{{- printf "%s-console" (include "outbox-dispatcher.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "outbox-dispatcher.consoleSelectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-console" (include "outbox-dispatcher.name" .) | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "outbox-dispatcher.consoleLabels" -}}
helm.sh/chart: {{ include "outbox-dispatcher.chart" . }}
{{ include "outbox-dispatcher.consoleSelectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: outbox-dispatcher
app.kubernetes.io/component: console
{{- end }}

{{- define "outbox-dispatcher.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "outbox-dispatcher.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "outbox-dispatcher.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/* The Secret whose keys are mounted as files: an existing one, or the chart's. */}}
{{- define "outbox-dispatcher.secretName" -}}
{{- .Values.existingSecret | default (include "outbox-dispatcher.fullname" .) }}
{{- end }}

{{- define "outbox-dispatcher.secretsDir" -}}
/var/run/secrets/outbox
{{- end }}

{{/* A chart-made Secret must hold every key the pods read. */}}
{{- define "outbox-dispatcher.checkSecrets" -}}
{{- if not .Values.existingSecret }}
{{- $keys := concat .Values.secretSettings (list) }}
{{- if ne .Values.migrate.mode "none" }}{{ $keys = append $keys .Values.migrate.databaseUrlKey }}{{ end }}
{{- if .Values.console.enabled }}
{{- $keys = append $keys .Values.console.databaseUrlKey }}
{{- with .Values.console.tokenKey }}{{ $keys = append $keys . }}{{ end }}
{{- end }}
{{- range $keys }}
{{- if not (index $.Values.secrets .) }}
{{- fail (printf "secrets.%s is empty: set it, or set existingSecret to a Secret that has the key %s" . .) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and (eq .Values.migrate.mode "hook") (not .Values.existingSecret) }}
{{- fail "migrate.mode=hook needs existingSecret: the hook Job runs before the chart's own Secret exists (or use migrate.mode=initContainer)" }}
{{- end }}
{{- $grace := int (ceil .Values.shutdownGraceSeconds) }}
{{- if and .Values.terminationGracePeriodSeconds (le (int .Values.terminationGracePeriodSeconds) $grace) }}
{{- fail (printf "terminationGracePeriodSeconds (%v) must exceed shutdownGraceSeconds (%v): in-flight batches need the time to finish" .Values.terminationGracePeriodSeconds .Values.shutdownGraceSeconds) }}
{{- end }}
{{- end }}

{{- define "outbox-dispatcher.terminationGracePeriodSeconds" -}}
{{- .Values.terminationGracePeriodSeconds | default (add (int (ceil .Values.shutdownGraceSeconds)) 15) }}
{{- end }}

{{/* Settings shared by the dispatcher and the migration: secret files (but database_url), env,
extraEnv. The migration gets them all, so that it validates the same settings. */}}
{{- define "outbox-dispatcher.settingsEnv" -}}
{{- range .Values.secretSettings }}
{{- if ne . "database_url" }}
- name: {{ printf "OUTBOX_%s_FILE" (upper .) }}
  value: {{ printf "%s/%s" (include "outbox-dispatcher.secretsDir" $) . | quote }}
{{- end }}
{{- end }}
{{- range $name, $value := .Values.env }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- with .Values.sources }}
- name: OUTBOX_SOURCES
  value: {{ toJson . | quote }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Environment of the dispatcher container. */}}
{{- define "outbox-dispatcher.env" -}}
- name: OUTBOX_HTTP_PORT
  value: {{ .Values.httpPort | quote }}
- name: OUTBOX_SHUTDOWN_GRACE_SECONDS
  value: {{ .Values.shutdownGraceSeconds | quote }}
{{- if has "database_url" .Values.secretSettings }}
- name: OUTBOX_DATABASE_URL_FILE
  value: {{ printf "%s/database_url" (include "outbox-dispatcher.secretsDir" .) | quote }}
{{- end }}
{{- include "outbox-dispatcher.settingsEnv" . | trim | nindent 0 }}
{{- end }}

{{- define "outbox-dispatcher.secretVolume" -}}
- name: secrets
  secret:
    secretName: {{ include "outbox-dispatcher.secretName" . }}
    defaultMode: 0440
{{- end }}

{{- define "outbox-dispatcher.secretMount" -}}
- name: secrets
  mountPath: {{ include "outbox-dispatcher.secretsDir" . }}
  readOnly: true
{{- end }}

{{/* The `outbox-dispatcher migrate` container (init container or hook Job). */}}
{{- define "outbox-dispatcher.migrateContainer" -}}
- name: migrate
  image: {{ include "outbox-dispatcher.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args: ["migrate"]
  env:
    - name: OUTBOX_DATABASE_URL_FILE
      value: {{ printf "%s/%s" (include "outbox-dispatcher.secretsDir" .) .Values.migrate.databaseUrlKey | quote }}
    {{- include "outbox-dispatcher.settingsEnv" . | trim | nindent 4 }}
  volumeMounts:
    {{- include "outbox-dispatcher.secretMount" . | nindent 4 }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  resources:
    {{- toYaml .Values.resources | nindent 4 }}
{{- end }}
