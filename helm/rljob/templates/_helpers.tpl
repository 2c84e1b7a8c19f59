{{/* Names and labels shared by every template. */}}

{{- define "rljob.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's full name; ClusterRoles are named after it, so two releases never collide. */}}
{{- define "rljob.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "rljob.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "rljob.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "rljob.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rljob.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "rljob.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "rljob.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "rljob.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The watched namespace, or "" for all namespaces. */}}
{{- define "rljob.watchNamespace" -}}
{{- $ns := .Values.watchNamespaces | default list -}}
{{- if gt (len $ns) 1 -}}
{{- fail (printf "watchNamespaces: `rljob operator` watches one namespace or all; got %d (%s). Install one release per namespace, or leave it empty for all namespaces." (len $ns) (join ", " $ns)) -}}
{{- end -}}
{{- if $ns }}{{ first $ns }}{{ end -}}
{{- end -}}

{{/*
The operator's RBAC, derived from what operator/rljob_operator/handlers.py and kopf call (kopf runs
standalone: no peering objects). tests/integration/test_helm_chart.py runs `rljob operator` under
these rules alone and checks that it reconciles an RLJob, and that nothing else is allowed.

Namespaced rules: granted cluster-wide by a ClusterRole, or per watched namespace by a Role.
*/}}
{{- define "rljob.namespacedRules" -}}
# RLJobs: kopf lists and watches them and patches its annotations and finalizer; the TTL after a
# finished job deletes it. `get`: a job the watch has not delivered yet is read once, and every
# job's Role grants `get` on its RLJob, which RBAC escalation prevention lets the operator grant
# only because it holds it itself.
- apiGroups: [rljob.io]
  resources: [rljobs]
  verbs: [get, list, watch, patch, delete]
# Status goes through the status subresource (Kube.patch_status).
- apiGroups: [rljob.io]
  resources: [rljobs/status]
  verbs: [patch]
# Children carry ownerReferences with blockOwnerDeletion (kopf.adopt). Clusters that enable the
# OwnerReferencesPermissionEnforcement admission plugin (e.g. OpenShift) require `update` on the
# owner's finalizers subresource to set it.
- apiGroups: [rljob.io]
  resources: [rljobs/finalizers]
  verbs: [update]
# Pods: watched through a kopf index (no get), created in index order, deleted on restart,
# scale-down and finish. Never patched.
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, create, delete]
# ConfigMaps: `<job>-config` is created and patched when the spec changes; a model config is read
# from a configMapRef (get); telemetry ConfigMaps are watched through a kopf index (list, watch).
# `update` is never called: each job's Role grants `update` on its own `<job>-telemetry`
# (docs/contracts.md §3), and escalation prevention requires the operator to hold it. That is the
# least-privileged choice: the alternative, `escalate` on roles, would let the operator write any
# Role (and with `create` on rolebindings, grant itself anything in the namespace).
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, list, watch, create, patch, update]
# A job's headless Service and ServiceAccount: created once, deleted by the garbage collector
# through their owner reference. `get` when the name is taken: AlreadyExists is success only when
# the object is this job's (its ownerReference), not an earlier RLJob's of the same name.
- apiGroups: [""]
  resources: [services, serviceaccounts]
  verbs: [get, create]
# A job's Role and RoleBinding: created once (`get` as above). Creating them passes RBAC escalation
# prevention because the operator holds every rule the job's Role grants (configmaps
# get/patch/update, rljobs get); no `bind` or `escalate`.
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, create]
# A job's Ray token (docs/security.md): one Secret per job, created once with a random token and
# owned by the RLJob (the garbage collector deletes it). Create only: the operator never reads a
# Secret (the name carries the RLJob's uid, so a name taken is always the job's own), and the pods
# get the token from the kubelet (secretKeyRef), not from the operator.
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
# A job's NetworkPolicy: created once (`get` as for the Service), deleted by the garbage collector.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create]
# PersistentVolumeClaims a job mounts: read once before an attempt's first pod, to report a
# missing claim or one whose access modes the job's pods cannot share (never written).
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [get]
# Native gang scheduling where the apiserver serves scheduling.k8s.io/v1beta1 (Kubernetes 1.37,
# GenericWorkload): a job's PodGroup is created before its pods, read back after an operator
# restart, and replaced (deleted) when the job's minCount changes. Never patched.
- apiGroups: [scheduling.k8s.io]
  resources: [podgroups]
  verbs: [get, create, delete]
# Events on RLJobs (kopf.event / kopf.warn post core/v1 Events; never patched).
- apiGroups: [""]
  resources: [events]
  verbs: [create]
# Kueue: an RLJob labelled kueue.x-k8s.io/queue-name gets Workloads (the core one, one per extra
# engine) before any pod. They are watched (an admission reconciles the job at once), read when the
# watch has not caught up, deleted when an extra engine is released or a pending one is rebuilt for
# a new spec. Harmless without Kueue: nothing is watched while its CRDs are absent.
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads]
  verbs: [get, list, watch, create, delete]
# PodsReady and Finished conditions, server-side applied with our own field managers.
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads/status]
  verbs: [patch]
{{- end -}}

{{/* Cluster-scoped reads, needed in every mode. */}}
{{- define "rljob.clusterRules" -}}
# Nodes: a kopf index of labels, taints and allocatable resources for the capacity check.
- apiGroups: [""]
  resources: [nodes]
  verbs: [list, watch]
# kopf watches CRDs so that the RLJob CRD being installed or upgraded after the operator started is
# noticed without a restart (without it kopf warns and only rescans on restart). Resource
# discovery itself uses /api and /apis, open to every authenticated user.
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
# Kueue: the ResourceFlavors an admission names (their nodeLabels and tolerations go on the pods)
# and the WorkloadPriorityClass of label kueue.x-k8s.io/priority-class (read for its value, or the
# pods' PriorityClass when the Workload's priority comes from spec.trainerPool.priorityClassName).
- apiGroups: [kueue.x-k8s.io]
  resources: [resourceflavors, workloadpriorityclasses]
  verbs: [get]
- apiGroups: [scheduling.k8s.io]
  resources: [priorityclasses]
  verbs: [get]
{{- if include "rljob.watchNamespace" . }}
# With a namespace list kopf lists and watches namespaces to follow them being created and deleted.
# Denied, it retries for about a minute (logging 403 errors) before it falls back to the names as
# given. All-namespaces mode never reads namespaces, so it gets no such rule.
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
{{- end }}
{{- end -}}

{{/* The ConfigMap holding the node-pool defaults (key pools.json). */}}
{{- define "rljob.poolsConfigMap" -}}
{{- printf "%s-pools" (include "rljob.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
