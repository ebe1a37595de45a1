{{/*
Pod template for the Deployment (role "leader", one node) and for the LeaderWorkerSet
(role "leader": node rank 0 with the API server; role "worker": headless ranks).
Call with (dict "root" $ "role" "leader"|"worker").
*/}}
{{- define "mla-serve.podTemplate" -}}
{{- $ := .root -}}
{{- $role := .role -}}
{{- $v := $.Values -}}
{{- $multi := include "mla-serve.multiNode" $ -}}
{{- $nodes := int (include "mla-serve.nodes" $) -}}
{{- $stateDir := "/var/run/mla-serve" -}}
{{- $cache := $v.modelCache.mountPath -}}
{{- $threshold := include "mla-serve.startupFailureThreshold" $ -}}
metadata:
  labels:
    {{- include "mla-serve.serverSelectorLabels" $ | nindent 4 }}
    app.kubernetes.io/version: {{ $.Chart.AppVersion | quote }}
    mla-serve.io/role: {{ $role }}
    {{- with $v.profile }}
    mla-serve.io/profile: {{ . }}
    {{- end }}
    {{- with $v.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    mla-serve.io/layout: {{ printf "tp=%d pcp=%d dcp=%d pp=%d dp=%d ep=%t nodes=%d" (int $v.parallelism.tensor) (int $v.parallelism.prefillContext) (int $v.parallelism.decodeContext) (int $v.parallelism.pipeline) (int $v.parallelism.data) $v.parallelism.expert $nodes | quote }}
    mla-serve.io/cudagraph-mode: {{ include "mla-serve.cudagraphIntent" $ }}
    {{- with $v.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "mla-serve.serviceAccountName" $ }}
  automountServiceAccountToken: {{ $v.serviceAccount.automountToken }}
  # Service links would inject <SERVICE>_PORT variables: a Service named "vllm" sets VLLM_PORT
  # (which vLLM reads) and one named "mla-serve" sets MLA_SERVE_PORT (which the sidecar reads).
  enableServiceLinks: false
  terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
  {{- with $v.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $v.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $v.podSecurityContext | nindent 4 }}
  {{- if or $v.gpu.product $v.gpu.arch $v.nodeSelector }}
  nodeSelector:
    {{- with $v.gpu.arch }}
    kubernetes.io/arch: {{ . }}
    {{- end }}
    {{- with $v.gpu.product }}
    {{ $v.gpu.productLabel }}: {{ . }}
    {{- end }}
    {{- with $v.nodeSelector }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- end }}
  {{- if and (include "mla-serve.computeDomain" $) $v.multiNode.computeDomain.cliqueTopologyKey }}
  affinity:
    # Every pod of a group inside one NVLink domain (the IMEX channel does not cross racks).
    podAffinity:
      requiredDuringSchedulingIgnoredDuringExecution:
        - topologyKey: {{ $v.multiNode.computeDomain.cliqueTopologyKey }}
          labelSelector:
            matchLabels:
              {{- include "mla-serve.serverSelectorLabels" $ | nindent 14 }}
          matchLabelKeys:
            - leaderworkerset.sigs.k8s.io/group-key
    {{- with $v.affinity }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- else if $v.affinity }}
  affinity:
    {{- toYaml $v.affinity | nindent 4 }}
  {{- end }}
  {{- with $v.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if include "mla-serve.computeDomain" $ }}
  resourceClaims:
    - name: compute-domain-channel
      resourceClaimTemplateName: {{ include "mla-serve.fullname" $ }}-channel
  {{- end }}
  {{- if include "mla-serve.prefetch" $ }}
  initContainers:
    # Fetch the model into the cache (or, offline, prove it is there) before vLLM starts, so
    # vLLM runs with HF_HUB_OFFLINE=1 and the download never eats the start-up budget.
    - name: model-prefetch
      image: {{ include "mla-serve.image" $ }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      command: ["hf", "download", {{ $v.model.name | quote }}{{ with $v.model.revision }}, "--revision", {{ . | quote }}{{ end }}]
      env:
        {{- include "mla-serve.hfEnv" (dict "root" $ "offline" $v.modelCache.offline) | nindent 8 }}
      securityContext:
        {{- toYaml $v.securityContext | nindent 8 }}
      resources:
        requests:
          cpu: "2"
          memory: 4Gi
        limits:
          memory: 8Gi
      volumeMounts:
        - name: model-cache
          mountPath: {{ $cache }}
        - name: tmp
          mountPath: /tmp
  {{- end }}
  containers:
    - name: vllm
      image: {{ include "mla-serve.image" $ }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      # The image's entrypoint verifies the fix manifest, refuses to start on drift
      # (MLA_SERVE_ALLOW_DRIFT=1 overrides), then execs `vllm serve` with these args.
      command: ["mla-serve-entrypoint", "serve"]
      args:
        {{- include "mla-serve.vllmArgs" $ | nindent 8 }}
        {{- if eq $role "leader" }}
        - --host=0.0.0.0
        - --port={{ $v.vllm.port }}
        {{- end }}
        {{- if $multi }}
        # One vLLM world over {{ $nodes }} nodes: rank 0 is this group's leader, the others run
        # headless. LWS sets LWS_LEADER_ADDRESS and LWS_WORKER_INDEX (0 on the leader).
        - --nnodes={{ $nodes }}
        {{- if eq $role "leader" }}
        - --node-rank=0
        - --master-addr=$(POD_IP)
        {{- else }}
        - --node-rank=$(LWS_WORKER_INDEX)
        - --master-addr=$(LWS_LEADER_ADDRESS)
        {{- end }}
        - --master-port={{ $v.multiNode.masterPort }}
        {{- if eq $role "worker" }}
        - --headless
        {{- end }}
        {{- end }}
      env:
        {{- include "mla-serve.hfEnv" (dict "root" $ "offline" (or $v.modelCache.offline (include "mla-serve.prefetch" $))) | nindent 8 }}
        - name: MLA_SERVE_STATE_DIR
          value: {{ $stateDir }}
        - name: MLA_SERVE_MANIFEST
          value: {{ $v.sidecar.manifest }}
        {{- with $v.vllm.plugins }}
        - name: VLLM_PLUGINS
          value: {{ join "," . | quote }}
        {{- end }}
        # torch.compile artifacts and JIT kernels persist with the weights: later starts skip them.
        - name: VLLM_CACHE_ROOT
          value: {{ $cache }}/vllm
        - name: TRITON_CACHE_DIR
          value: {{ $cache }}/triton
        - name: CUDA_CACHE_PATH
          value: {{ $cache }}/cuda
        - name: VLLM_NO_USAGE_STATS
          value: "1"
        - name: DO_NOT_TRACK
          value: "1"
        {{- if $multi }}
        - name: POD_IP
          valueFrom:
            fieldRef:
              fieldPath: status.podIP
        {{- end }}
        {{- if $v.vllm.apiKey.secretName }}
        {{- include "mla-serve.apiKeyEnv" (dict "root" $ "name" "VLLM_API_KEY") | nindent 8 }}
        {{- end }}
        {{- with $v.vllm.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      # Stop vLLM only after the sidecar has drained: it finishes requests relayed to vLLM.
      lifecycle:
        preStop:
          exec:
            command: ["sleep", "{{ add (int $v.sidecar.drain.delaySeconds) (int $v.sidecar.drain.timeoutSeconds) }}"]
      {{- if eq $role "leader" }}
      ports:
        - name: vllm-http
          containerPort: {{ $v.vllm.port }}
          protocol: TCP
      # Weight loading + torch.compile + CUDA graph capture: {{ include "mla-serve.startupMinutes" $ }} minutes
      # ({{ $v.startup.weightLoadMinutes }} + {{ $v.startup.compileMinutes }} + {{ $v.startup.cudaGraphCaptureMinutes }}); /health refuses connections until the engine serves.
      startupProbe:
        httpGet:
          path: /health
          port: vllm-http
        periodSeconds: {{ $v.startup.periodSeconds }}
        timeoutSeconds: 5
        failureThreshold: {{ $threshold }}
      {{- if $v.probes.engineLiveness }}
      # 503 once the engine process died: restart the container.
      livenessProbe:
        httpGet:
          path: /health
          port: vllm-http
        periodSeconds: {{ $v.probes.liveness.periodSeconds }}
        timeoutSeconds: 5
        failureThreshold: {{ $v.probes.liveness.failureThreshold }}
      {{- end }}
      {{- end }}
      resources:
        {{- $res := deepCopy (default dict $v.vllm.resources) -}}
        {{- $limits := merge (dict $v.gpu.resourceName (int (include "mla-serve.gpusPerPod" $))) (default dict $res.limits) -}}
        {{- $_ := set $res "limits" $limits -}}
        {{- if include "mla-serve.computeDomain" $ }}
        {{- $_ := set $res "claims" (list (dict "name" "compute-domain-channel")) -}}
        {{- end }}
        {{- toYaml $res | nindent 8 }}
      securityContext:
        {{- $sc := deepCopy $v.securityContext -}}
        {{- if and $multi $v.multiNode.ipcLock -}}
        {{- $caps := default dict $sc.capabilities -}}
        {{- $_ := set $caps "add" (list "IPC_LOCK") -}}
        {{- $_ := set $sc "capabilities" $caps -}}
        {{- end }}
        {{- toYaml $sc | nindent 8 }}
      volumeMounts:
        - name: state
          mountPath: {{ $stateDir }}
        - name: shm
          mountPath: /dev/shm
        - name: model-cache
          mountPath: {{ $cache }}
        - name: tmp
          mountPath: /tmp
    - name: sidecar
      image: {{ include "mla-serve.image" $ }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      command: ["mla-serve", "sidecar"]
      args:
        - --vllm-url
        {{- if eq $role "leader" }}
        - http://127.0.0.1:{{ $v.vllm.port }}
        {{- else }}
        # Workers run no API server: readiness follows the group's leader.
        - http://$(LWS_LEADER_ADDRESS):{{ $v.vllm.port }}
        {{- end }}
        - --port
        - {{ $v.sidecar.port | quote }}
        - --admin-port
        - {{ $v.sidecar.adminPort | quote }}
        - --drain-timeout
        - {{ $v.sidecar.drain.timeoutSeconds | quote }}
        - --body-deadline
        - {{ $v.sidecar.deadlines.requestBodySeconds | quote }}
        - --response-deadline
        - {{ $v.sidecar.deadlines.responseSeconds | quote }}
        - --write-timeout
        - {{ $v.sidecar.deadlines.clientWriteSeconds | quote }}
        {{- with $v.sidecar.extraRoutes }}
        - --extra-routes
        - {{ join "," . | quote }}
        {{- end }}
        {{- with $v.sidecar.trustedProxies }}
        - --trusted-proxies
        - {{ join "," . | quote }}
        {{- end }}
        - --state-dir
        - {{ $stateDir }}
        - --manifest
        - {{ $v.sidecar.manifest }}
        # Readiness requires this name in vLLM's /v1/models.
        - --model
        - {{ include "mla-serve.servedModelName" $ | quote }}
        {{- if and $v.sidecar.canary.enabled (eq $role "leader") }}
        - --canary-prompt-file
        - /etc/mla-serve/canary/prompt.txt
        - --canary-interval
        - {{ $v.sidecar.canary.intervalSeconds | quote }}
        - --canary-concurrency
        - {{ $v.sidecar.canary.concurrency | quote }}
        - --canary-max-tokens
        - {{ $v.sidecar.canary.maxTokens | quote }}
        {{- end }}
        {{- $guard := $v.sidecar.loopGuard }}
        - --loop-action
        - {{ $guard.action | quote }}
        {{- with $guard.modelActions }}
        - --loop-model-actions
        - {{ include "mla-serve.loopModelActions" . | quote }}
        {{- end }}
        - --loop-min-repeats
        - {{ $guard.minRepeats | quote }}
        - --loop-window-chars
        - {{ $guard.windowChars | quote }}
        - --loop-min-chars
        - {{ $guard.minChars | quote }}
        {{- $rd := $guard.vllmDefaults.repetitionDetection }}
        {{- if gt (int $rd.maxPatternSize) 0 }}
        - --default-repetition-detection
        - {{ dict "max_pattern_size" (int $rd.maxPatternSize) "min_pattern_size" (int $rd.minPatternSize) "min_count" (int $rd.minCount) | toJson | quote }}
        {{- end }}
        {{- if not (kindIs "invalid" $guard.vllmDefaults.thinkingTokenBudget) }}
        - --default-thinking-token-budget
        - {{ $guard.vllmDefaults.thinkingTokenBudget | int | quote }}
        {{- end }}
      env:
        - name: MLA_SERVE_STATE_DIR
          value: {{ $stateDir }}
        - name: MLA_SERVE_MANIFEST
          value: {{ $v.sidecar.manifest }}
        - name: HOME
          value: /tmp
        {{- if $v.vllm.apiKey.secretName }}
        {{- include "mla-serve.apiKeyEnv" (dict "root" $ "name" "MLA_SERVE_VLLM_API_KEY") | nindent 8 }}
        {{- end }}
        {{- with $v.sidecar.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        # The OpenAI pass-through (the Service's target).
        - name: sidecar-http
          containerPort: {{ $v.sidecar.port }}
          protocol: TCP
        # Probes, /status and /metrics: never behind the Service.
        - name: sidecar-admin
          containerPort: {{ $v.sidecar.adminPort }}
          protocol: TCP
      # Keep serving while the endpoints controller takes the pod out of the Service; on
      # SIGTERM the sidecar then stops accepting and drains (--drain-timeout).
      lifecycle:
        preStop:
          exec:
            command: ["sleep", "{{ $v.sidecar.drain.delaySeconds }}"]
      # Same budget as the engine: the sidecar may report "not started" until vLLM serves.
      startupProbe:
        httpGet:
          path: /startupz
          port: sidecar-admin
        periodSeconds: {{ $v.startup.periodSeconds }}
        timeoutSeconds: 5
        failureThreshold: {{ $threshold }}
      # Ready only when vLLM /health is 200, the model is listed and the fix manifest verifies.
      readinessProbe:
        httpGet:
          path: /readyz
          port: sidecar-admin
        periodSeconds: {{ $v.probes.readiness.periodSeconds }}
        timeoutSeconds: 5
        failureThreshold: {{ $v.probes.readiness.failureThreshold }}
      livenessProbe:
        httpGet:
          path: /livez
          port: sidecar-admin
        periodSeconds: {{ $v.probes.liveness.periodSeconds }}
        timeoutSeconds: 5
        failureThreshold: {{ $v.probes.liveness.failureThreshold }}
      resources:
        {{- toYaml $v.sidecar.resources | nindent 8 }}
      securityContext:
        {{- toYaml $v.securityContext | nindent 8 }}
      volumeMounts:
        - name: state
          mountPath: {{ $stateDir }}
          readOnly: true
        - name: tmp
          mountPath: /tmp
        {{- if and $v.sidecar.canary.enabled (eq $role "leader") }}
        - name: canary
          mountPath: /etc/mla-serve/canary
          readOnly: true
        {{- end }}
  volumes:
    # Per-rank engine state: written by the engine plugin, read by the sidecar.
    - name: state
      emptyDir:
        sizeLimit: 64Mi
    - name: shm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $v.shm.sizeLimit }}
    - name: tmp
      emptyDir:
        sizeLimit: 32Gi
    {{- if and $v.sidecar.canary.enabled (eq $role "leader") }}
    - name: canary
      configMap:
        name: {{ include "mla-serve.fullname" $ }}-canary
    {{- end }}
    - name: model-cache
      {{- if $v.modelCache.enabled }}
      persistentVolumeClaim:
        claimName: {{ include "mla-serve.modelCacheClaim" $ }}
      {{- else }}
      emptyDir: {}
      {{- end }}
{{- end -}}

{{/* vLLM's API key from vllm.apiKey's Secret, as env `name`. Call with (dict "root" $ "name" NAME). */}}
{{- define "mla-serve.apiKeyEnv" -}}
{{- $v := .root.Values -}}
{{- with $v.vllm.apiKey.secretName }}
- name: {{ $.name }}
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $v.vllm.apiKey.secretKey }}
{{- end }}
{{- end -}}

{{/* Hugging Face environment. Call with (dict "root" $ "offline" bool). */}}
{{- define "mla-serve.hfEnv" -}}
{{- $v := .root.Values -}}
- name: HF_HOME
  value: {{ $v.modelCache.mountPath }}/huggingface
{{- if .offline }}
- name: HF_HUB_OFFLINE
  value: "1"
{{- end }}
{{- with $v.hfToken.secretName }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $v.hfToken.secretKey }}
{{- end }}
# Arbitrary UIDs have no passwd entry: getpass.getuser() (torch inductor) reads these first.
- name: HOME
  value: /tmp
- name: USER
  value: mla-serve
- name: LOGNAME
  value: mla-serve
{{- end -}}
