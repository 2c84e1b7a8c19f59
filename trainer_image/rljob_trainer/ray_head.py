"""`python -m rljob_trainer.ray_head --head ...`: Ray's own `ray start`, without the Ray client server.

Role: trainer pod 0 starts its job's Ray head through this (`__main__.ray_head_command`). `ray
start --head` always starts the Ray client server (a gRPC proxy on port 10001 that runs any
client's code) when `grpc` is importable, which `ray[default]` always makes it; its flag takes
no "off" (`--ray-client-server-port` must be 1024..65535; ray/scripts/scripts.py `start`, Ray
2.60). rljob never uses the client API (the driver runs in the pod and attaches with
`ray.init(address="auto")`), so the head runs without it: Ray's check for the client's
dependencies is answered "missing" for this one process, and `start` then leaves the port unset
and `Node.start_head_processes` starts no client server. Everything else is `ray start`, flags
and all; token authentication comes from RAY_AUTH_MODE/RAY_AUTH_TOKEN in the environment
(builders/ray_auth.py). `tests/integration/test_ray_auth.py` checks it against the installed Ray.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

NO_CLIENT_SERVER = ImportError("rljob: the Ray client server is not started (docs/security.md)")


def main(argv: Sequence[str] | None = None) -> None:
    from ray.scripts import scripts

    # `start` reads the module global it imported (`has_ray_client = get_ray_client_dependency_error()
    # is None`); nothing else of this process asks.
    scripts.get_ray_client_dependency_error = lambda: NO_CLIENT_SERVER
    scripts.start.main(args=list(sys.argv[1:] if argv is None else argv), prog_name="ray start")


if __name__ == "__main__":
    main()
