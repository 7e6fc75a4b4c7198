{{/*
Shared names, labels, checks and the Serve config of the prefixserve chart.
Every value that must agree across resources (GPU counts, Redis URL, secret names) is
computed here once; `prefixserve.validate` fails rendering on combinations that would
deploy but never schedule or serve.
*/}}

{{- define "prefixserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* At most 47 characters: KubeRay rejects longer RayService names (it appends 6 to name the
RayCluster, whose limit is 53). */}}
{{- define "prefixserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 47 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "prefixserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "prefixserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "prefixserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "prefixserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "prefixserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* GPUs one engine replica reserves in all: one per tensor-parallel rank on CUDA, none on CPU. */}}
{{- define "prefixserve.gpusPerReplica" -}}
{{- if hasPrefix "cuda" .Values.engine.device }}{{ int .Values.engine.tensorParallelSize }}{{ else }}0{{ end }}
{{- end }}

{{/*
GPUs of the replica actor itself (tensor-parallel rank 0). It runs in bundle 0 of the
replica's placement group, so it asks for that bundle's GPU only; ranks 1..N-1 take the
other bundles.
*/}}
{{- define "prefixserve.gpusPerReplicaActor" -}}
{{- if hasPrefix "cuda" .Values.engine.device }}1{{ else }}0{{ end }}
{{- end }}

{{- define "prefixserve.apiKeySecretName" -}}
{{- default (printf "%s-api-key" (include "prefixserve.fullname" .)) .Values.apiKey.existingSecret }}
{{- end }}

{{- define "prefixserve.redisName" -}}
{{- printf "%s-redis" (include "prefixserve.fullname" .) }}
{{- end }}

{{/* The in-cluster StatefulSet runs only when no external URL is given. */}}
{{- define "prefixserve.redisInCluster" -}}
{{- if and .Values.redis.enabled (not .Values.redis.external.url) }}true{{ end }}
{{- end }}

{{/* The Secret of the in-cluster Redis's password. */}}
{{- define "prefixserve.redisSecretName" -}}
{{- default (printf "%s-redis" (include "prefixserve.fullname" .)) .Values.redis.auth.existingSecret }}
{{- end }}

{{/*
Where the prefix index's Redis password comes from, as JSON {name, key}, or "" for none:
the in-cluster Redis's Secret (redis.auth) or the external Redis's (redis.external).
*/}}
{{- define "prefixserve.redisPasswordRef" -}}
{{- if .Values.redis.external.url }}
{{- if .Values.redis.external.passwordSecret }}
{{- toJson (dict "name" .Values.redis.external.passwordSecret "key" .Values.redis.external.passwordSecretKey) }}
{{- end }}
{{- else if and .Values.redis.enabled .Values.redis.auth.enabled }}
{{- toJson (dict "name" (include "prefixserve.redisSecretName" .) "key" .Values.redis.auth.secretKey) }}
{{- end }}
{{- end }}

{{/*
KubeRay's gcsFaultToleranceOptions as JSON: the chart's Redis (host:port of the in-cluster
Service or of redis.external.url, and its password Secret) unless gcsFaultTolerance names
another one.
*/}}
{{- define "prefixserve.gcsFaultToleranceOptions" -}}
{{- $ft := .Values.gcsFaultTolerance }}
{{- $opts := dict }}
{{- if $ft.redisAddress }}
{{- $_ := set $opts "redisAddress" $ft.redisAddress }}
{{- if $ft.redisPasswordSecret }}
{{- $_ := set $opts "redisPassword" (dict "valueFrom" (dict "secretKeyRef" (dict "name" $ft.redisPasswordSecret "key" $ft.redisPasswordSecretKey))) }}
{{- end }}
{{- else }}
{{- if .Values.redis.external.url }}
{{- $u := urlParse .Values.redis.external.url }}
{{- $_ := set $opts "redisAddress" $u.host }}
{{- else }}
{{- $_ := set $opts "redisAddress" (printf "%s.%s.svc:%d" (include "prefixserve.redisName" .) .Release.Namespace (int .Values.redis.port)) }}
{{- end }}
{{- $ref := include "prefixserve.redisPasswordRef" . }}
{{- if $ref }}
{{- $_ := set $opts "redisPassword" (dict "valueFrom" (dict "secretKeyRef" ($ref | fromJson))) }}
{{- end }}
{{- end }}
{{- with $ft.externalStorageNamespace }}
{{- $_ := set $opts "externalStorageNamespace" . }}
{{- end }}
{{- toJson $opts }}
{{- end }}

