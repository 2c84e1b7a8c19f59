"""The kubelet's log endpoint for local-exec pods, so `kubectl logs` (and `rljob logs`) work.

The apiserver serves `pods/log` by calling the node's kubelet at
`https://<InternalIP>:<status.daemonEndpoints.kubeletEndpoint.Port>/containerLogs/<ns>/<pod>/<ctr>`
(it does not verify the kubelet's serving certificate unless `--kubelet-certificate-authority`
is set, as upstream documents). This server answers that path from the pod's log file, with the
kubelet's query parameters `follow`, `tailLines` and `limitBytes`; 404 for a pod it never ran.
Used by `testenv.fakelet.FakeKubelet`.
"""

from __future__ import annotations

import datetime
import http.server
import ssl
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

# (namespace, pod) -> (log file, still running?) or None when the pod never ran here.
LogLookup = Callable[[str, str], tuple[Path, Callable[[], bool]] | None]


def _self_signed(folder: Path) -> tuple[Path, Path]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fakelet")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=7))
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "kubelet.crt", folder / "kubelet.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


class KubeletLogServer:
    def __init__(self, lookup: LogLookup) -> None:
        self._lookup = lookup
        self._dir = Path(tempfile.mkdtemp(prefix="fakelet-tls-"))
        cert, key = _self_signed(self._dir)
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                server._serve(self)

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(cert), str(key))
        self._httpd.socket = context.wrap_socket(self._httpd.socket, server_side=True)
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="fakelet-logs", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def _serve(self, req: http.server.BaseHTTPRequestHandler) -> None:
        url = urllib.parse.urlsplit(req.path)
        parts = url.path.strip("/").split("/")
        query = urllib.parse.parse_qs(url.query)
        found = self._lookup(parts[1], parts[2]) if len(parts) == 4 and parts[0] == "containerLogs" else None
        if found is None:
            req.send_error(404, "container not found")
            return
        path, running = found
        data = path.read_bytes() if path.exists() else b""
        if "tailLines" in query:
            lines = data.splitlines(keepends=True)
            data = b"".join(lines[-int(query["tailLines"][0]) :]) if int(query["tailLines"][0]) else b""
        if "limitBytes" in query:
            data = data[: int(query["limitBytes"][0])]
        req.send_response(200)
        req.send_header("Content-Type", "text/plain")
        req.end_headers()
        req.wfile.write(data)
        req.wfile.flush()
        if query.get("follow", ["false"])[0] != "true":
            return
        offset = path.stat().st_size if path.exists() else 0
        while True:  # stream what the process appends until it exits, as the kubelet does
            alive = running()
            size = path.stat().st_size if path.exists() else 0
            if size > offset:
                with open(path, "rb") as fh:
                    fh.seek(offset)
                    chunk = fh.read(size - offset)
                offset = size
                try:
                    req.wfile.write(chunk)
                    req.wfile.flush()
                except OSError:
                    return
            elif not alive:
                return
            time.sleep(0.2)
