{{/*
Shared names, labels, checks and the Serve config of the prefixserve chart.
Every value that must agree across resources (GPU counts, Redis URL, secret names) is
computed here once; `prefixserve.validate` fails rendering on combinations that would
deploy but never schedule or serve.
*/}}

{{- define "prefixserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "prefixserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
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
{{- $router := include "prefixserve.snakeArgs" .Values.router | fromJson }}
{{- $_ := set $router "block_size" (int .Values.engine.blockSize) }}
{{- $redisUrl := include "prefixserve.redisUrl" . }}
{{- if $redisUrl }}
{{- $_ := set $router "index_backend" "redis" }}
{{- $_ := set $router "redis_url" $redisUrl }}
{{- else }}
{{- $_ := set $router "index_backend" "embedded" }}
{{- end }}
{{- $cluster := include "prefixserve.snakeArgs" .Values.cluster | fromJson }}
{{- $_ := set $cluster "num_gpus_per_replica" (include "prefixserve.gpusPerReplicaActor" . | int) }}
{{- $_ := set $cluster "app_name" .Values.serve.appName }}
{{- $_ := set $cluster "host" "0.0.0.0" }}
{{- $_ := set $cluster "port" (int .Values.serve.port) }}
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
{{- if .Values.apiKey.enabled }}
- name: PREFIXSERVE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "prefixserve.apiKeySecretName" . }}
      key: {{ .Values.apiKey.secretKey }}
{{- end }}
{{- if and .Values.redis.external.url .Values.redis.external.passwordSecret }}
- name: PREFIXSERVE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.passwordSecret }}
      key: {{ .Values.redis.external.passwordSecretKey }}
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
{{- end }}

{{/* Volumes of a Ray pod; the argument is (dict "root" $ "shmSize" "2Gi"). */}}
{{- define "prefixserve.volumes" -}}
{{- $v := .root.Values -}}
- name: model-cache
{{- if $v.modelCache.enabled }}
  persistentVolumeClaim:
    claimName: {{ default (printf "%s-model-cache" (include "prefixserve.fullname" .root)) $v.modelCache.existingClaim }}
{{- else }}
  emptyDir: {}
{{- end }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSize }}
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
