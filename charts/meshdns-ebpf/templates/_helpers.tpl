{{/*
The chart's source of truth is deploy/kubernetes (files/kubernetes links to it). These
helpers read its kustomization and manifests, apply what the kustomization applies (its
labels and images), then the values. Objects are dicts decoded from the YAML; helpers
change them in place (include returns nothing of use).
*/}}

{{/* meshdns.kustomization: the kustomization at .path, failing on what the chart does not apply. */}}
{{- define "meshdns.checkKustomization" -}}
{{- range $key, $_ := .k }}
{{- if not (has $key $.allowed) }}
{{- fail (printf "%s uses %q, which the chart does not apply: teach charts/meshdns-ebpf/templates to" $.path $key) }}
{{- end }}
{{- end }}
{{- range .k.labels }}
{{- if or .includeSelectors .includeTemplates }}
{{- fail (printf "%s: labels with includeSelectors or includeTemplates are not applied by the chart" $.path) }}
{{- end }}
{{- end }}
{{- end }}

{{/* meshdns.load: appends the objects of the YAML file .path to .acc.objs, with .labels added to each. */}}
{{- define "meshdns.load" -}}
{{- $content := .root.Files.Get .path }}
{{- if not $content }}
{{- fail (printf "%s: missing or empty in the chart" .path) }}
{{- end }}
{{- range $doc := regexSplit "(?m)^---[ \t]*$" $content -1 }}
{{- $o := fromYaml $doc }}
{{- if hasKey $o "Error" }}
{{- fail (printf "%s: %s" $.path $o.Error) }}
{{- end }}
{{- if hasKey $o "kind" }}
{{- if $.labels }}
{{- $_ := set $o.metadata "labels" (mergeOverwrite (default (dict) $o.metadata.labels) (deepCopy $.labels)) }}
{{- end }}
{{- $_ := set $.acc "objs" (append $.acc.objs $o) }}
{{- end }}
{{- end }}
{{- end }}

{{/* meshdns.image: REPOSITORY[:TAG][@DIGEST] for the container image named .name in the kustomization, with the values. */}}
{{- define "meshdns.image" -}}
{{- $repo := default .img.newName .v.repository }}
{{- $tag := default .img.newTag .v.tag }}
{{- if and .v.digest (not .v.tag) }}
{{- $tag = "" }}
{{- end }}
{{- $repo }}{{ if $tag }}:{{ $tag }}{{ end }}{{ if .v.digest }}@{{ .v.digest }}{{ end }}
{{- end }}

{{/* meshdns.apparmorAnnotation: the pre-1.30 annotation value of an appArmorProfile. */}}
{{- define "meshdns.apparmorAnnotation" -}}
{{- if eq .type "Unconfined" }}unconfined
{{- else if eq .type "RuntimeDefault" }}runtime/default
{{- else if eq .type "Localhost" }}localhost/{{ required "appArmorProfile.localhostProfile is required with type Localhost" .localhostProfile }}
{{- else }}{{ fail (printf "appArmorProfile.type %q: want Unconfined, RuntimeDefault or Localhost" .type) }}
{{- end }}
{{- end }}

{{/* meshdns.container: the agent container (.c) with the kustomization's image (.img) and the values (.v). */}}
{{- define "meshdns.container" -}}
{{- $c := .c }}
{{- $v := .v }}
{{- $_ := set $c "image" (include "meshdns.image" (dict "img" .img "v" $v.image)) }}
{{- if $v.image.pullPolicy }}
{{- $_ := set $c "imagePullPolicy" $v.image.pullPolicy }}
{{- end }}
{{- if $v.extraArgs }}
{{- $_ := set $c "args" (concat $c.args $v.extraArgs) }}
{{- end }}
{{- if $v.resources }}
{{- $_ := set $c "resources" (mergeOverwrite (deepCopy (default (dict) $c.resources)) (deepCopy $v.resources)) }}
{{- end }}
{{- if $v.appArmorProfile }}
{{- $_ := set $c.securityContext "appArmorProfile" (deepCopy $v.appArmorProfile) }}
{{- $_ := set .annotations (printf "container.apparmor.security.beta.kubernetes.io/%s" $c.name) (include "meshdns.apparmorAnnotation" $v.appArmorProfile) }}
{{- end }}
{{- if $v.seLinuxOptions }}
{{- $_ := set $c.securityContext "seLinuxOptions" (deepCopy $v.seLinuxOptions) }}
{{- end }}
{{- end }}

