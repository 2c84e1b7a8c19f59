#!/usr/bin/env bash
# The peer-parity tier's environment (tests/peer/, docs/testing.md): verl's own
# verl/trainer/ppo/core_algos.py and rollout_corr_helper.py at one pinned release, run beside rljob's
# losses on the same tensors. verl is never in the images nor in the trainer's dependencies: it lives
# in .venv-verl/ (ignored), installed --no-deps from trainer_image/locks/peer-verl.txt (hash-checked)
# with only the few packages importing core_algos needs (verl's own pins would bring vLLM-era
# transformers, Ray, wandb ...). torch, numpy and the rest come from .venv: a site-packages .pth adds
# .venv's site-packages after .venv-verl's own (a venv cannot inherit another venv's packages with
# --system-site-packages), so both sides run the same torch.
#   scripts/peer_env.sh          create or refresh .venv-verl/ (idempotent; `make setup` runs it)
#   scripts/peer_env.sh --lock   regenerate the lock (resolution stops at LOCK_DATE, as scripts/lock.sh)
#   scripts/peer_env.sh --check  fail when the committed lock differs from a fresh one
set -euo pipefail
cd "$(dirname "$0")/.."

UV=${UV:-.venv/bin/uv}
LOCK=trainer_image/locks/peer-verl.txt
VENV=.venv-verl
LOCK_DATE=${LOCK_DATE:-2026-12-02T00:00:00Z}
# verl, then what `import verl.trainer.ppo.core_algos` needs that .venv lacks: tensordict (verl's
# protocol; verl pins >=0.8,<=0.10,!=0.9.0) and its pyvers/orjson, omegaconf (verl's configs) and its
# antlr4 runtime (omegaconf's grammar pins 4.9.*), codetiming.
REQUIREMENTS=(
  "verl==0.9.1"
  "tensordict==0.10.0"
  "pyvers"
  "orjson"
  "omegaconf"
  "antlr4-python3-runtime==4.9.3"
  "codetiming"
)

if [ -z "${SSL_CERT_FILE:-}" ] && [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  export SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
fi

compile() {  # compile OUTPUT: the lock of REQUIREMENTS alone (--no-deps), with hashes
  printf '%s\n' "${REQUIREMENTS[@]}" | "$UV" pip compile --quiet --no-config --no-deps --generate-hashes \
    --exclude-newer "$LOCK_DATE" --custom-compile-command "scripts/peer_env.sh --lock" \
    --python-version 3.11 --python-platform x86_64-manylinux_2_28 -o "$1" -
}

case "${1:-}" in
  --lock)
    compile "$LOCK"
    exit 0
    ;;
  --check)
    fresh=$(mktemp)
    trap 'rm -f "$fresh"' EXIT
    cp "$LOCK" "$fresh"
    compile "$fresh"
    sed -i "s#$fresh#$LOCK#" "$fresh"
    if ! diff -q "$LOCK" "$fresh" >/dev/null; then
      echo "peer_env: $LOCK is stale: run scripts/peer_env.sh --lock" >&2
      exit 1
    fi
    exit 0
    ;;
  "") ;;
  *)
    echo "usage: scripts/peer_env.sh [--lock|--check]" >&2
    exit 2
    ;;
esac

# Keyed by the lock, this script and where .venv's packages are (the .pth names that folder).
venv_site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
stamp=$VENV/.rljob-installed
want=$( (cat "$LOCK" "$0"; echo "$venv_site") | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "==> installing $LOCK into $VENV (verl's own code for the peer-parity tier, --no-deps)" >&2
rm -rf "$VENV"
"$UV" venv --quiet --python "$(.venv/bin/python -c 'import sys; print(sys.executable)')" "$VENV"
"$UV" pip install --quiet --python "$VENV/bin/python" --require-hashes --no-deps --compile-bytecode -r "$LOCK"
own_site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# addsitedir (not a bare path) so .venv's own .pth files (its editable installs) are read too.
echo "import site; site.addsitedir('$venv_site')" >"$own_site/zz_rljob_venv.pth"
"$VENV/bin/python" -c 'import verl.trainer.ppo.core_algos, verl.trainer.ppo.rollout_corr_helper' || {
  echo "peer_env: verl does not import in $VENV (a package .venv lost, or torch moved): see above" >&2
  exit 1
}
echo "$want" >"$stamp"
