{{/* Names and labels */}}
{{- define "mla-serve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "mla-serve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "mla-serve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mla-serve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Pods that serve: the Deployment's or the LeaderWorkerSet's (never the test pod). */}}
{{- define "mla-serve.serverSelectorLabels" -}}
{{ include "mla-serve.selectorLabels" . }}
app.kubernetes.io/component: server
{{- end -}}

{{- define "mla-serve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "mla-serve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: mla-serve
{{- with .Values.profile }}
mla-serve.io/profile: {{ . }}
{{- end }}
{{- end -}}

{{- define "mla-serve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "mla-serve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "mla-serve.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "mla-serve.servedModelName" -}}
{{- default .Values.model.name .Values.vllm.servedModelName -}}
{{- end -}}

{{/* Layout: everything below derives from .Values.parallelism and .Values.gpu.perNode. */}}
{{- define "mla-serve.world" -}}
{{- $p := .Values.parallelism -}}
{{- mul (int $p.tensor) (int $p.prefillContext) (int $p.pipeline) (int $p.data) -}}
{{- end -}}

{{- define "mla-serve.nodes" -}}
{{- $world := int (include "mla-serve.world" .) -}}
{{- $perNode := int .Values.gpu.perNode -}}
{{- if le $world $perNode -}}1{{- else -}}{{ div $world $perNode }}{{- end -}}
{{- end -}}

{{- define "mla-serve.gpusPerPod" -}}
{{- $world := int (include "mla-serve.world" .) -}}
{{- min $world (int .Values.gpu.perNode) -}}
{{- end -}}

{{- define "mla-serve.multiNode" -}}
{{- if gt (int (include "mla-serve.nodes" .)) 1 -}}true{{- end -}}
{{- end -}}

{{- define "mla-serve.computeDomain" -}}
{{- if and (include "mla-serve.multiNode" .) .Values.multiNode.computeDomain.enabled -}}true{{- end -}}
{{- end -}}

{{/* The CUDA graph mode the engine is asked to run: what the mismatch alert expects. */}}
{{- define "mla-serve.cudagraphIntent" -}}
{{- if .Values.vllm.enforceEager -}}NONE{{- else -}}{{ .Values.vllm.cudagraphMode }}{{- end -}}
{{- end -}}

{{- define "mla-serve.apiPortName" -}}
{{- if .Values.sidecar.passthrough -}}sidecar-http{{- else -}}vllm-http{{- end -}}
{{- end -}}

{{- define "mla-serve.apiPort" -}}
{{- if .Values.sidecar.passthrough -}}{{ .Values.sidecar.port }}{{- else -}}{{ .Values.vllm.port }}{{- end -}}
{{- end -}}

{{- define "mla-serve.startupMinutes" -}}
{{- $s := .Values.startup -}}
{{- add (int $s.weightLoadMinutes) (int $s.compileMinutes) (int $s.cudaGraphCaptureMinutes) -}}
{{- end -}}

{{/* Probe attempts covering the start-up budget (at least one). */}}
{{- define "mla-serve.startupFailureThreshold" -}}
{{- $seconds := mul (int (include "mla-serve.startupMinutes" .)) 60 -}}
{{- $period := int .Values.startup.periodSeconds -}}
{{- max 1 (div (add $seconds (sub $period 1)) $period) -}}
{{- end -}}

{{/* A Hugging Face repo id (fetched into the cache) rather than a path in the pod. */}}
{{- define "mla-serve.modelFromHub" -}}
{{- if not (hasPrefix "/" .Values.model.name) -}}true{{- end -}}
{{- end -}}

{{- define "mla-serve.prefetch" -}}
{{- if and .Values.modelCache.prefetch (include "mla-serve.modelFromHub" .) -}}true{{- end -}}
{{- end -}}

{{- define "mla-serve.modelCacheClaim" -}}
{{- default (printf "%s-model-cache" (include "mla-serve.fullname" .)) .Values.modelCache.existingClaim -}}
{{- end -}}

{{/*
The --attention-backend the pod passes: vllm.attentionBackend, else FLASH_ATTN_MLA_SPARSE for
GLM-5.3 on Hopper (H100/H200/H800/H20/GH200) where that backend takes the layout (no DCP, a
16-bit KV cache: its supports_combination in vLLM 0.33.0), else "" (vLLM's own choice).
vLLM 0.33.0 (platforms/cuda.py) tries FLASHINFER_MLA_SPARSE_SM90 first on SM90 for GLM-5.3's
NoPE MLA (head size 512) when the image's FlashInfer has the kernel, which it has (0.7.2.post1).
Measured on one H200 with the tiny GLM-5.3 (results/e2e/backends-h200), its decode step takes
1.23x FLASH_ATTN_MLA_SPARSE's at 16 streams and 1.40x at 64 (throughput 0.85x, 0.71x); at one
stream neither is ahead. vllm#56564 reports 36-70 % on the real model. Set
vllm.attentionBackend to keep FlashInfer's.
*/}}
{{- define "mla-serve.attentionBackend" -}}
{{- $v := .Values.vllm -}}
{{- $hopper := regexMatch "^NVIDIA-(H100|H200|H800|H20|GH200)([-_].*)?$" (toString .Values.gpu.product) -}}
{{- $glm53 := regexMatch "(?i)glm-?5[.]3" (toString .Values.model.name) -}}
{{- $sixteenBit := has (toString $v.kvCacheDtype) (list "" "auto" "float16" "bfloat16") -}}
{{- if $v.attentionBackend -}}
{{- $v.attentionBackend -}}
{{- else if and $hopper $glm53 $sixteenBit (eq (int .Values.parallelism.decodeContext) 1) -}}
FLASH_ATTN_MLA_SPARSE
{{- end -}}
{{- end -}}

{{/*
vLLM flags from the typed values and the parallelism block, one list item per flag.
Flags that only multi-node pods need are added by the pod template.
*/}}
{{- define "mla-serve.vllmArgs" -}}
{{- $v := .Values.vllm -}}
{{- $p := .Values.parallelism -}}
- {{ .Values.model.name | quote }}
- --served-model-name={{ include "mla-serve.servedModelName" . }}
{{- with .Values.model.revision }}
- --revision={{ . }}
{{- end }}
{{- if .Values.model.trustRemoteCode }}
- --trust-remote-code
{{- end }}
- --tensor-parallel-size={{ $p.tensor }}
- --prefill-context-parallel-size={{ $p.prefillContext }}
- --decode-context-parallel-size={{ $p.decodeContext }}
- --pipeline-parallel-size={{ $p.pipeline }}
- --data-parallel-size={{ $p.data }}
{{- if $p.expert }}
- --enable-expert-parallel
{{- end }}
- --gpu-memory-utilization={{ $v.gpuMemoryUtilization }}
{{- with $v.maxModelLen }}
- --max-model-len={{ int . }}
{{- end }}
{{- with $v.maxNumBatchedTokens }}
- --max-num-batched-tokens={{ int . }}
{{- end }}
{{- with $v.maxNumSeqs }}
- --max-num-seqs={{ int . }}
{{- end }}
{{- with $v.maxCudagraphCaptureSize }}
- --max-cudagraph-capture-size={{ int . }}
{{- end }}
{{- with $v.kvCacheDtype }}
- --kv-cache-dtype={{ . }}
{{- end }}
{{- with include "mla-serve.attentionBackend" . }}
- --attention-backend={{ . }}
{{- end }}
{{- with $v.dcpCommBackend }}
- --dcp-comm-backend={{ . }}
{{- end }}
{{- if $v.enforceEager }}
- --enforce-eager
{{- else }}
- {{ printf "--compilation-config={\"cudagraph_mode\": \"%s\"}" $v.cudagraphMode | quote }}
{{- end }}
{{- if eq (toString $v.enablePrefixCaching) "true" }}
- --enable-prefix-caching
{{- else if eq (toString $v.enablePrefixCaching) "false" }}
- --no-enable-prefix-caching
{{- end }}
{{- with $v.reasoningParser }}
- --reasoning-parser={{ . }}
{{- end }}
{{- with $v.toolCallParser }}
- --enable-auto-tool-choice
- --tool-call-parser={{ . }}
{{- end }}
{{- with $v.dtype }}
- --dtype={{ . }}
{{- end }}
{{- with $v.quantization }}
- --quantization={{ . }}
{{- end }}
{{- with $v.disableAccessLogForEndpoints }}
- --disable-access-log-for-endpoints={{ . }}
{{- end }}
{{- range $v.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/*
The vLLM flags the typed values own (flag: the value that sets it): vllm.extraArgs may not
repeat them. Add a flag here when mla-serve.vllmArgs above gains one.
*/}}
{{- define "mla-serve.ownedFlags" -}}
"--tensor-parallel-size": parallelism.tensor
"-tp": parallelism.tensor
"--prefill-context-parallel-size": parallelism.prefillContext
"-pcp": parallelism.prefillContext
"--decode-context-parallel-size": parallelism.decodeContext
"-dcp": parallelism.decodeContext
"--pipeline-parallel-size": parallelism.pipeline
"-pp": parallelism.pipeline
"--data-parallel-size": parallelism.data
"-dp": parallelism.data
"--enable-expert-parallel": parallelism.expert
"-ep": parallelism.expert
"--nnodes": parallelism (derived)
"--node-rank": parallelism (derived)
"--master-addr": the chart (multi-node)
"--master-port": multiNode.masterPort
"--headless": the chart (multi-node)
"--host": the chart
"--port": vllm.port
"--served-model-name": model.servedModelName
"--revision": model.revision
"--trust-remote-code": model.trustRemoteCode
"--gpu-memory-utilization": vllm.gpuMemoryUtilization
"--max-model-len": vllm.maxModelLen
"--max-num-batched-tokens": vllm.maxNumBatchedTokens
"--max-num-seqs": vllm.maxNumSeqs
"--max-cudagraph-capture-size": vllm.maxCudagraphCaptureSize
"--kv-cache-dtype": vllm.kvCacheDtype
"--attention-backend": vllm.attentionBackend
"--enforce-eager": vllm.enforceEager
"--dcp-comm-backend": vllm.dcpCommBackend
"--compilation-config": vllm.cudagraphMode
"-cc.cudagraph_mode": vllm.cudagraphMode
"--compilation-config.cudagraph_mode": vllm.cudagraphMode
"--enable-prefix-caching": vllm.enablePrefixCaching
"--no-enable-prefix-caching": vllm.enablePrefixCaching
"--reasoning-parser": vllm.reasoningParser
"--tool-call-parser": vllm.toolCallParser
"--enable-auto-tool-choice": vllm.toolCallParser
"--dtype": vllm.dtype
"--quantization": vllm.quantization
"--disable-access-log-for-endpoints": vllm.disableAccessLogForEndpoints
{{- end -}}

{{/* sidecar.loopGuard.modelActions as the sidecar's --loop-model-actions: MODEL=ACTION,… */}}
{{- define "mla-serve.loopModelActions" -}}
{{- $items := list -}}
{{- range $model, $action := . -}}
{{- $items = append $items (printf "%s=%s" $model $action) -}}
{{- end -}}
{{- join "," $items -}}
{{- end -}}
