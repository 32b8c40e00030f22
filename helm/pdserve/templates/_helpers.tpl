{{/* Names ----------------------------------------------------------------- */}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.fullname" -}}
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

{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object; selectorLabels takes (dict "ctx" $ "component" "router"). */}}
{{- define "pdserve.labels" -}}
helm.sh/chart: {{ include "pdserve.chart" . }}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end }}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Selects every pod of this release (router and workers). */}}
{{- define "pdserve.releaseSelector" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* A label selector (matchExpressions) of this release's pods of the given
     components, e.g. the workers but not the model download Job. Takes
     (dict "ctx" $ "components" (list "prefill" "decode")). */}}
{{- define "pdserve.componentSelector" -}}
matchExpressions:
  - key: app.kubernetes.io/name
    operator: In
    values: [{{ include "pdserve.name" .ctx }}]
  - key: app.kubernetes.io/instance
    operator: In
    values: [{{ .ctx.Release.Name | quote }}]
  - key: app.kubernetes.io/component
    operator: In
    values: [{{ join ", " .components }}]
{{- end }}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "pdserve.image" -}}
{{- printf "%s:%s%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) .Values.image.tagSuffix }}
{{- end }}

{{/* Router wiring ------------------------------------------------------------ */}}

{{/* Headless Service of the router replicas: its DNS name resolves to every
     router pod, so each worker connects to every replica (and re-resolves). */}}
{{- define "pdserve.routerHeadless" -}}
{{- printf "%s-router-headless" (include "pdserve.fullname" .) }}
{{- end }}

{{- define "pdserve.routerAddress" -}}
{{- printf "%s.%s.svc:%d" (include "pdserve.routerHeadless" .) .Release.Namespace (int .Values.router.controlPort) }}
{{- end }}

{{/* Model storage ------------------------------------------------------------ */}}

{{- define "pdserve.modelDir" -}}
{{- printf "/models/%s" (.Values.model.subPath | trimPrefix "/") | trimSuffix "/" }}
{{- end }}

{{- define "pdserve.modelClaimName" -}}
{{- if eq .Values.model.storage.type "existingClaim" }}
{{- required "model.storage.existingClaim.claimName is required when model.storage.type is existingClaim" .Values.model.storage.existingClaim.claimName }}
{{- else }}
{{- printf "%s-model" (include "pdserve.fullname" .) }}
{{- end }}
{{- end }}

{{- define "pdserve.downloadJobName" -}}
{{- $d := .Values.model.download }}
{{- printf "%s-model-download-%s" (include "pdserve.fullname" .) (printf "%s@%s" $d.repo $d.revision | sha256sum | trunc 8) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The `models` volume every pod mounts. */}}
{{- define "pdserve.modelVolume" -}}
{{- $s := .Values.model.storage }}
- name: models
{{- if or (eq $s.type "existingClaim") (eq $s.type "newClaim") }}
  persistentVolumeClaim:
    claimName: {{ include "pdserve.modelClaimName" . }}
{{- else if eq $s.type "hostPath" }}
  hostPath:
    path: {{ required "model.storage.hostPath.path is required when model.storage.type is hostPath" $s.hostPath.path }}
    type: Directory
{{- else }}
  emptyDir:
    sizeLimit: {{ $s.emptyDir.sizeLimit }}
{{- end }}
{{- end }}

{{/* The download container (per-pod initContainer or the newClaim Job).
     Takes (dict "root" . "router" BOOL): the router reads the model's JSON
     and template files only, and downloads those, not the weights. */}}
{{- define "pdserve.downloadContainer" -}}
{{- $root := .root }}
{{- $d := $root.Values.model.download }}
{{- $patterns := $d.allowPatterns }}
{{- if .router }}
{{- $patterns = list "*.json" "*.jinja" "tokenizer.model" "additional_chat_templates/*" }}
{{- end }}
- name: model-download
  image: "{{ $d.image.repository }}:{{ $d.image.tag }}"
  imagePullPolicy: {{ $d.image.pullPolicy }}
  command:
    - sh
    - -c
    - |
      set -eu
      if [ -f "$MODEL_DIR/.pdserve-model-ready" ]; then
        echo "model already present in $MODEL_DIR"; exit 0
      fi
      pip install --no-cache-dir --user --quiet "huggingface_hub==$HF_HUB_VERSION"
      python - <<'PY'
      import json, os
      from huggingface_hub import snapshot_download
      snapshot_download(repo_id=os.environ["HF_REPO"], revision=os.environ["HF_REVISION"],
                        local_dir=os.environ["MODEL_DIR"],
                        allow_patterns=json.loads(os.environ["HF_ALLOW_PATTERNS"]))
      PY
      touch "$MODEL_DIR/.pdserve-model-ready"
      echo "model downloaded into $MODEL_DIR"
  env:
    - name: HF_REPO
      value: {{ required "model.download.repo is required for model.storage.type newClaim or download" $d.repo | quote }}
    - name: HF_REVISION
      value: {{ $d.revision | quote }}
    - name: HF_ALLOW_PATTERNS
      value: {{ toJson $patterns | quote }}
    - name: HF_HUB_VERSION
      value: {{ $d.huggingfaceHubVersion | quote }}
    - name: MODEL_DIR
      value: {{ include "pdserve.modelDir" $root }}
    - name: HOME
      value: /tmp
    - name: HF_HOME
      value: /tmp/hf
    {{- if $d.hfTokenSecret.name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ $d.hfTokenSecret.name }}
          key: {{ $d.hfTokenSecret.key }}
    {{- end }}
  securityContext:
    {{- toYaml $root.Values.containerSecurityContext | nindent 4 }}
  resources:
    {{- toYaml $d.resources | nindent 4 }}
  volumeMounts:
    - name: models
      mountPath: /models
    - name: tmp
      mountPath: /tmp
{{- end }}

{{/* initContainers that make the model available before the server starts;
     takes (dict "root" . "router" BOOL), as pdserve.downloadContainer. */}}
{{- define "pdserve.modelInitContainers" -}}
{{- $ctx := .root }}
{{- $type := $ctx.Values.model.storage.type }}
{{- if eq $type "download" }}
{{- include "pdserve.downloadContainer" . }}
{{- else if eq $type "tiny" }}
- name: make-model
  image: {{ include "pdserve.image" $ctx }}
  imagePullPolicy: {{ $ctx.Values.image.pullPolicy }}
  command:
    - sh
    - -c
    - test -f "$MODEL_DIR/config.json" || pdserve make-model --preset tiny --out "$MODEL_DIR"
  env:
    - name: MODEL_DIR
      value: {{ include "pdserve.modelDir" $ctx }}
  securityContext:
    {{- toYaml $ctx.Values.containerSecurityContext | nindent 4 }}
  volumeMounts:
    - name: models
      mountPath: /models
    - name: tmp
      mountPath: /tmp
{{- else if eq $type "newClaim" }}
- name: wait-for-model
  image: {{ include "pdserve.image" $ctx }}
  imagePullPolicy: {{ $ctx.Values.image.pullPolicy }}
  command:
    - sh
    - -c
    - |
      until [ -f "$MODEL_DIR/.pdserve-model-ready" ]; do
        echo "waiting for Job {{ include "pdserve.downloadJobName" $ctx }} to download the model into $MODEL_DIR"
        sleep 10
      done
  env:
    - name: MODEL_DIR
      value: {{ include "pdserve.modelDir" $ctx }}
  securityContext:
    {{- toYaml $ctx.Values.containerSecurityContext | nindent 4 }}
  volumeMounts:
    - name: models
      mountPath: /models
      readOnly: true
{{- end }}
{{- end }}

{{/* KV tiers ------------------------------------------------------------------ */}}

{{/* A byte count as the worker's flags take it: a string as given, a number
     in decimal (values files turn integers into floats, which print as
     5e+11). */}}
{{- define "pdserve.byteCount" -}}
{{- if kindIs "string" . }}{{ . }}{{ else }}{{ printf "%d" (int64 .) }}{{ end }}
{{- end }}

{{/* --kv-disk-cache-bytes of a pool whose disk tier is enabled: the worker
     refuses the folder without a size, so the render fails first. Takes
     (dict "role" name "disk" .kvTiers.disk). */}}
{{- define "pdserve.kvDiskBytes" -}}
{{- $b := include "pdserve.byteCount" (default "" .disk.sizeBytes) }}
{{- if not (regexMatch "[1-9]" $b) }}
{{- fail (printf "%s.kvTiers.disk.sizeBytes is required when %s.kvTiers.disk.enabled is true: the size of the disk KV tier's file, e.g. 500GiB" .role .role) }}
{{- end }}
{{- $b }}
{{- end }}

{{/* --kv-disk-flush-timeout of a pool with a disk tier: SIGTERM first drains
     the worker's requests (its --drain-timeout, pdserve.drainTimeout) and
     then writes its tiers to disk for up to this long. Takes (dict "role"
     name "worker" .Values.<role>). */}}
{{- define "pdserve.kvDiskFlushTimeout" -}}
{{- int64 .worker.kvTiers.disk.flushTimeoutSeconds }}
{{- end }}

{{/* --drain-timeout of a pool: what terminationGracePeriodSeconds leaves
     after the disk flush (when the pool has a disk tier) and 10 s for the
     rest of the shutdown (at least 1 s), so that running requests get the
     grace period the values give them and the kubelet never kills a pod
     mid-flush. Takes the same dict as pdserve.kvDiskFlushTimeout. */}}
{{- define "pdserve.drainTimeout" -}}
{{- $grace := int64 .worker.terminationGracePeriodSeconds }}
{{- $flush := 0 }}
{{- if .worker.kvTiers.disk.enabled }}
{{- $flush = int64 .worker.kvTiers.disk.flushTimeoutSeconds }}
{{- end }}
{{- $drain := sub (sub $grace $flush) 10 }}
{{- if and (lt $drain 1) .worker.kvTiers.disk.enabled }}
{{- fail (printf "%s.terminationGracePeriodSeconds (%d) must cover the drain (at least 1 s), %s.kvTiers.disk.flushTimeoutSeconds (%d) and 10 s of shutdown: raise it to %d or lower the flush timeout" .role $grace .role $flush (add 11 $flush)) }}
{{- end }}
{{- max $drain 1 }}
{{- end }}

{{/* Size limit of the emptyDir holding a pool's disk tier: disk.sizeLimit, or
     sizeBytes plus 5% in Mi (the worker's file never grows past sizeBytes).
     Takes the same dict as pdserve.kvDiskBytes. */}}
{{- define "pdserve.kvDiskSizeLimit" -}}
{{- if .disk.sizeLimit }}
{{- include "pdserve.byteCount" .disk.sizeLimit }}
{{- else }}
{{- $b := include "pdserve.kvDiskBytes" . }}
{{- $n := regexFind "^[0-9]+" $b }}
{{- $units := dict "" 1 "K" 1024 "KiB" 1024 "M" 1048576 "MiB" 1048576 "G" 1073741824 "GiB" 1073741824 "T" 1099511627776 "TiB" 1099511627776 }}
{{- $bytes := mul (int64 $n) (get $units (trimPrefix $n $b)) }}
{{- printf "%dMi" (div (add $bytes (div $bytes 20) 1048575) 1048576) }}
{{- end }}
{{- end }}

{{/* Security ------------------------------------------------------------------ */}}

{{/* Container security context; takes (dict "ctx" $ "rdma" bool). With RDMA the
     worker must pin (mlock) its KV pool for registration: IPC_LOCK. */}}
{{- define "pdserve.containerSecurityContext" -}}
{{- $sc := deepCopy .ctx.Values.containerSecurityContext }}
{{- if .rdma }}
{{- $caps := default dict $sc.capabilities }}
{{- $_ := set $caps "add" (list "IPC_LOCK") }}
{{- $_ := set $sc "capabilities" $caps }}
{{- end }}
{{- toYaml $sc }}
{{- end }}

{{/* Monitoring ------------------------------------------------------------ */}}

{{/* ServiceMonitor and PodMonitor label each target with its pool (router,
     prefill, decode), which the dashboard and the alert rules group by. */}}
{{- define "pdserve.scrapeRelabelings" -}}
- sourceLabels: [__meta_kubernetes_pod_label_app_kubernetes_io_component]
  targetLabel: pool
{{- end }}

{{/* Control-plane security --------------------------------------------------- */}}

{{/* Where every pod finds its secrets (read-only Secret volumes). */}}
{{- define "pdserve.clusterSecretFile" -}}/etc/pdserve/cluster-secret/cluster-secret{{- end }}
{{- define "pdserve.controlTlsDir" -}}/etc/pdserve/control-tls{{- end }}
{{- define "pdserve.metricsKeysFile" -}}/etc/pdserve/metrics-keys/keys{{- end }}

{{/* True (non-empty) when the chart creates the cluster secret itself. */}}
{{- define "pdserve.clusterSecretGenerated" -}}
{{- $cp := .Values.controlPlane }}
{{- if and (not $cp.insecure) (not $cp.clusterSecret.existingSecret) }}true{{ end }}
{{- end }}

{{- define "pdserve.clusterSecretName" -}}
{{- default (printf "%s-cluster-secret" (include "pdserve.fullname" .)) .Values.controlPlane.clusterSecret.existingSecret }}
{{- end }}

{{/* The generated cluster secret, base64-encoded as in the Secret's data: the
     value already in the cluster when there is one (lookup, so upgrades keep
     it), else 64 random characters (sprig's randAlphaNum draws from
     crypto/rand; 62 symbols, about 381 bits). Computed once per render and
     cached in the values, so the Secret and the pods' checksum annotations
     agree. Without a cluster (helm template, --dry-run) lookup finds nothing
     and every render draws a new value. */}}
{{- define "pdserve.clusterSecretData" -}}
{{- $cs := .Values.controlPlane.clusterSecret }}
{{- if not (hasKey $cs "_renderedData") }}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "pdserve.clusterSecretName" .) }}
{{- $data := dig "data" $cs.key "" $existing }}
{{- $_ := set $cs "_renderedData" (default (randAlphaNum 64 | b64enc) $data) }}
{{- end }}
{{- index $cs "_renderedData" }}
{{- end }}

