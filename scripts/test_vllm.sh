#!/usr/bin/env bash
# The vLLM conformance tier (`make test-vllm`): rljob's vLLM calls checked against the real releases
# the images ship, imported on this CPU machine (vLLM imports without a GPU; it cannot serve here).
#   .venv-vllm/         the CUDA image's lock (trainer_image/locks/cuda.txt: vllm==0.33.0, ~9.6 GB)
#   .venv-vllm-ascend/  the Ascend image's vLLM: vllm 0.23.0 built from its sdist with
#                       VLLM_TARGET_DEVICE=empty and torch 2.10.0, as trainer_image/locks/ascend.txt
#                       pins them (~7 GB). vllm-ascend itself has no wheel and its sdist needs the CANN
#                       toolkit to build, so tests/conformance/test_vllm_ascend_static.py reads its source instead
#                       (the sdist the lock hash-pins, extracted under .venv-vllm-ascend/src/).
# Each venv is rebuilt only when its lock changes. Set RLJOB_VLLM_TIERS=cuda to skip the Ascend one.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

UV=.venv/bin/uv
LOCKS=trainer_image/locks
TIERS=${RLJOB_VLLM_TIERS:-cuda ascend}
if [ -z "${SSL_CERT_FILE:-}" ] && [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  export SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
fi

python312() {  # the images' Python (3.12)
  local p
  for p in "${PYTHON312:-}" "$HOME"/.pyenv/versions/3.12*/bin/python3.12 "$(command -v python3.12 || true)"; do
    # a pyenv shim of a version that is not active exists but does not run: try each
    if [ -n "$p" ] && [ -x "$p" ] && "$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$p"
      return
    fi
  done
  echo "test-vllm: needs Python 3.12 (the images' Python); set PYTHON312" >&2
  exit 1
}

# The test tools at the test lock's versions (they are not part of an image).
test_tools() {
  grep -E '^(pytest|pytest-timeout|pluggy|iniconfig|packaging|hypothesis|sortedcontainers)==' \
    "$LOCKS/test.txt" | sed 's/ *\\$//'
}

build_venv() {  # build_venv DIR LOCK: DIR from LOCK, rebuilt when the lock or pyproject changes
  local dir=$1 lock=$2 stamp want
  stamp=$dir/.rljob-installed
  want=$(cat "$lock" pyproject.toml scripts/test_vllm.sh | sha256sum | cut -c1-16)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return
  fi
  echo "==> $dir from $lock" >&2
  rm -rf "$dir"
  "$UV" venv --quiet --python "$(python312)" "$dir"
  local t0=$SECONDS
  if [ "$dir" = .venv-vllm-ascend ]; then
    # vllm-ascend (CANN-only sdist), torch-npu and the NPU memory pools are not needed to check the
    # Python API; vLLM builds from its sdist without CUDA, as the Ascend image builds it.
    awk -v skip_re='^(vllm-ascend|torch-npu|memfabric-hybrid|memcache-hybrid|arctic-inference)==' '
      /^[A-Za-z0-9]/ { skip = ($0 ~ skip_re) }
      !skip { print }' "$lock" >"$dir/lock-x86.txt"
    VLLM_TARGET_DEVICE=empty "$UV" pip install --quiet --python "$dir/bin/python" --no-deps \
      --require-hashes --no-binary vllm -r "$dir/lock-x86.txt"
  else
    "$UV" pip install --quiet --python "$dir/bin/python" --no-deps --require-hashes -r "$lock"
  fi
  "$UV" pip install --quiet --python "$dir/bin/python" --no-deps -e .
  test_tools >"$dir/test-tools.txt"
  "$UV" pip install --quiet --python "$dir/bin/python" --no-deps -r "$dir/test-tools.txt"
  echo "==> $dir installed in $((SECONDS - t0)) s ($(du -sh "$dir" | cut -f1))" >&2
  echo "$want" >"$stamp"
}

ascend_source() {  # vllm-ascend's sdist, by the hash the Ascend lock pins, extracted for the static check
  local dir=.venv-vllm-ascend/src
  [ -d "$dir/vllm_ascend" ] && return
  mkdir -p "$dir"
  .venv/bin/python - "$LOCKS/ascend.txt" "$dir" <<'EOF'
import hashlib, re, sys, tarfile, io, urllib.request
lock, out = sys.argv[1], sys.argv[2]
text = open(lock).read()
block = re.search(r"^vllm-ascend==(\S+) \\\n((?:\s+--hash=sha256:\w+(?: \\)?\n)+)", text, re.M)
version, hashes = block.group(1), set(re.findall(r"sha256:(\w+)", block.group(2)))
index = urllib.request.urlopen("https://pypi.org/simple/vllm-ascend/").read().decode()
url = next(u for u in re.findall(r'href="([^"]+)"', index) if f"vllm_ascend-{version}.tar.gz" in u)
data = urllib.request.urlopen(url.split("#")[0]).read()
digest = hashlib.sha256(data).hexdigest()
if digest not in hashes:
    sys.exit(f"vllm-ascend {version} sdist sha256 {digest} is not one the lock pins")
with tarfile.open(fileobj=io.BytesIO(data)) as tar:
    members = [m for m in tar.getmembers() if "/vllm_ascend/" in m.name and m.name.endswith(".py")]
    for m in members:
        m.name = m.name.split("/", 1)[1]
    tar.extractall(out, members=members, filter="data")
print(f"vllm-ascend {version} source (sha256 {digest[:12]}...) in {out}", file=sys.stderr)
EOF
}

rc=0
for tier in $TIERS; do
  case $tier in
    cuda) dir=.venv-vllm; lock=$LOCKS/cuda.txt ;;
    ascend) dir=.venv-vllm-ascend; lock=$LOCKS/ascend.txt ;;
    *) echo "test-vllm: unknown tier $tier (cuda, ascend)" >&2; exit 2 ;;
  esac
  build_venv "$dir" "$lock"
  [ "$tier" = ascend ] && ascend_source
  # The estimator's KV-cache arithmetic against vLLM's own (a unit test that skips without vLLM).
  extra=()
  [ "$tier" = cuda ] && extra=(tests/unit/test_estimator_rollout.py::test_kv_spec_matches_vllm_arithmetic)
  echo "==> tests/conformance against $dir" >&2
  # Only tests/conformance's conftest: the suite's own (the local control plane) is not in these venvs.
  RLJOB_VLLM_TIER=$tier "$dir/bin/python" -m pytest tests/conformance ${extra[@]+"${extra[@]}"} \
    --confcutdir tests/conformance -p no:cacheprovider \
    -p no:xdist -q "$@" || rc=1
done
exit $rc
