{{- define "mole.fullname" -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "mole.labels" -}}
app.kubernetes.io/name: mole
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "mole.selector" -}}
app.kubernetes.io/name: mole
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "mole.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "mole.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
A default worker image: repository:tag, the tag defaulting to the chart's appVersion plus the
build's suffix (-cuda, -cpu), as .github/workflows/images.yml tags them.
*/}}
{{- define "mole.workerImage" -}}
{{- $tag := .image.tag | default (printf "%s%s" .root.Chart.AppVersion .suffix) -}}
{{- printf "%s:%s" .image.repository $tag -}}
{{- end -}}