{{/* Name of the control-plane TLS Secret of one component (router, prefill,
     decode); takes (dict "ctx" $ "component" name). */}}
{{- define "pdserve.controlTlsSecretName" -}}
{{- $tls := .ctx.Values.controlPlane.tls }}
{{- if $tls.certManager.enabled }}
{{- printf "%s-%s-control-tls" (include "pdserve.fullname" .ctx) .component }}
{{- else }}
{{- $tls.existingSecret }}
{{- end }}
{{- end }}

{{/* Pod annotations: the user's, plus a checksum of the generated cluster
     secret so that the pods roll exactly when its value changes (it is stable
     across upgrades). A Secret of your own (existingSecret) is not read: roll
     the pods yourself after changing it. Takes (dict "ctx" $ "extra" map). */}}
{{- define "pdserve.podAnnotations" -}}
{{- $a := deepCopy (default dict .extra) }}
{{- if include "pdserve.clusterSecretGenerated" .ctx }}
{{- $_ := set $a "checksum/cluster-secret" (include "pdserve.clusterSecretData" .ctx | sha256sum) }}
{{- end }}
{{- with $a }}
{{- toYaml . }}
{{- end }}
{{- end }}

{{/* Flags of the control-plane security and the /metrics key, shared by the
     router and the workers. */}}
{{- define "pdserve.securityArgs" -}}
{{- $cp := .Values.controlPlane }}
{{- if $cp.insecure }}
- --insecure-control-plane
{{- else }}
- --cluster-secret-file={{ include "pdserve.clusterSecretFile" . }}
{{- end }}
{{- if $cp.tls.enabled }}
- --control-tls-cert={{ include "pdserve.controlTlsDir" . }}/tls.crt
- --control-tls-key={{ include "pdserve.controlTlsDir" . }}/tls.key
- --control-tls-ca={{ include "pdserve.controlTlsDir" . }}/ca.crt
{{- end }}
{{- if .Values.metrics.auth.existingSecret }}
- --metrics-key-file={{ include "pdserve.metricsKeysFile" . }}
{{- end }}
{{- end }}

