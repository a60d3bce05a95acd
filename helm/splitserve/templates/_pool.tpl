{{/* A pool: its Ray worker nodes' Deployment, PDB and HPA. .role is prefill or decode. */}}
{{- define "splitserve.pool" -}}
{{- $root := .root -}}
{{- $role := .role -}}
{{- $pool := index $root.Values $role -}}
{{- $component := printf "%s-pool" $role -}}
{{- $ctx := dict "root" $root "component" $component -}}
{{- if not $root.Values.rayCluster.kuberay }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "splitserve.fullname" $root }}-{{ $role }}
  labels:
    {{- include "splitserve.labels" $ctx | nindent 4 }}
spec:
  {{- if not $pool.autoscaling.enabled }}
  replicas: {{ $pool.replicas }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "splitserve.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "splitserve.labels" $ctx | nindent 8 }}
    spec:
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- include "splitserve.podSecurityContext" $root | nindent 8 }}
      terminationGracePeriodSeconds: 60
      containers:
        - name: ray-node
          image: {{ include "splitserve.image" (dict "root" $root "image" $pool.image) | quote }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          # a plain Ray worker node of this pool: the controller places the pool's workers on nodes that have its resource
          command: ["ray", "start"]
          args:
            {{- include "splitserve.rayJoinArgs" (dict "root" $root) | nindent 12 }}
            - {{ printf "--resources={\"splitserve_%s\": %d}" $role (int $pool.workersPerNode) | quote }}
            {{- if gt (int $pool.gpus) 0 }}
            - {{ printf "--num-gpus=%d" (int $pool.gpus) | quote }}
            {{- end }}
            - "--block"
          env:
            {{- include "splitserve.rayEnv" $root | nindent 12 }}
          ports:
            {{- include "splitserve.rayNodePorts" $root | nindent 12 }}
          livenessProbe:
            # the raylet serves (Ray's --block stops the container when a Ray process dies)
            tcpSocket:
              port: raylet
            initialDelaySeconds: 30
            periodSeconds: 10
            failureThreshold: 6
          readinessProbe:
            # the node is part of the cluster: the head's GCS answers it
            exec:
              command: ["ray", "health-check", {{ printf "--address=%s" (include "splitserve.headAddress" $root) | quote }}]
            initialDelaySeconds: 10
            periodSeconds: 20
            timeoutSeconds: 10
            failureThreshold: 3
          resources:
            {{- $resources := deepCopy $pool.resources }}
            {{- if gt (int $pool.gpus) 0 }}
            {{- $limits := $resources.limits | default dict }}
            {{- $_ := set $limits "nvidia.com/gpu" (int $pool.gpus) }}
            {{- $_ := set $resources "limits" $limits }}
            {{- end }}
            {{- toYaml $resources | nindent 12 }}
          securityContext:
            {{- include "splitserve.containerSecurityContext" $root | nindent 12 }}
          volumeMounts:
            {{- include "splitserve.rayVolumeMounts" $root | nindent 12 }}
      volumes:
        {{- include "splitserve.rayVolumes" $root | nindent 8 }}
      {{- with $pool.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $pool.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $pool.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- if $pool.autoscaling.enabled }}
---
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "splitserve.fullname" $root }}-{{ $role }}
  labels:
    {{- include "splitserve.labels" $ctx | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "splitserve.fullname" $root }}-{{ $role }}
  minReplicas: {{ $pool.autoscaling.minReplicas }}
  maxReplicas: {{ $pool.autoscaling.maxReplicas }}
  metrics:
    {{- if $pool.autoscaling.metrics }}
    {{- toYaml $pool.autoscaling.metrics | nindent 4 }}
    {{- else }}
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: 70
    {{- end }}
{{- end }}
{{- end }}
{{- if $pool.pdb.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "splitserve.fullname" $root }}-{{ $role }}
  labels:
    {{- include "splitserve.labels" $ctx | nindent 4 }}
spec:
  maxUnavailable: {{ $pool.pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- if $root.Values.rayCluster.kuberay }}
      ray.io/cluster: {{ include "splitserve.fullname" $root }}
      ray.io/group: {{ $role }}
      {{- else }}
      {{- include "splitserve.selectorLabels" $ctx | nindent 6 }}
      {{- end }}
{{- end }}
{{- end -}}
