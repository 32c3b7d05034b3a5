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
{{- if $v.adminPort }}
{{- $args := list }}
{{- $found := false }}
{{- range $a := $c.args }}
{{- if regexMatch "^--admin=.*:[0-9]+$" $a }}
{{- $a = regexReplaceAll ":[0-9]+$" $a (printf ":%d" (int $v.adminPort)) }}
{{- $found = true }}
{{- end }}
{{- $args = append $args $a }}
{{- end }}
{{- if not $found }}
{{- fail "adminPort: the agent container has no --admin=HOST:PORT argument to set" }}
{{- end }}
{{- $_ := set $c "args" $args }}
{{- end }}
{{- if and $v.egress.enabled $v.egress.internalCIDRs }}
{{- $found := false }}
{{- range $e := $c.env }}
{{- if eq $e.name "MESHDNS_EGRESS_INTERNAL_CIDRS" }}
{{- $_ := set $e "value" (join "," $v.egress.internalCIDRs) }}
{{- $found = true }}
{{- end }}
{{- end }}
{{- if not $found }}
{{- fail "egress.internalCIDRs: the agent container has no MESHDNS_EGRESS_INTERNAL_CIDRS env (components/egress) to set" }}
{{- end }}
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
{{- if $v.tolerations }}
{{- $_ := set $spec "tolerations" (deepCopy $v.tolerations) }}
{{- end }}
{{- if $v.priorityClassName }}
{{- $_ := set $spec "priorityClassName" $v.priorityClassName }}
{{- end }}
{{- if $v.imagePullSecrets }}
{{- $_ := set $spec "imagePullSecrets" (deepCopy $v.imagePullSecrets) }}
{{- end }}
{{- if $v.updateStrategy }}
{{- $_ := set .o.spec "updateStrategy" (mergeOverwrite (deepCopy (default (dict) .o.spec.updateStrategy)) (deepCopy $v.updateStrategy)) }}
{{- end }}
{{- if $v.cgroupPath }}
{{- $found := false }}
{{- range $vol := $spec.volumes }}
{{- if and (eq $vol.name "cgroup") $vol.hostPath }}
{{- $_ := set $vol.hostPath "path" $v.cgroupPath }}
{{- $found = true }}
{{- end }}
{{- end }}
{{- if not $found }}
{{- fail "cgroupPath: the DaemonSet has no hostPath volume named cgroup to set" }}
{{- end }}
{{- end }}
{{- if $v.adminPort }}
{{- if hasKey $annotations "prometheus.io/port" }}
{{- $_ := set $annotations "prometheus.io/port" (toString $v.adminPort) }}
{{- end }}
{{- end }}
{{- if $v.podAnnotations }}
{{- $annotations = mergeOverwrite $annotations (deepCopy $v.podAnnotations) }}
{{- end }}
{{- if $v.podLabels }}
{{- $_ := set $tpl.metadata "labels" (mergeOverwrite (deepCopy $v.podLabels) (default (dict) $tpl.metadata.labels)) }}
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
{{- if not (regexMatch "[<>]=?\\s*-?[0-9.eE+]+\\s*$" $r.expr) }}
{{- fail (printf "prometheusRule.thresholds.%s: its expression does not end with a > or < comparison to a number" $r.alert) }}
{{- end }}
{{- $old := trim (regexFind "-?[0-9.eE+]+\\s*$" $r.expr) }}
{{- $new := toString (index $p.thresholds $r.alert) }}
{{- $_ := set $r "expr" (regexReplaceAll "-?[0-9.eE+]+\\s*$" $r.expr $new) }}
{{- include "meshdns.describe" (dict "r" $r "re" (printf "(^|[^0-9.])%s([^0-9.]|$)" (regexQuoteMeta $old)) "to" (printf "${1}%s${2}" $new)) }}
{{- end }}
{{- if hasKey (default (dict) $p.for) $r.alert }}
{{- $new := index $p.for $r.alert }}
{{- include "meshdns.describe" (dict "r" $r "re" (printf "\\bfor %s\\b" (regexQuoteMeta (toString $r.for))) "to" (printf "for %s" $new)) }}
{{- $_ := set $r "for" $new }}
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

{{/* meshdns.describe: replaces .re with .to in rule .r's description, failing when it is not there (the description must state its for and threshold). */}}
{{- define "meshdns.describe" -}}
{{- $d := dig "annotations" "description" "" .r }}
{{- if not (regexMatch .re $d) }}
{{- fail (printf "alert %s: its description does not state what the values change (%s)" .r.alert .re) }}
{{- end }}
{{- $_ := set .r.annotations "description" (regexReplaceAll .re $d .to) }}
{{- end }}