{{/* Where hub models are downloaded on the pods: engine.downloadDir, else the cache volume. */}}
{{- define "prefixserve.downloadDir" -}}
{{- default (printf "%s/hub" (trimSuffix "/" .Values.modelCache.mountPath)) .Values.engine.downloadDir }}
{{- end }}

{{- define "prefixserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "prefixserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The index URL without password (the password comes from env PREFIXSERVE_REDIS_PASSWORD). */}}
{{- define "prefixserve.redisUrl" -}}
{{- if .Values.redis.external.url }}
{{- .Values.redis.external.url }}
{{- else if .Values.redis.enabled }}
{{- printf "redis://%s.%s.svc:%d/%d" (include "prefixserve.redisName" .) .Release.Namespace (int .Values.redis.port) (int .Values.redis.db) }}
{{- end }}
{{- end }}

{{/* Fails rendering on values that would deploy but could never schedule or serve. */}}
{{- define "prefixserve.validate" -}}
{{- $tp := int .Values.engine.tensorParallelSize }}
{{- $cuda := hasPrefix "cuda" .Values.engine.device }}
{{- if and $cuda (not .Values.gpuWorkers.enabled) }}
{{- fail "engine.device is cuda but gpuWorkers.enabled is false: no pod has a GPU (set engine.device=cpu and cpuWorkers.enabled=true for CPU serving)" }}
{{- end }}
{{- if and (not $cuda) (not .Values.cpuWorkers.enabled) }}
{{- fail "engine.device is cpu but cpuWorkers.enabled is false: set cpuWorkers.enabled=true" }}
{{- end }}
{{- if and .Values.gpuWorkers.enabled (ne 0 (mod (int .Values.gpuWorkers.gpusPerPod) $tp)) }}
{{- fail (printf "gpuWorkers.gpusPerPod (%d) must be a multiple of engine.tensorParallelSize (%d): a replica's bundles are STRICT_PACKed into one pod" (int .Values.gpuWorkers.gpusPerPod) $tp) }}
{{- end }}
{{- if and (not $cuda) (lt (int .Values.cpuWorkers.cpus) (mul $tp (int .Values.cluster.numCpusPerReplica) | int)) }}
{{- fail "cpuWorkers.cpus must hold at least one replica: engine.tensorParallelSize * cluster.numCpusPerReplica" }}
{{- end }}
{{- if and .Values.apiKey.enabled (not .Values.apiKey.existingSecret) (not .Values.apiKey.value) }}
{{- fail "apiKey.enabled needs apiKey.existingSecret or apiKey.value" }}
{{- end }}
{{- if and .Values.keda.enabled (not .Values.keda.scaleTargetRef.name) }}
{{- fail "keda.enabled needs keda.scaleTargetRef.name (RayService has no /scale subresource)" }}
{{- end }}
{{- if and .Values.keda.enabled (not .Values.monitoring.serviceMonitor.enabled) }}
{{- fail "keda.enabled needs monitoring.serviceMonitor.enabled=true: the ScaledObject's query reads prefixserve:num_requests_waiting, which Prometheus only has when it scrapes the Serve service" }}
{{- end }}
{{- if and .Values.gcsFaultTolerance.enabled (not .Values.gcsFaultTolerance.redisAddress) (not (include "prefixserve.redisUrl" .)) }}
{{- fail "gcsFaultTolerance.enabled needs a Redis: redis.enabled=true, redis.external.url or gcsFaultTolerance.redisAddress" }}
{{- end }}
{{- if and .Values.gcsFaultTolerance.enabled .Values.redis.external.url (hasPrefix "unix" .Values.redis.external.url) (not .Values.gcsFaultTolerance.redisAddress) }}
{{- fail "gcsFaultTolerance needs a TCP Redis: redis.external.url is a unix socket, set gcsFaultTolerance.redisAddress" }}
{{- end }}
{{- if eq .Values.serve.upgradeStrategy.type "NewClusterWithIncrementalUpgrade" }}
{{- $o := .Values.serve.upgradeStrategy.clusterUpgradeOptions }}
{{- if not (and $o.gatewayClassName $o.stepSizePercent $o.intervalSeconds) }}
{{- fail "serve.upgradeStrategy.type NewClusterWithIncrementalUpgrade needs serve.upgradeStrategy.clusterUpgradeOptions with gatewayClassName, stepSizePercent and intervalSeconds" }}
{{- end }}
{{- if not .Values.autoscaling.enabled }}
{{- fail "serve.upgradeStrategy.type NewClusterWithIncrementalUpgrade needs autoscaling.enabled=true (KubeRay requires the Ray autoscaler for it)" }}
{{- end }}
{{- end }}
{{- if and .Values.ingress.enabled .Values.httpRoute.enabled }}
{{- fail "set only one of ingress.enabled and httpRoute.enabled" }}
{{- end }}
{{- if and .Values.httpRoute.enabled (not .Values.httpRoute.parentRefs) }}
{{- fail "httpRoute.enabled needs httpRoute.parentRefs (the Gateway to attach to)" }}
{{- end }}
{{- range $section, $extra := .Values.extraArgs }}
{{- range $key, $_ := $extra }}
{{- if ne $key (snakecase $key) }}
{{- fail (printf "extraArgs.%s.%s: use the config's snake_case field name (%s)" $section $key (snakecase $key)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Converts a values map (camelCase keys) into Serve args (snake_case keys), dropping nulls so
the dataclass defaults apply, and turning whole floats back into ints (Helm reads every
number as float64; 8589934592 would otherwise reach Python as 8.589934592e+09).
*/}}
{{- define "prefixserve.snakeArgs" -}}
{{- $out := dict }}
{{- range $key, $value := . }}
{{- if not (kindIs "invalid" $value) }}
{{- if and (kindIs "float64" $value) (eq (float64 (int64 $value)) $value) }}
{{- $_ := set $out (snakecase $key) (int64 $value) }}
{{- else }}
{{- $_ := set $out (snakecase $key) $value }}
{{- end }}
{{- end }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/* The args of cluster.app:build_app: {engine, router, cluster}. */}}
{{- define "prefixserve.appArgs" -}}
{{- $engine := include "prefixserve.snakeArgs" (omit .Values.engine "tensorParallelSize") | fromJson }}
{{- if gt (int .Values.engine.tensorParallelSize) 1 }}
{{- $_ := set $engine "tensor_parallel_size" (int .Values.engine.tensorParallelSize) }}
{{- end }}
{{- $_ := set $engine "cache_dir" .Values.modelCache.mountPath }}
{{- $_ := set $engine "download_dir" (include "prefixserve.downloadDir" .) }}
{{- $engine = mergeOverwrite $engine (include "prefixserve.snakeArgs" .Values.extraArgs.engine | fromJson) }}
{{- $router := include "prefixserve.snakeArgs" .Values.router | fromJson }}
{{- $_ := set $router "block_size" (int .Values.engine.blockSize) }}
{{- $redisUrl := include "prefixserve.redisUrl" . }}
{{- if $redisUrl }}
{{- $_ := set $router "index_backend" "redis" }}
{{- $_ := set $router "redis_url" $redisUrl }}
{{- else }}
{{- $_ := set $router "index_backend" "embedded" }}
{{- end }}
{{- $router = mergeOverwrite $router (include "prefixserve.snakeArgs" .Values.extraArgs.router | fromJson) }}
{{- $cluster := include "prefixserve.snakeArgs" .Values.cluster | fromJson }}
{{- $_ := set $cluster "num_gpus_per_replica" (include "prefixserve.gpusPerReplicaActor" . | int) }}
{{- $_ := set $cluster "app_name" .Values.serve.appName }}
{{- $_ := set $cluster "host" "0.0.0.0" }}
{{- $_ := set $cluster "port" (int .Values.serve.port) }}
{{- $cluster = mergeOverwrite $cluster (include "prefixserve.snakeArgs" .Values.extraArgs.cluster | fromJson) }}
{{- toJson (dict "engine" $engine "router" $router "cluster" $cluster) }}
{{- end }}

