"""A local etcd cluster on loopback ports, for tests, benchmarks and trying ``--store etcd://``.

    python scripts/etcd_cluster.py --members 3      # prints the --store URL; Ctrl-C stops it

Each member is an ``etcd`` process (Debian's ``etcd-server``; ``scripts/setup.sh`` installs it
where apt is available) with its data in a temporary directory. :class:`EtcdCluster` is the same
from Python: a context manager that starts the members, waits until the cluster has a leader,
and kills them all on exit; :meth:`EtcdCluster.kill` SIGKILLs one member for a test. With
``tls`` (:func:`make_tls_files`, a CA and certificates made with ``openssl``) the members serve
their clients over TLS and ask for a client certificate; :meth:`EtcdCluster.enable_auth` turns on
etcd's users.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ETCD = "etcd"
START_TIMEOUT_S = 30.0


def etcd_missing() -> str | None:
    """Why no etcd cluster can be started here, or ``None`` if one can."""
    if shutil.which(ETCD) is None:
        return "etcd is not installed (apt-get install etcd-server)"
    return None


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass(frozen=True)
class TlsFiles:
    """A CA, the members' certificate (for 127.0.0.1) and a client's, in PEM files."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_tls_files(directory: Path) -> TlsFiles:
    """Make a CA and, signed by it, a certificate for the members on 127.0.0.1 and one for a
    client, under ``directory`` (``openssl``)."""
    directory.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(*(directory / name for name in ("ca.pem", "server.pem", "server-key.pem",
                                                      "client.pem", "client-key.pem")))

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    ca_key = directory / "ca-key.pem"
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
            "-keyout", str(ca_key), "-out", str(files.ca))
    for cert, key, name, usage in ((files.server_cert, files.server_key, "/CN=127.0.0.1",
                                    "serverAuth,clientAuth"),
                                   (files.client_cert, files.client_key, "/O=elaswave",
                                    "clientAuth")):
        request, extensions = cert.with_suffix(".csr"), cert.with_suffix(".ext")
        extensions.write_text(f"subjectAltName=IP:127.0.0.1\nextendedKeyUsage={usage}\n")
        # The client certificate names no CN: etcd's gateway refuses a password login from one.
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", name,
                "-keyout", str(key), "-out", str(request))
        openssl("x509", "-req", "-in", str(request), "-CA", str(files.ca), "-CAkey", str(ca_key),
                "-CAcreateserial", "-days", "1", "-extfile", str(extensions), "-out", str(cert))
    return files


