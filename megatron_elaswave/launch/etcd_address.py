"""Where a job's store lives on an etcd cluster, and how it is reached: what the launcher parses
from ``--store etcd://...`` and etcdctl's environment, without importing torch (the launcher
parses its command line while its fork server preloads torch)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

ETCD_URL_SCHEME = "etcd://"
DEFAULT_ETCD_NAMESPACE = "elaswave"
"""The key prefix of a job's store when its ``etcd://`` URL names none."""


class StoreURLError(ValueError):
    """An ``etcd://`` URL that names no usable endpoint; the message is one line."""


@dataclass(frozen=True)
class EtcdAddress:
    """Where a job's store lives on an etcd cluster."""

    endpoints: tuple[tuple[str, int], ...]
    """``(host, port)`` of the members' client URLs, tried in this order."""
    namespace: str
    """Prefix of every key of the job, ending with ``/``."""

    @classmethod
    def parse(cls, url: str, run_id: str | None = None) -> EtcdAddress:
        """``etcd://HOST:PORT[,HOST:PORT...][/PREFIX]``; the namespace is ``PREFIX/`` (default
        ``elaswave/``) followed by ``run_id/`` when one is given. Raises :class:`StoreURLError`."""
        if not url.startswith(ETCD_URL_SCHEME):
            raise StoreURLError(
                f"{url!r} is not an etcd URL ({ETCD_URL_SCHEME}HOST:PORT[,HOST:PORT...])")
        hosts, _, prefix = url[len(ETCD_URL_SCHEME):].partition("/")
        endpoints = []
        for endpoint in hosts.split(","):
            host, _, port = endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 2**16:
                raise StoreURLError(f"{url!r}: {endpoint!r} is not HOST:PORT")
            endpoints.append((host.strip("[]"), int(port)))
        namespace = (prefix.strip("/") or DEFAULT_ETCD_NAMESPACE) + "/"
        if run_id is not None:
            namespace += f"{run_id}/"
        return cls(tuple(endpoints), namespace)

    @property
    def url(self) -> str:
        """The URL that names this address, namespace included (what workers are handed)."""
        hosts = ",".join(f"{host}:{port}" for host, port in self.endpoints)
        return f"{ETCD_URL_SCHEME}{hosts}/{self.namespace.rstrip('/')}"

    def describe(self) -> str:
        """The cluster, for messages: ``etcd://HOST:PORT,...``."""
        return ETCD_URL_SCHEME + ",".join(f"{host}:{port}" for host, port in self.endpoints)


@dataclass(frozen=True)
class EtcdSecurity:
    """How the job reaches a secured etcd cluster: TLS files and a user, from etcdctl's
    environment variables."""

    cacert: str | None = None
    """The CA certificate that signed the members' (``ETCDCTL_CACERT``): requests go over TLS."""
    cert: str | None = None
    """This client's certificate (``ETCDCTL_CERT``), with :attr:`key`."""
    key: str | None = None
    """Its private key (``ETCDCTL_KEY``)."""
    user: str | None = None
    """The etcd user (``ETCDCTL_USER``, ``NAME`` or ``NAME:PASSWORD``)."""
    password: str | None = None
    """Its password (``ETCDCTL_PASSWORD``, or after the colon of ``ETCDCTL_USER``)."""

    @classmethod
    def from_environment(cls, env: Mapping[str, str] = os.environ) -> EtcdSecurity:
        user, _, password = (env.get("ETCDCTL_USER") or "").partition(":")
        return cls(env.get("ETCDCTL_CACERT") or None, env.get("ETCDCTL_CERT") or None,
                   env.get("ETCDCTL_KEY") or None, user or None,
                   env.get("ETCDCTL_PASSWORD") or password or None)

    @property
    def tls(self) -> bool:
        return self.cacert is not None or self.cert is not None