{{/*
Options of the engine deployment: one placement-group bundle per tensor-parallel rank,
STRICT_PACKed onto one node, and Serve autoscaling when enabled.
*/}}
{{- define "prefixserve.engineDeployment" -}}
{{- $tp := int .Values.engine.tensorParallelSize }}
{{- $bundle := dict "CPU" .Values.cluster.numCpusPerReplica }}
{{- if hasPrefix "cuda" .Values.engine.device }}
{{- $_ := set $bundle "GPU" 1 }}
{{- end }}
{{- $bundles := list }}
{{- range until $tp }}
{{- $bundles = append $bundles $bundle }}
{{- end }}
{{- $dep := dict "name" .Values.serve.engineDeploymentName "placement_group_bundles" $bundles "placement_group_strategy" "STRICT_PACK" }}
{{- if .Values.autoscaling.enabled }}
{{- $_ := set $dep "num_replicas" "auto" }}
{{- $_ := set $dep "autoscaling_config" (dict "min_replicas" (int .Values.autoscaling.minReplicas) "max_replicas" (int .Values.autoscaling.maxReplicas) "target_ongoing_requests" .Values.autoscaling.targetOngoingRequests "downscale_delay_s" .Values.autoscaling.downscaleDelayS) }}
{{- else }}
{{- $_ := set $dep "num_replicas" (int .Values.cluster.numReplicas) }}
{{- end }}
{{- toJson $dep }}
{{- end }}