class EtcdCluster:
    """``members`` etcd processes forming one cluster on 127.0.0.1 (serving TLS with ``tls``)."""

    def __init__(self, members: int = 3, data_dir: str | None = None,
                 tls: TlsFiles | None = None, quota_bytes: int | None = None) -> None:
        """``quota_bytes``: each member's ``--quota-backend-bytes`` (etcd's default: 2 GiB)."""
        self.size = members
        self.tls = tls
        self.quota_bytes = quota_bytes
        self._auth_token: str | None = None
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="elaswave-etcd-"))
        ports = _free_ports(2 * members)
        self.client_ports, self.peer_ports = ports[:members], ports[members:]
        self.processes: list[subprocess.Popen | None] = [None] * members

    @property
    def url(self) -> str:
        """What ``elaswave-run --store`` takes."""
        return "etcd://" + ",".join(f"127.0.0.1:{port}" for port in self.client_ports)

    def start(self) -> EtcdCluster:
        cluster = ",".join(f"m{i}=http://127.0.0.1:{port}" for i, port in enumerate(self.peer_ports))
        token = f"elaswave-{os.getpid()}-{self.client_ports[0]}"
        scheme = "https" if self.tls else "http"
        secured = ([] if self.tls is None else
                   ["--cert-file", str(self.tls.server_cert), "--key-file", str(self.tls.server_key),
                    "--trusted-ca-file", str(self.tls.ca), "--client-cert-auth"])
        for i in range(self.size):
            client = f"{scheme}://127.0.0.1:{self.client_ports[i]}"
            peer = f"http://127.0.0.1:{self.peer_ports[i]}"
            log = open(self.data_dir / f"m{i}.log", "wb")
            self.processes[i] = subprocess.Popen(
                [ETCD, "--name", f"m{i}", "--data-dir", str(self.data_dir / f"m{i}"),
                 "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", cluster, "--initial-cluster-token", token,
                 "--initial-cluster-state", "new", "--logger", "zap", "--log-level", "warn",
                 *secured, *([] if self.quota_bytes is None
                             else ["--quota-backend-bytes", str(self.quota_bytes)])],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.healthy():
            for i, process in enumerate(self.processes):
                if process is not None and process.poll() is not None:
                    raise RuntimeError(f"etcd member m{i} exited with {process.returncode}: "
                                       f"{self.log(i)[-500:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the etcd cluster had no leader within {START_TIMEOUT_S:g} s")
            time.sleep(0.1)
        return self

    def healthy(self, member: int | None = None) -> bool:
        """Whether ``member`` (default: any) reports the cluster healthy (it has a leader)."""
        members = range(self.size) if member is None else [member]
        for i in members:
            try:
                with self._open(i, "/health", None, timeout=1.0) as response:
                    if json.loads(response.read()).get("health") == "true":
                        return True
            except (OSError, urllib.error.URLError, ValueError):
                continue
        return False

    def _open(self, member: int, path: str, body: dict | None, timeout: float = 2.0):
        """A request to ``member``'s client URL (a POST of ``body`` as JSON, else a GET)."""
        scheme, context = "http", None
        if self.tls is not None:
            scheme = "https"
            context = ssl.create_default_context(cafile=str(self.tls.ca))
            context.load_cert_chain(str(self.tls.client_cert), str(self.tls.client_key))
        request = urllib.request.Request(
            f"{scheme}://127.0.0.1:{self.client_ports[member]}{path}",
            data=None if body is None else json.dumps(body).encode(),
            method="GET" if body is None else "POST")
        if self._auth_token is not None:
            request.add_header("Authorization", self._auth_token)
        return urllib.request.urlopen(request, timeout=timeout, context=context)

    def call(self, path: str, body: dict) -> dict:
        """POST ``body`` to ``/v3/<path>`` on the first member (JSON answer)."""
        with self._open(0, f"/v3/{path}", body) as response:
            return json.loads(response.read())

    def enable_auth(self, user: str, password: str) -> None:
        """Add ``user`` with ``password`` and the root role, and turn authentication on."""
        self.call("auth/role/add", {"name": "root"})
        self.call("auth/user/add", {"name": user, "password": password})
        self.call("auth/user/grant", {"user": user, "role": "root"})
        self.call("auth/enable", {})
        self._auth_token = self.call("auth/authenticate",
                                     {"name": user, "password": password})["token"]

    def leader(self) -> int:
        """The member that leads the cluster now."""
        for i in range(self.size):
            try:
                with self._open(i, "/v3/maintenance/status", {}) as response:
                    status = json.loads(response.read())
            except (OSError, urllib.error.URLError, ValueError):
                continue
            if status.get("leader") and status["leader"] == status["header"]["member_id"]:
                return i
        raise RuntimeError("no member of the etcd cluster leads it")

    def kill(self, member: int) -> None:
        """SIGKILL one member."""
        process = self.processes[member]
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait()

    def log(self, member: int) -> str:
        path = self.data_dir / f"m{member}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        for i in range(self.size):
            self.kill(i)
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--data-dir", help="keep the members' data here (default: a temporary "
                        "directory, removed at exit)")
    args = parser.parse_args()
    if (missing := etcd_missing()) is not None:
        print(f"etcd_cluster.py: error: {missing}", file=sys.stderr)
        return 2
    stopping = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stopping)  # until sigwait takes one
    with EtcdCluster(args.members, args.data_dir) as cluster:
        print(cluster.url, flush=True)
        signal.sigwait(stopping)
    return 0


if __name__ == "__main__":
    sys.exit(main())
