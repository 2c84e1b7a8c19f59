#!/usr/bin/env bash
# Known vulnerabilities in what ships and what the tests run (`make audit`, CI): pip-audit over each
# image lock (trainer_image/locks/cuda.txt, ascend.txt; every package pinned and hashed), the tests'
# MLflow server lock (mlflow-server.txt, .venv-mlflow) and the test environment (.venv).
# --strict: a package pip-audit could not look up fails the audit, so an
# unreachable vulnerability service can never read as "0 vulnerabilities".
# Allowed findings: trainer_image/locks/audit-allow.txt, one `ID  reason it does not apply` a line.
#
# pip-audit needs a vulnerability service: PyPI's per-release JSON (/pypi/<name>/<version>/json) or
# OSV (api.osv.dev). Where neither answers (the development machines here reach only package
# indexes), the audit is NOT RUN: it says so loudly and exits 0, or 1 with RLJOB_REQUIRE_AUDIT=1.
set -euo pipefail
cd "$(dirname "$0")/.."
LOCKS=trainer_image/locks
if [ -z "${SSL_CERT_FILE:-}" ] && [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  export SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
fi

service=$(.venv/bin/python - <<'PY'
import urllib.request
probes = {"pypi": "https://pypi.org/pypi/pip/24.0/json", "osv": "https://api.osv.dev/v1/vulns/PYSEC-2023-228"}
for name, url in probes.items():
    try:
        with urllib.request.urlopen(url, timeout=15) as r:
            if r.status == 200:
                print(name)
                break
    except Exception:
        pass
PY
)
if [ -z "$service" ]; then
  echo "audit: NOT RUN: no vulnerability service reachable (PyPI's per-release JSON and api.osv.dev" \
    "did not answer from this machine); nothing was audited" >&2
  [ "${RLJOB_REQUIRE_AUDIT:-0}" = 1 ] && exit 1
  exit 0
fi

ignores=()
while read -r id _; do
  [ -n "$id" ] && ignores+=(--ignore-vuln "$id")
done < <(grep -v -E '^\s*(#|$)' "$LOCKS/audit-allow.txt" || true)

rc=0
for lock in "$LOCKS/cuda.txt" "$LOCKS/ascend.txt" "$LOCKS/mlflow-server.txt"; do
  echo "==> pip-audit $lock ($service)" >&2
  .venv/bin/pip-audit --strict --vulnerability-service "$service" --disable-pip --require-hashes \
    -r "$lock" ${ignores[@]+"${ignores[@]}"} || rc=1
done
echo "==> pip-audit .venv (the test environment)" >&2
.venv/bin/pip-audit --strict --vulnerability-service "$service" --skip-editable \
  --path "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
  ${ignores[@]+"${ignores[@]}"} || rc=1
exit $rc