{{/* The whole Serve config (serveConfigV2), as YAML. */}}
{{- define "prefixserve.serveConfig" -}}
{{- $app := dict "name" .Values.serve.appName "route_prefix" .Values.serve.routePrefix "import_path" .Values.serve.importPath }}
{{- $_ := set $app "args" (include "prefixserve.appArgs" . | fromJson) }}
{{- $_ := set $app "deployments" (list (include "prefixserve.engineDeployment" . | fromJson)) }}
{{- $config := dict "proxy_location" "EveryNode" "http_options" (dict "host" "0.0.0.0" "port" (int .Values.serve.port)) "applications" (list $app) }}
{{- toYaml $config }}
{{- end }}

{{/* Env of every Ray container: secrets by reference, caches on the model volume. */}}
{{- define "prefixserve.env" -}}
- name: HF_HOME
  value: {{ printf "%s/huggingface" .Values.modelCache.mountPath | quote }}
- name: PREFIXSERVE_CACHE
  value: {{ .Values.modelCache.mountPath | quote }}
{{- /* Serve's proxy calls the ingress on the transport the ingress uses for the engines. */}}
- name: RAY_SERVE_PROXY_USE_GRPC
  value: {{ ternary "1" "0" (eq .Values.cluster.handleTransport "grpc") | quote }}
{{- /* Serve's proxy and controller hand their cached request metrics to Ray once a second, as
the deployments do (cluster/app.py's SERVE_ENV, in their runtime_env). */}}
- name: RAY_SERVE_METRICS_EXPORT_INTERVAL_MS
  value: "1000"
{{- /* The controller reconciles every 0.5 s, not every 0.1 s (cluster/app.py's SERVE_ENV). */}}
- name: RAY_SERVE_CONTROL_LOOP_INTERVAL_S
  value: "0.5"
{{- if .Values.apiKey.enabled }}
- name: PREFIXSERVE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "prefixserve.apiKeySecretName" . }}
      key: {{ .Values.apiKey.secretKey }}
{{- end }}
{{- with include "prefixserve.redisPasswordRef" . }}
- name: PREFIXSERVE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      {{- toYaml (fromJson .) | nindent 6 }}
{{- end }}
{{- if .Values.hfToken.existingSecret }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.hfToken.existingSecret }}
      key: {{ .Values.hfToken.secretKey }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "prefixserve.volumeMounts" -}}