{{- define "pdserve.securityVolumeMounts" -}}
{{- if not .Values.controlPlane.insecure }}
- name: cluster-secret
  mountPath: {{ include "pdserve.clusterSecretFile" . | dir }}
  readOnly: true
{{- end }}
{{- if .Values.controlPlane.tls.enabled }}
- name: control-tls
  mountPath: {{ include "pdserve.controlTlsDir" . }}
  readOnly: true
{{- end }}
{{- if .Values.metrics.auth.existingSecret }}
- name: metrics-keys
  mountPath: {{ include "pdserve.metricsKeysFile" . | dir }}
  readOnly: true
{{- end }}
{{- end }}

{{/* Mode of the secret files: 0440, owner root and group the pod's fsGroup,
     which the server runs in; 0444 without an fsGroup, or it could not read
     them. Decimal (288, 292), so that YAML 1.1 and 1.2 parsers agree. */}}
{{- define "pdserve.secretFileMode" -}}
{{- if .Values.podSecurityContext.fsGroup }}288{{ else }}292{{ end }}
{{- end }}

{{/* Secret volumes, each with only the keys the process reads. Takes
     (dict "ctx" $ "component" name). */}}
{{- define "pdserve.securityVolumes" -}}
{{- $ctx := .ctx }}
{{- $cp := $ctx.Values.controlPlane }}
{{- $mode := include "pdserve.secretFileMode" $ctx }}
{{- if not $cp.insecure }}
- name: cluster-secret
  secret:
    secretName: {{ include "pdserve.clusterSecretName" $ctx }}
    defaultMode: {{ $mode }}
    items:
      - key: {{ $cp.clusterSecret.key }}
        path: {{ include "pdserve.clusterSecretFile" $ctx | base }}
{{- end }}
{{- if $cp.tls.enabled }}
- name: control-tls
  secret:
    secretName: {{ include "pdserve.controlTlsSecretName" . }}
    defaultMode: {{ $mode }}
    items:
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- with $ctx.Values.metrics.auth }}
{{- if .existingSecret }}
- name: metrics-keys
  secret:
    secretName: {{ .existingSecret }}
    defaultMode: {{ $mode }}
    items:
      - key: {{ .key }}
        path: {{ include "pdserve.metricsKeysFile" $ctx | base }}
{{- end }}
{{- end }}
{{- end }}

{{/* Scrape authorization of a ServiceMonitor/PodMonitor endpoint when
     /metrics needs a key. */}}
{{- define "pdserve.scrapeAuthorization" -}}
{{- with .Values.metrics.auth }}
{{- if .existingSecret }}
authorization:
  type: Bearer
  credentials:
    name: {{ .existingSecret }}
    key: {{ default .key .scrapeKey }}
{{- end }}
{{- end }}
{{- end }}
