{{/* Names and labels shared by every object. */}}
{{- define "splitserve.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "splitserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "splitserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "splitserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "splitserve.labels" -}}
{{ include "splitserve.selectorLabels" . }}
app.kubernetes.io/part-of: splitserve
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{/* image: the global one, or a pool's own (.image with repository/tag). */}}
{{- define "splitserve.image" -}}
{{- $repo := .root.Values.image.repository -}}
{{- $tag := .root.Values.image.tag -}}
{{- with .image -}}
{{- if .repository }}{{ $repo = .repository }}{{ end -}}
{{- if .tag }}{{ $tag = .tag }}{{ end -}}
{{- end -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}

{{- define "splitserve.secretName" -}}
{{- .Values.secrets.existingSecret | default (printf "%s-secrets" (include "splitserve.fullname" .)) -}}
{{- end -}}

{{/* The head's GCS, host:port, as the other pods reach it. */}}
{{- define "splitserve.headAddress" -}}
{{- if .Values.rayCluster.kuberay -}}
{{- printf "%s-head-svc:%d" (include "splitserve.fullname" .) (int .Values.ray.port) -}}
{{- else -}}
{{- printf "%s-head:%d" (include "splitserve.fullname" .) (int .Values.ray.port) -}}
{{- end -}}
{{- end -}}

{{/* The prefix index's URL; empty: no index. The release's Redis takes the Secret's password: Kubernetes expands
$(REDIS_PASSWORD) from the container's entry of that name (splitserve.redisEnv defines it first). */}}
{{- define "splitserve.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://:$(REDIS_PASSWORD)@%s-redis:6379/0" (include "splitserve.fullname" .) -}}
{{- else -}}
{{- .Values.redis.url -}}
{{- end -}}
{{- end -}}

{{/* The head's prefix index, as environment (`--redis-url` from SPLITSERVE_REDIS_URL): the password never on a
command line. The controller hands the URL to every worker (their KV event publishers) and to the gateways (their
index lookups), and purges dead workers' entries with it. */}}
{{- define "splitserve.redisEnv" -}}
{{- if .Values.redis.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "splitserve.secretName" . }}
      key: redis-password
{{- end }}
{{- with include "splitserve.redisUrl" . }}
- name: SPLITSERVE_REDIS_URL
  value: {{ . | quote }}
{{- end }}
{{- end -}}

{{/* The head's cluster secret, which every gRPC call between the gateway and the workers carries: the controller
gives it to every worker in its config, and the gateway reads it from the controller over Ray's token-authenticated
links (docs/security.md). Both kinds of head (a Deployment, KubeRay's head group) take it. */}}
{{- define "splitserve.clusterSecretEnv" -}}
- name: SPLITSERVE_CLUSTER_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "splitserve.secretName" . }}
      key: cluster-secret
{{- end -}}

{{/* Environment of every container that runs Ray: token authentication with the cluster secret. */}}
{{- define "splitserve.rayEnv" -}}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "splitserve.secretName" . }}
      key: cluster-secret
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
- name: SPLITSERVE_CACHE
  value: /var/cache/splitserve
{{- end -}}

{{/* Volumes of every Ray pod: shared memory for Ray's object store, the model cache. */}}
{{- define "splitserve.rayVolumes" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.ray.shmSizeLimit }}
- name: tmp
  emptyDir: {}
{{- if .Values.modelCache.enabled }}
- name: model-cache
  {{- if .Values.modelCache.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.modelCache.existingClaim }}
  {{- else }}
  emptyDir:
    sizeLimit: {{ .Values.modelCache.sizeLimit }}
  {{- end }}
{{- end }}
{{- end -}}

{{- define "splitserve.rayVolumeMounts" -}}
- name: dshm
  mountPath: /dev/shm
- name: tmp
  mountPath: /tmp
{{- if .Values.modelCache.enabled }}
- name: model-cache
  mountPath: /var/cache/splitserve
{{- end }}
{{- end -}}