- name: model-cache
  mountPath: {{ .Values.modelCache.mountPath }}
- name: dshm
  mountPath: /dev/shm
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Volumes of a Ray pod; the argument is (dict "root" $ "shmSize" "2Gi" "head" true|false).
The head (ingress: tokenizer and configs only) mounts a claim the chart created only when that
claim can attach on several nodes: a ReadWriteOnce claim goes to the workers alone, so a head
on a CPU node never holds the volume a GPU node's pod needs. An existingClaim is mounted
everywhere (it may hold the model folder the ingress reads its tokenizer from).
*/}}
{{- define "prefixserve.volumes" -}}
{{- $v := .root.Values -}}
{{- $singleNode := and (not $v.modelCache.existingClaim) (not (has "ReadWriteMany" $v.modelCache.accessModes)) (not (has "ReadOnlyMany" $v.modelCache.accessModes)) -}}
- name: model-cache
{{- if and $v.modelCache.enabled (not (and .head $singleNode)) }}
  persistentVolumeClaim:
    claimName: {{ default (printf "%s-model-cache" (include "prefixserve.fullname" .root)) $v.modelCache.existingClaim }}
{{- else if $v.modelCache.emptyDirSizeLimit }}
  emptyDir:
    sizeLimit: {{ $v.modelCache.emptyDirSizeLimit }}
{{- else }}
  emptyDir: {}
{{- end }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSize }}
{{- with $v.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
The pod-level fields every Ray pod shares: service account, security context, and the
model-download initContainer. Argument: (dict "root" $ "weights" true|false); the head
fetches only the tokenizer and configs (weights false), the workers everything.
*/}}
{{- define "prefixserve.podCommon" -}}
{{- $root := .root }}
{{- with include "prefixserve.serviceAccountName" $root }}
serviceAccountName: {{ . }}
{{- end }}
{{- with $root.Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if $root.Values.modelDownload.enabled }}
initContainers:
  - name: model-download
    image: {{ include "prefixserve.image" $root }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    command: ["python", "-c"]
    args:
      - {{ include "prefixserve.downloadScript" . | quote }}
    env:
      - name: PREFIXSERVE_MODEL
        value: {{ $root.Values.engine.model | quote }}
      - name: PREFIXSERVE_REVISION
        value: {{ $root.Values.engine.revision | default "" | quote }}
      - name: PREFIXSERVE_DOWNLOAD_DIR
        value: {{ include "prefixserve.downloadDir" $root | quote }}
      {{- include "prefixserve.env" $root | nindent 6 }}
    {{- with $root.Values.modelDownload.resources }}
    resources:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with $root.Values.securityContext }}
    securityContext:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    volumeMounts:
      {{- include "prefixserve.volumeMounts" $root | nindent 6 }}
{{- end }}
{{- end }}

{{/*
The initContainer's program: download engine.model when it is a hub id (anything else is a
path or alias the engine resolves itself), with the same function and cache layout the engine
uses, so the engine finds it cached.
*/}}
{{- define "prefixserve.downloadScript" -}}
import os; from worker.hub import download_repo, looks_like_repo_id; m = os.environ['PREFIXSERVE_MODEL']; hub = looks_like_repo_id(m); print(('downloading ' + m) if hub else (m + ' is not a hub id: nothing to download'), flush=True); download_repo(m, revision=os.environ['PREFIXSERVE_REVISION'] or None, download_dir=os.environ['PREFIXSERVE_DOWNLOAD_DIR'], weights={{ if .weights }}True{{ else }}False{{ end }}) if hub else None
{{- end }}

{{- define "prefixserve.containerPorts" -}}
- name: gcs
  containerPort: 6379
- name: dashboard
  containerPort: 8265
- name: client
  containerPort: 10001
- name: serve
  containerPort: {{ .Values.serve.port }}
- name: metrics
  containerPort: 8080
{{- end }}