{{/* meshdns.daemonset: the agent DaemonSet (.o) with the kustomization's images (.k) and the values (.v). */}}
{{- define "meshdns.daemonset" -}}
{{- $v := .v }}
{{- $tpl := .o.spec.template }}
{{- $spec := $tpl.spec }}
{{- $annotations := default (dict) $tpl.metadata.annotations }}
{{- range $c := $spec.containers }}
{{- range $img := $.k.images }}
{{- if eq $c.image $img.name }}
{{- include "meshdns.container" (dict "c" $c "img" $img "v" $v "annotations" $annotations) }}
{{- end }}
{{- end }}
{{- end }}
{{- if $v.nodeSelector }}
{{- $_ := set $spec "nodeSelector" (mergeOverwrite (default (dict) $spec.nodeSelector) (deepCopy $v.nodeSelector)) }}
{{- end }}
{{- if $v.affinity }}
{{- $_ := set $spec "affinity" (deepCopy $v.affinity) }}
{{- end }}
{{- if $v.image.architectures }}
{{- $found := false }}
{{- range $term := (dig "affinity" "nodeAffinity" "requiredDuringSchedulingIgnoredDuringExecution" "nodeSelectorTerms" (list) $spec) }}
{{- range $e := $term.matchExpressions }}
{{- if eq $e.key "kubernetes.io/arch" }}
{{- $_ := set $e "values" $v.image.architectures }}
{{- $found = true }}
{{- end }}
{{- end }}
{{- end }}
{{- if not $found }}
{{- fail "image.architectures: the DaemonSet's affinity has no required kubernetes.io/arch term to set" }}
{{- end }}
{{- end }}
{{- if kindIs "slice" $v.tolerations }}
{{- $_ := set $spec "tolerations" (deepCopy $v.tolerations) }}
{{- end }}
{{- if $v.priorityClassName }}
{{- $_ := set $spec "priorityClassName" $v.priorityClassName }}
{{- end }}
{{- if $v.serviceMonitor.enabled }}
{{- range $key, $_ := $annotations }}
{{- if hasPrefix "prometheus.io/" $key }}
{{- $_ := unset $annotations $key }}
{{- end }}
{{- end }}
{{- end }}
{{- if $annotations }}
{{- $_ := set $tpl.metadata "annotations" $annotations }}
{{- else }}
{{- $_ := unset $tpl.metadata "annotations" }}
{{- end }}
{{- end }}

{{/* meshdns.prometheusRule: the PrometheusRule (.o) with prometheusRule's labels, thresholds, for and severity (.p). */}}
{{- define "meshdns.prometheusRule" -}}
{{- $p := .p }}
{{- if $p.labels }}
{{- $_ := set .o.metadata "labels" (mergeOverwrite (default (dict) .o.metadata.labels) (deepCopy $p.labels)) }}
{{- end }}
{{- $alerts := list }}
{{- range $g := .o.spec.groups }}
{{- range $r := $g.rules }}
{{- if $r.alert }}
{{- $alerts = append $alerts $r.alert }}
{{- if hasKey (default (dict) $p.thresholds) $r.alert }}
{{- if not (regexMatch "[<>=]=?\\s*-?[0-9.eE+]+\\s*$" $r.expr) }}
{{- fail (printf "prometheusRule.thresholds.%s: its expression does not end with a comparison to a number" $r.alert) }}
{{- end }}
{{- $_ := set $r "expr" (regexReplaceAll "-?[0-9.eE+]+\\s*$" $r.expr (toString (index $p.thresholds $r.alert))) }}
{{- end }}
{{- if hasKey (default (dict) $p.for) $r.alert }}
{{- $_ := set $r "for" (index $p.for $r.alert) }}
{{- end }}
{{- if hasKey (default (dict) $p.severity) $r.alert }}
{{- $_ := set $r "labels" (mergeOverwrite (default (dict) $r.labels) (dict "severity" (index $p.severity $r.alert))) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- range $what := list "thresholds" "for" "severity" }}
{{- range $name, $_ := (default (dict) (index $p $what)) }}
{{- if not (has $name $alerts) }}
{{- fail (printf "prometheusRule.%s.%s: no such alert (the alerts: %s)" $what $name (join ", " $alerts)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