{{/* meshdns.smp: merges the strategic merge patch .src into the object .dst in place, as kustomize does for the fields the components patch: maps merge, lists of objects merge by their key (name; mountPath for volumeMounts), the patch's items first, and honour "$patch: delete"; other lists are replaced. */}}
{{- define "meshdns.smp" -}}
{{- $keys := dict "containers" "name" "initContainers" "name" "env" "name" "volumes" "name" "volumeMounts" "mountPath" "imagePullSecrets" "name" "ports" "containerPort" }}
{{- range $k, $sv := .src }}
{{- $dv := index $.dst $k }}
{{- if and (kindIs "map" $sv) (kindIs "map" $dv) }}
{{- include "meshdns.smp" (dict "dst" $dv "src" $sv) }}
{{- else if and (kindIs "slice" $sv) (kindIs "slice" $dv) (hasKey $keys $k) }}
{{- $key := index $keys $k }}
{{- $out := list }}
{{- /* kustomize puts the patch's items first (in its order), then the others. */}}
{{- range $s := $sv }}
{{- if ne (toString (index $s "$patch")) "delete" }}
{{- $merged := false }}
{{- range $d := $dv }}
{{- if eq (toString (index $s $key)) (toString (index $d $key)) }}
{{- include "meshdns.smp" (dict "dst" $d "src" $s) }}
{{- $out = append $out $d }}
{{- $merged = true }}
{{- end }}
{{- end }}
{{- if not $merged }}
{{- $out = append $out (deepCopy $s) }}
{{- end }}
{{- end }}
{{- end }}
{{- range $d := $dv }}
{{- $inPatch := false }}
{{- range $s := $sv }}
{{- if eq (toString (index $s $key)) (toString (index $d $key)) }}
{{- $inPatch = true }}
{{- end }}
{{- end }}
{{- if not $inPatch }}
{{- $out = append $out $d }}
{{- end }}
{{- end }}
{{- $_ := set $.dst $k $out }}
{{- else }}
{{- $_ := set $.dst $k (deepCopy $sv) }}
{{- end }}
{{- end }}
{{- end }}

{{/* meshdns.jsonpatch: applies the JSON patch (RFC 6902) operations .ops to the object .o in place: add (to a map, or "-" to the end of a list), replace and remove (in a map). */}}
{{- define "meshdns.jsonpatch" -}}
{{- range $op := .ops }}
{{- $segs := list }}
{{- range (rest (splitList "/" $op.path)) }}
{{- $segs = append $segs (replace "~0" "~" (replace "~1" "/" .)) }}
{{- end }}
{{- $holder := dict "v" $.o }}
{{- $hkey := "v" }}
{{- $cur := $.o }}
{{- range (initial $segs) }}
{{- $holder = $cur }}
{{- $hkey = . }}
{{- if kindIs "slice" $cur }}
{{- $cur = index $cur (atoi .) }}
{{- $hkey = "" }}
{{- else }}
{{- $cur = index $cur . }}
{{- end }}
{{- if kindIs "invalid" $cur }}
{{- fail (printf "JSON patch %s %s: no such path" $op.op $op.path) }}
{{- end }}
{{- end }}
{{- $last := last $segs }}
{{- if and (eq $op.op "add") (kindIs "slice" $cur) (eq $last "-") }}
{{- if eq $hkey "" }}
{{- fail (printf "JSON patch %s %s: a list in a list is not supported" $op.op $op.path) }}
{{- end }}
{{- $_ := set $holder $hkey (append $cur (deepCopy $op.value)) }}
{{- else if and (has $op.op (list "add" "replace")) (kindIs "map" $cur) }}
{{- $_ := set $cur $last (deepCopy $op.value) }}
{{- else if and (eq $op.op "remove") (kindIs "map" $cur) (hasKey $cur $last) }}
{{- $_ := unset $cur $last }}
{{- else }}
{{- fail (printf "JSON patch %s %s: not supported by the chart" $op.op $op.path) }}
{{- end }}
{{- end }}
{{- end }}

{{/* meshdns.component: appends the objects of the kustomize component at .dir to .acc.objs and applies its patches to the objects there, as kustomize does. */}}
{{- define "meshdns.component" -}}
{{- $root := .root }}
{{- $cpath := printf "%s/kustomization.yaml" .dir }}
{{- $ck := fromYaml ($root.Files.Get $cpath) }}
{{- include "meshdns.checkKustomization" (dict "k" $ck "path" $cpath "allowed" (list "apiVersion" "kind" "resources" "patches" "configMapGenerator")) }}
{{- range $ck.resources }}
{{- include "meshdns.load" (dict "root" $root "path" (printf "%s/%s" $.dir .) "acc" $.acc) }}
{{- end }}
{{- range $g := $ck.configMapGenerator }}
{{- if not (dig "options" "disableNameSuffixHash" false $g) }}
{{- fail (printf "%s: the chart makes configMapGenerator %s without a name suffix hash only" $cpath $g.name) }}
{{- end }}
{{- $data := dict }}
{{- range $f := $g.files }}
{{- $_ := set $data (base $f) ($root.Files.Get (printf "%s/%s" $.dir $f)) }}
{{- end }}
{{- $md := dict "name" $g.name "namespace" $g.namespace "labels" (deepCopy (dig "options" "labels" (dict) $g)) }}
{{- $_ := set $.acc "objs" (append $.acc.objs (dict "apiVersion" "v1" "kind" "ConfigMap" "metadata" $md "data" $data)) }}
{{- end }}
{{- range $pt := $ck.patches }}
{{- $matched := false }}
{{- range $o := $.acc.objs }}
{{- if and (eq $o.kind $pt.target.kind) (eq $o.metadata.name $pt.target.name) }}
{{- $matched = true }}
{{- if hasPrefix "- " (trim $pt.patch) }}
{{- include "meshdns.jsonpatch" (dict "o" $o "ops" (fromYamlArray $pt.patch)) }}
{{- else }}
{{- include "meshdns.smp" (dict "dst" $o "src" (omit (fromYaml $pt.patch) "apiVersion" "kind")) }}
{{- end }}
{{- end }}
{{- end }}
{{- if not $matched }}
{{- fail (printf "%s: a patch's target %s/%s matches no object" $cpath $pt.target.kind $pt.target.name) }}
{{- end }}
{{- end }}
{{- end }}
