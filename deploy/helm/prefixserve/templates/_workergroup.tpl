{{/*
One KubeRay worker group. Argument: (dict "root" $ "w" <group values> "gpus" N "component" name).
The GPU count appears three times and must agree: rayStartParams num-gpus (what Ray
schedules), and the nvidia.com/gpu request and limit (what Kubernetes allocates).
*/}}
{{- define "prefixserve.workerGroup" -}}
{{- $root := .root }}
{{- $w := .w -}}
- groupName: {{ $w.groupName }}
  replicas: {{ int $w.replicas }}
  minReplicas: {{ int $w.minReplicas }}
  maxReplicas: {{ int $w.maxReplicas }}
  {{- if $root.Values.autoscaling.enabled }}
  idleTimeoutSeconds: {{ int $root.Values.autoscaling.idleTimeoutSeconds }}
  {{- end }}
  rayStartParams:
    num-cpus: {{ $w.cpus | toString | quote }}
    num-gpus: {{ .gpus | toString | quote }}
    {{- range $k, $v := $w.rayStartParams }}
    {{ $k }}: {{ $v | toString | quote }}
    {{- end }}
  template:
    metadata:
      labels:
        {{- include "prefixserve.labels" $root | nindent 8 }}
        app.kubernetes.io/component: {{ .component }}
    spec:
      {{- with include "prefixserve.podCommon" (dict "root" $root "weights" true) | trim }}
      {{- . | nindent 6 }}
      {{- end }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
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
      containers:
        - name: ray-worker
          image: {{ include "prefixserve.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          ports:
            - name: metrics
              containerPort: 8080
          env:
            {{- include "prefixserve.env" $root | nindent 12 }}
          resources:
            requests:
              cpu: {{ $w.cpus | toString | quote }}
              memory: {{ $w.memory }}
              {{- if gt (int .gpus) 0 }}
              nvidia.com/gpu: {{ .gpus | toString | quote }}
              {{- end }}
            limits:
              memory: {{ $w.memory }}
              {{- if gt (int .gpus) 0 }}
              nvidia.com/gpu: {{ .gpus | toString | quote }}
              {{- end }}
          {{- with $root.Values.securityContext }}
          securityContext:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          volumeMounts:
            {{- include "prefixserve.volumeMounts" $root | nindent 12 }}
      volumes:
        {{- include "prefixserve.volumes" (dict "root" $root "shmSize" $w.shmSize "head" false) | nindent 8 }}
{{- end }}
