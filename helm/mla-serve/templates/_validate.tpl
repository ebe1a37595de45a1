{{/*
Checks across values. values.schema.json (generated from values.yaml) types each value on its
own; every rule that involves several values lives here, once: the parallel layout (the DCP rule
is vLLM's ParallelConfig rule and mla-serve plan's, tests/helm/test_helm_vllm_args.py checks the
three agree over a grid of layouts), ports, the drain, the cache's access modes, extraArgs.
Helm runs these on every install, upgrade and template, --skip-schema-validation or not.
*/}}
{{- define "mla-serve.validate" -}}
{{- $p := .Values.parallelism -}}
{{- $world := int (include "mla-serve.world" .) -}}
{{- $perNode := int .Values.gpu.perNode -}}
{{- $group := mul (int $p.tensor) (int $p.prefillContext) -}}
{{- $layout := printf "TP%d x PCP%d x PP%d x DP%d = %d GPUs" (int $p.tensor) (int $p.prefillContext) (int $p.pipeline) (int $p.data) $world -}}
{{- if and (gt $world $perNode) (ne (mod $world $perNode) 0) -}}
{{- fail (printf "parallelism: %s does not split evenly over nodes of gpu.perNode=%d GPUs; vLLM needs the same number of GPUs on every node (--nnodes must divide the world size)" $layout $perNode) -}}
{{- end -}}
{{- if and (gt $group $perNode) (not .Values.multiNode.computeDomain.enabled) -}}
{{- fail (printf "parallelism: the TP x PCP group (%d GPUs) does not fit one node of gpu.perNode=%d GPUs; its per-layer collectives need NVLink: reduce it, or enable multiNode.computeDomain on an NVL72 rack" $group $perNode) -}}
{{- end -}}
{{- $dcp := int $p.decodeContext -}}
{{- if eq (int $p.prefillContext) 1 -}}
{{- if ne (mod (int $p.tensor) $dcp) 0 -}}
{{- fail (printf "parallelism: decodeContext=%d must divide tensor=%d (without PCP, DCP reuses the TP ranks)" $dcp (int $p.tensor)) -}}
{{- end -}}
{{- else if not (has $dcp (list 1 (int $p.prefillContext) (int $group))) -}}
{{- fail (printf "parallelism: with prefillContext=%d, decodeContext must be one of %s (off, the PCP axis, or TP x PCP); got %d" (int $p.prefillContext) (list 1 (int $p.prefillContext) (int $group) | uniq | join ", ") $dcp) -}}
{{- end -}}
{{- if and (gt (int $p.prefillContext) 1) (gt $dcp 1) (eq .Values.vllm.dcpCommBackend "a2a") -}}
{{- fail (printf "vllm.dcpCommBackend: a2a where PCP and DCP meet (prefillContext=%d, decodeContext=%d); vLLM 0.33.0's PCP manager needs ag_rs" (int $p.prefillContext) $dcp) -}}
{{- end -}}
{{- if and .Values.vllm.enforceEager (ne .Values.vllm.cudagraphMode "NONE") -}}
{{- fail (printf "vllm.enforceEager captures no CUDA graph: set vllm.cudagraphMode to NONE, not %s (it is the mode MlaServeCudaGraphModeMismatch expects)" .Values.vllm.cudagraphMode) -}}
{{- end -}}
{{- $guardDefaults := .Values.sidecar.loopGuard.vllmDefaults -}}
{{- if and (not (kindIs "invalid" $guardDefaults.thinkingTokenBudget)) (not .Values.vllm.reasoningParser) -}}
{{- fail "sidecar.loopGuard.vllmDefaults.thinkingTokenBudget needs vllm.reasoningParser: vLLM refuses thinking_token_budget without a reasoning parser" -}}
{{- end -}}
{{- $rd := $guardDefaults.repetitionDetection -}}
{{- if and (gt (int $rd.maxPatternSize) 0) (or (lt (int $rd.minCount) 2) (gt (int $rd.minPatternSize) (int $rd.maxPatternSize))) -}}
{{- fail (printf "sidecar.loopGuard.vllmDefaults.repetitionDetection: vLLM needs minCount >= 2 and minPatternSize <= maxPatternSize (got minCount=%d, minPatternSize=%d, maxPatternSize=%d)" (int $rd.minCount) (int $rd.minPatternSize) (int $rd.maxPatternSize)) -}}
{{- end -}}
{{- if lt (int .Values.sidecar.loopGuard.windowChars) (int .Values.sidecar.loopGuard.minChars) -}}
{{- fail "sidecar.loopGuard.windowChars must be at least sidecar.loopGuard.minChars" -}}
{{- end -}}
{{- if eq (int .Values.sidecar.port) (int .Values.vllm.port) -}}
{{- fail (printf "sidecar.port and vllm.port are both %d; they share the pod's network namespace" (int .Values.vllm.port)) -}}
{{- end -}}
{{- if has (int .Values.sidecar.adminPort) (list (int .Values.sidecar.port) (int .Values.vllm.port)) -}}
{{- fail (printf "sidecar.adminPort %d is already taken by sidecar.port or vllm.port; the admin port must be its own, or /status and /metrics reach the Service" (int .Values.sidecar.adminPort)) -}}
{{- end -}}
{{- $drain := add (int .Values.sidecar.drain.delaySeconds) (int .Values.sidecar.drain.timeoutSeconds) 10 -}}
{{- if lt (int .Values.terminationGracePeriodSeconds) (int $drain) -}}
{{- fail (printf "terminationGracePeriodSeconds=%d is shorter than the drain (sidecar.drain.delaySeconds + timeoutSeconds + 10 s for vLLM to stop = %d): requests in flight would be killed" (int .Values.terminationGracePeriodSeconds) (int $drain)) -}}
{{- end -}}
{{- $owned := include "mla-serve.ownedFlags" . | fromYaml -}}
{{- range .Values.vllm.extraArgs -}}
{{- $flag := regexReplaceAll "=.*$" . "" -}}
{{- if hasKey $owned $flag -}}
{{- fail (printf "vllm.extraArgs: %s is set by %s; set it there, not in extraArgs" $flag (get $owned $flag)) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.modelCache.enabled (not .Values.modelCache.existingClaim) -}}
{{- $shared := or (has "ReadWriteMany" .Values.modelCache.create.accessModes) (has "ReadOnlyMany" .Values.modelCache.create.accessModes) -}}
{{- if and (not $shared) (or (include "mla-serve.multiNode" .) (gt (int .Values.replicaCount) 1)) -}}
{{- fail (printf "modelCache.create.accessModes %v cannot be mounted by %d nodes x %d replicas; use ReadWriteMany or modelCache.existingClaim" .Values.modelCache.create.accessModes (int (include "mla-serve.nodes" .)) (int .Values.replicaCount)) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.monitoring.podMonitor.enabled .Values.monitoring.serviceMonitor.enabled -}}
{{- fail "monitoring.podMonitor and monitoring.serviceMonitor are both enabled: every target would be scraped twice; keep one" -}}
{{- end -}}
{{- if and (eq .Values.strategy.type "Recreate") .Values.strategy.rollingUpdate -}}
{{- fail "strategy.rollingUpdate only applies to strategy.type RollingUpdate" -}}
{{- end -}}
{{- if and .Values.modelCache.offline (not .Values.modelCache.enabled) -}}
{{- fail "modelCache.offline needs modelCache.enabled: an emptyDir cache is empty at every start" -}}
{{- end -}}
{{- end -}}