{{- define "splitserve.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 1000
runAsGroup: 1000
fsGroup: 1000
{{- end -}}

{{- define "splitserve.containerSecurityContext" -}}
allowPrivilegeEscalation: false
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* Every Ray node's own ports, fixed (a pod has its network to itself): a raylet then never waits on a port file
its agents write, which a slow start can leave it waiting for past Ray's own timeout. */}}
{{- define "splitserve.rayNodePortFlags" -}}
{{- $r := .Values.ray -}}
{{- printf "--node-manager-port=%d --dashboard-agent-grpc-port=%d --dashboard-agent-listen-port=%d --runtime-env-agent-port=%d --metrics-export-port=%d" (int $r.nodeManagerPort) (int $r.dashboardAgentGrpcPort) (int $r.dashboardAgentListenPort) (int $r.runtimeEnvAgentPort) (int $r.metricsExportPort) -}}
{{- end -}}

{{- define "splitserve.rayNodePorts" -}}
- name: raylet
  containerPort: {{ .Values.ray.nodeManagerPort }}
- name: agent-grpc
  containerPort: {{ .Values.ray.dashboardAgentGrpcPort }}
- name: agent-http
  containerPort: {{ .Values.ray.dashboardAgentListenPort }}
- name: runtime-env
  containerPort: {{ .Values.ray.runtimeEnvAgentPort }}
- name: ray-metrics
  containerPort: {{ .Values.ray.metricsExportPort }}
{{- end -}}

{{/* `ray start` of a node that joins the head: the pool nodes' command, and the gateway's own node. */}}
{{- define "splitserve.rayJoinArgs" -}}
- {{ printf "--address=%s" (include "splitserve.headAddress" .root) | quote }}
{{- range (splitList " " (include "splitserve.rayNodePortFlags" .root)) }}
- {{ . | quote }}
{{- end }}
- {{ printf "--object-store-memory=%d" (int64 .root.Values.ray.objectStoreMemoryBytes) | quote }}
- "--disable-usage-stats"
- "--temp-dir=/tmp/ray"
{{- end -}}

{{/* `splitserve head`'s flags, after its --start-ray (which differs in KubeRay mode). */}}
{{- define "splitserve.headPoolArgs" -}}
- {{ printf "--controller-name=%s" .Values.controller.name | quote }}
- {{ printf "--controller-namespace=%s" .Values.controller.namespace | quote }}
- "--ready-file=/tmp/splitserve/head-ready"
- {{ printf "--prefill-workers=%d" (mul (int .Values.prefill.replicas) (int .Values.prefill.workersPerNode)) | quote }}
- {{ printf "--decode-workers=%d" (mul (int .Values.decode.replicas) (int .Values.decode.workersPerNode)) | quote }}
- {{ printf "--kv-transport=%s" .Values.kvTransport | quote }}
{{- range $role := list "prefill" "decode" }}
{{- $pool := index $.Values $role }}
{{- $tp := int ($pool.tensorParallelSize | default 1) }}
{{- if gt $tp 1 }}
- {{ printf "--%s-tensor-parallel-size=%d" $role $tp | quote }}
{{- end }}
{{- if and (gt (int $pool.gpus) 0) (lt (int $pool.gpus) (mul $tp (int $pool.workersPerNode))) }}
{{- fail (printf "%s.gpus is %d: a pod of %d workers of tensorParallelSize %d needs %d GPUs (one per rank)" $role (int $pool.gpus) (int $pool.workersPerNode) $tp (mul $tp (int $pool.workersPerNode))) }}
{{- end }}
{{- end }}
{{- if not (include "splitserve.redisUrl" .) }}
- "--no-prefix-index"
{{- end }}
- {{ printf "--model=%s" .Values.model | quote }}
{{- if gt (int .Values.numThreads) 0 }}
- {{ printf "--num-threads=%d" (int .Values.numThreads) | quote }}
{{- end }}
{{- range .Values.engine }}
- {{ . | quote }}
{{- end }}
{{- range .Values.head.args }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{- define "splitserve.headArgs" -}}
- {{ printf "--start-ray=ray start --head --port=%d %s --ray-client-server-port=%d --dashboard-port=%d --num-cpus=0 --object-store-memory=%d --include-dashboard=false --disable-usage-stats --temp-dir=/tmp/ray" (int .Values.ray.port) (include "splitserve.rayNodePortFlags" .) (int .Values.ray.clientServerPort) (int .Values.ray.dashboardPort) (int64 .Values.ray.objectStoreMemoryBytes) | quote }}
- {{ printf "--ray-address=127.0.0.1:%d" (int .Values.ray.port) | quote }}
{{ include "splitserve.headPoolArgs" . }}
{{- end -}}
