{{/*
Every scraped series carries the release (mla_serve_release), the profile and the pod's role;
the alert rules select on mla_serve_release so two releases never share an alert.
*/}}
{{- define "mla-serve.scrapeRelabelings" -}}
relabelings:
  - sourceLabels: [__meta_kubernetes_pod_label_app_kubernetes_io_instance]
    targetLabel: mla_serve_release
  - sourceLabels: [__meta_kubernetes_pod_label_mla_serve_io_profile]
    targetLabel: mla_serve_profile
  - sourceLabels: [__meta_kubernetes_pod_label_mla_serve_io_role]
    targetLabel: mla_serve_role
{{- end -}}

{{- define "mla-serve.ruleSelector" -}}
namespace="{{ .Release.Namespace }}", mla_serve_release="{{ .Release.Name }}"
{{- end -}}
