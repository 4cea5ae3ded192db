"""The job store on an etcd cluster: a ``torch.distributed.Store`` whose keys live in etcd.

``elaswave-run --store etcd://HOST:PORT[,HOST:PORT...]`` keeps the job store on an etcd cluster
instead of in node 0's launcher, so that no node is a single point of failure: every launcher
and worker reaches the cluster through :class:`EtcdStore`, and torch's process groups rendezvous
on it as on a ``TCPStore`` (``init_process_group(store=...)``, ``new_group``, ``PrefixStore``).

It speaks etcd's v3 API through the cluster's gRPC gateway (JSON over HTTP) with ``etcd3gw``, the
maintained client of the OpenStack project (``docs/launcher.md`` says why this one). Every key of
a job lives under one namespace (``<prefix>/<run id>/``), so that jobs can share a cluster.

Guarantees, the ``TCPStore``'s semantics kept:

* ``add`` and ``compare_set`` are atomic (etcd transactions on the key's revision); ``add``
  creates a missing key from 0 and keeps the value in decimal, as ``TCPStore`` does, so a
  counter reads the same through ``get``. A request whose answer was lost (a member died or
  lost the leader after it committed) is sent again, so each ``add`` writes, in the same
  transaction, a key of its own holding the total it made (outside the job's namespace, on a
  lease that etcd expires once no retry can need it): a retry that finds it returns that total,
  whatever other adds came in between, and the ``add`` counts exactly once.
* ``get``, ``wait`` and ``multi_get`` wait for missing keys up to the store's timeout, then raise
  ``torch.distributed.DistStoreError``.
* **A member lost is not noticed.** A request that a member does not answer (refused, reset, no
  leader during an election) goes to the next endpoint, round after round, for up to
  ``unavailable_s`` (default 10 s).
* **Transient refusals are retried.** An answer of too many requests (etcd's 429), of an
  unavailable member or a timed-out request is retried like a member that does not answer; an
  expired authentication token is renewed once.
* **A secured cluster.** TLS with the cluster's CA and a client certificate, and a user and
  password, as etcdctl takes them from its environment (:class:`EtcdSecurity`:
  ``ETCDCTL_CACERT``, ``ETCDCTL_CERT``, ``ETCDCTL_KEY``, ``ETCDCTL_USER``, ``ETCDCTL_PASSWORD``;
  ``elaswave-run --store-cacert/--store-cert/--store-key`` set the first three for itself and its
  workers). The password never appears on a command line.
* **The history stays bounded** where the job compacts it (:class:`HistoryCompaction`); a
  cluster out of space anyway is lost with a message that says so.
* **A quorum lost is one error.** When no member serves a request for ``unavailable_s``, the call
  raises :class:`StoreLost` (a ``DistStoreError``, what a lost ``TCPStore`` raises), so the
  runtime stops the job as it does when node 0's store is gone, from whichever thread meets it
  first. Every later call of the process on the same cluster raises it at once, so that a
  worker's threads do not each wait out ``unavailable_s`` on the way out.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from megatron_elaswave.errors import first_line
from megatron_elaswave.launch.etcd_address import EtcdAddress, EtcdSecurity
from megatron_elaswave.waiting import pauses, wait_until

DEFAULT_UNAVAILABLE_S = 10.0
_REQUEST_TIMEOUT_S = 2.0
"""Bounds one HTTP request; a member that does not answer within it counts as unavailable."""
_MAX_TXN_OPS = 128
"""etcd's default ``--max-txn-ops``: longer batches are split."""
_TOKEN_LEASE_MIN_S = 60
"""The shortest life of an ``add``'s token key (etcd's leases count in seconds)."""
_MAX_RETRY_PAUSE_S = 0.2
"""The longest pause between two rounds of the members while none answers."""


_RETRIED_GRPC_CODES = frozenset({4, 8, 14})
"""gRPC codes of etcd's answers that a later request may not meet: deadline exceeded, resource
exhausted (HTTP 429, "too many requests") and unavailable."""

_UNAUTHENTICATED = 16
_SPACE_EXCEEDED = "database space exceeded"
"""What etcd answers every write with once its history fills its quota."""
_OUT_OF_RANGE = 11
"""etcd's answer to a compaction at a revision compacted already (or not yet reached)."""


class StoreRefused(dist.DistStoreError):
    """A member answered a request with a refusal that retrying does not change (a permission
    denied, a revision compacted already): the store is not lost."""

    def __init__(self, message: str, code: int | None) -> None:
        super().__init__(message)
        self.code = code
        """The gRPC code of etcd's answer (``None`` when its body gave none)."""


class StoreLost(dist.DistStoreError):
    """No member of the cluster served a request for ``unavailable_s``: the quorum is lost (or
    the network to it). The message says why, without the cluster's address."""


_lost: dict[EtcdAddress, str] = {}
"""Why each cluster this process found lost was (a lost quorum does not come back to a job)."""


class EtcdStore(dist.Store):
    """A ``torch.distributed.Store`` on an etcd cluster (see the module docstring).

    Thread-safe: each thread talks to the cluster on connections of its own.
    """

    def __init__(self, address: EtcdAddress, timeout: timedelta = timedelta(seconds=300),
                 unavailable_s: float = DEFAULT_UNAVAILABLE_S,
                 security: EtcdSecurity | None = None) -> None:
        """``timeout`` bounds the waits for missing keys; ``unavailable_s`` how long a request
        is retried on the members before the cluster counts as lost; ``security`` defaults to
        etcdctl's environment (:class:`EtcdSecurity`)."""
        super().__init__()
        self.address = address
        self.security = security or EtcdSecurity.from_environment()
        self._timeout = timeout
        self._unavailable_s = unavailable_s
        self._local = threading.local()
        self._preferred = 0
        """The endpoint that answered last: requests start there."""

    # -- the Store interface ---------------------------------------------------------------------

    def clone(self) -> EtcdStore:
        return EtcdStore(self.address, self._timeout, self._unavailable_s, self.security)

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    def set(self, key: str, value: str | bytes) -> None:
        self._call("kv/put", {"key": self._key(key), "value": _encode(value)})

    def get(self, key: str) -> bytes:
        [value] = self.multi_get([key])
        return value

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of ``keys``, once they all exist (up to the timeout): one request when
        they do."""
        values = self._values(keys)
        if len(values) < len(set(keys)):
            self.wait(keys)
            values = self._values(keys)
        try:
            return [values[self._key_bytes(key)] for key in keys]
        except KeyError as missing:  # deleted between the wait and the read
            raise dist.DistStoreError(f"key {missing} was deleted while it was read") from None

    def get_if_set(self, key: str) -> bytes | None:
        """The value of ``key``, or ``None`` while it is missing: one request, where a
        ``check`` and a ``get`` are two."""
        kv = self._read(key)
        return None if kv is None else _decode(kv.get("value", ""))

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        puts = [{"request_put": {"key": self._key(key), "value": _encode(value)}}
                for key, value in zip(keys, values, strict=True)]
        for chunk in _chunks(puts):
            self._call("kv/txn", {"success": chunk})

    def add(self, key: str, amount: int) -> int:
        token = uuid.uuid4().hex
        while True:
            kv, applied = self._read_counter(key, token)
            if applied is not None:  # an attempt whose answer was lost committed
                return int(applied)
            if kv is None:
                condition = {"target": "CREATE", "create_revision": "0"}
                total = amount
            elif amount == 0:
                return int(_decode(kv.get("value", "")) or 0)
            else:
                condition = {"target": "MOD", "mod_revision": kv["mod_revision"]}
                total = int(_decode(kv.get("value", "")) or 0) + amount
            if self._commit_if(key, condition, str(total), token=token):
                return total

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """As ``TCPStore``: sets ``desired`` if the value is ``expected`` (or the key is missing
        and ``expected`` empty); returns the value the key then holds (``expected`` when the key
        is missing and ``expected`` is not empty). One request, unless the key holds an empty
        value and ``expected`` is empty. A request sent again (its answer was lost) compares
        the value, not the revision it was read at: the callers' values never return to one
        they held, so a late copy of it finds the compare false."""
        expected, desired = _bytes(expected), _bytes(desired)
        condition = ({"target": "VALUE", "value": _encode(expected)} if expected
                     else {"target": "CREATE", "create_revision": "0"})
        while True:
            committed, kv = self._commit_or_read(key, condition, desired)
            if committed:
                return desired
            if kv is None:
                if expected:
                    return expected
                condition = {"target": "CREATE", "create_revision": "0"}  # deleted meanwhile
                continue
            current = _decode(kv.get("value", ""))
            if current != expected:
                return current
            condition = {"target": "MOD", "mod_revision": kv["mod_revision"]}

    def check(self, keys: Sequence[str]) -> bool:
        return all(int(response.get("count", 0)) > 0
                   for response in self._ranges(keys, count_only=True))

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        limit = (timeout or self._timeout).total_seconds()
        if not wait_until(lambda: self.check(keys), limit):
            raise dist.DistStoreError(f"wait timeout after {limit * 1000:.0f}ms, keys: "
                                      f"{', '.join(keys)}")

    def delete_key(self, key: str) -> bool:
        tokens = self._token_key(key, "").encode()
        deletes = [{"request_delete_range": {"key": self._key(key)}},
                   {"request_delete_range": {"key": _encode(tokens),
                                             "range_end": _encode(_prefix_end(tokens))}}]
        response = self._call("kv/txn", {"success": deletes})
        first = response.get("responses", [{}])[0].get("response_delete_range", {})
        return int(first.get("deleted", 0)) > 0

    def num_keys(self) -> int:
        return int(self._call("kv/range", {**self._namespace_range(), "count_only": True})
                   .get("count", 0))

    def list_keys(self) -> list[str]:
        response = self._call("kv/range", {**self._namespace_range(), "keys_only": True})
        start = len(self.address.namespace)
        return [_decode(kv["key"])[start:].decode() for kv in response.get("kvs", ())]

    # -- etcd's history ---------------------------------------------------------------------------

    def revision(self) -> int:
        """The cluster's revision now: how many writes it has applied."""
        header = self._call("kv/range", {"key": self._key(""), "count_only": True})["header"]
        return int(header["revision"])

    def compact(self, revision: int) -> bool:
        """Drop the cluster's history before ``revision``: every key keeps its value, and the
        space its older values took is reused. etcd keeps every revision until compacted and
        counts them against its quota, which stops every write once full ("no space").
        Compaction is cluster-wide. Returns ``False`` where ``revision`` is compacted already
        or not reached; raises :class:`StoreRefused` where the cluster refuses compaction
        (a user without the permission)."""
        try:
            # Not physical: the answer does not wait for the history's deletion, which takes
            # seconds at thousands of ranks, while the agent that compacts must go on beating.
            self._call("kv/compaction", {"revision": str(revision)})
        except StoreRefused as refused:
            if refused.code == _OUT_OF_RANGE:
                return False
            raise
        return True

    # -- etcd ------------------------------------------------------------------------------------

    def _key_bytes(self, key: str) -> bytes:
        return (self.address.namespace + key).encode()

    def _key(self, key: str) -> str:
        return _encode(self._key_bytes(key))

    def _token_key(self, key: str, token: str) -> str:
        """Where the ``add`` of ``token`` to ``key`` keeps the total it made: beside the namespace
        (not in it, so that listing and counting the job's keys do not see it)."""
        return f"{self.address.namespace.rstrip('/')}.adds/{key}/{token}"

    def _read_counter(self, key: str, token: str) -> tuple[dict[str, Any] | None, str | None]:
        """The counter at ``key``, and the total the ``add`` of ``token`` made if it committed."""
        ranges = [{"request_range": {"key": self._key(key)}},
                  {"request_range": {"key": _encode(self._token_key(key, token).encode())}}]
        counter, applied = (response.get("response_range", {}).get("kvs")
                            for response in self._call("kv/txn", {"success": ranges})["responses"])
        return (counter[0] if counter else None,
                _decode(applied[0].get("value", "")).decode() if applied else None)

    def _token_lease(self) -> str:
        """A lease for the keys of ``add`` tokens, renewed by a new one as it ages: a token is
        read only by the retries of its own ``add``, within ``unavailable_s``."""
        lease = getattr(self._local, "token_lease", None)
        now = time.monotonic()
        if lease is None or now > lease[1]:
            ttl = max(_TOKEN_LEASE_MIN_S, int(4 * self._unavailable_s))
            granted = self._call("lease/grant", {"TTL": ttl, "ID": 0})
            lease = self._local.token_lease = (granted["ID"], now + ttl / 2)
        return lease[0]

    def _values(self, keys: Sequence[str]) -> dict[bytes, bytes]:
        """The values of those of ``keys`` that exist, by their full key."""
        return {_decode(kv["key"]): _decode(kv.get("value", ""))
                for response in self._ranges(keys) for kv in response.get("kvs", ())}

    def _namespace_range(self) -> dict[str, str]:
        prefix = self.address.namespace.encode()
        return {"key": _encode(prefix), "range_end": _encode(_prefix_end(prefix))}

    def _read(self, key: str) -> dict[str, Any] | None:
        kvs = self._call("kv/range", {"key": self._key(key)}).get("kvs")
        return kvs[0] if kvs else None

    def _ranges(self, keys: Sequence[str], count_only: bool = False) -> Iterator[dict]:
        """One range response per key, ``keys_only`` or ``count_only``, in as few transactions
        as etcd allows."""
        ranges = [{"request_range": {"key": self._key(key), "count_only": count_only}}
                  for key in keys]
        for chunk in _chunks(ranges):
            for response in self._call("kv/txn", {"success": chunk}).get("responses", ()):
                yield response.get("response_range", {})

    def _commit_if(self, key: str, condition: dict[str, str], value: str | bytes,
                   token: str | None = None) -> bool:
        """Put ``value`` at ``key`` (and at the key of ``token``) if ``condition`` (an etcd
        compare, without its key) holds."""
        compare = {**condition, "key": self._key(key), "result": "EQUAL"}
        puts = [{"request_put": {"key": self._key(key), "value": _encode(value)}}]
        if token is not None:
            puts.append({"request_put": {"key": _encode(self._token_key(key, token).encode()),
                                         "value": _encode(value), "lease": self._token_lease()}})
        return bool(self._call("kv/txn", {"compare": [compare], "success": puts})
                    .get("succeeded", False))

    def _commit_or_read(self, key: str, condition: dict[str, str],
                        value: str | bytes) -> tuple[bool, dict[str, Any] | None]:
        """Put ``value`` at ``key`` if ``condition`` holds, else read the key, in one
        transaction: whether it was put, and what the key held if not (``None``: missing)."""
        compare = {**condition, "key": self._key(key), "result": "EQUAL"}
        response = self._call("kv/txn", {
            "compare": [compare],
            "success": [{"request_put": {"key": self._key(key), "value": _encode(value)}}],
            "failure": [{"request_range": {"key": self._key(key)}}]})
        if response.get("succeeded", False):
            return True, None
        kvs = response["responses"][0].get("response_range", {}).get("kvs")
        return False, kvs[0] if kvs else None

    def _clients(self) -> list:
        clients = getattr(self._local, "clients", None)
        if clients is None:
            from etcd3gw.client import Etcd3Client

            security = self.security
            clients = self._local.clients = [
                Etcd3Client(host=host, port=port, timeout=_REQUEST_TIMEOUT_S, api_path="/v3/",
                            protocol="https" if security.tls else "http",
                            ca_cert=security.cacert, cert_cert=security.cert,
                            cert_key=security.key)
                for host, port in self.address.endpoints]
        return clients

    @property
    def _request_options(self) -> dict[str, Any]:
        """The CA to verify the members with, given with each request: ``requests`` lets
        ``$REQUESTS_CA_BUNDLE`` override a session's own."""
        return {} if self.security.cacert is None else {"verify": self.security.cacert}

    def _authenticate(self, client) -> None:
        """Take a token for :attr:`EtcdSecurity.user` on ``client`` (its later requests carry
        it)."""
        client.session.headers.pop("Authorization", None)
        answer = client.post(client.get_url("auth/authenticate"),
                             json={"name": self.security.user,
                                   "password": self.security.password or ""},
                             **self._request_options)
        client.session.headers["Authorization"] = answer["token"]

    def _call(self, path: str, payload: dict) -> dict:
        """POST ``payload`` to ``/v3/<path>`` on the first member that answers, going round the
        members until ``unavailable_s`` has passed."""
        from etcd3gw import exceptions

        if self.address in _lost:
            raise StoreLost(_lost[self.address])
        clients = self._clients()
        deadline = time.monotonic() + self._unavailable_s
        retry_pauses = pauses(_MAX_RETRY_PAUSE_S)
        renewed = False
        while True:
            for offset in range(len(clients)):
                index = (self._preferred + offset) % len(clients)
                client = clients[index]
                try:
                    if self.security.user and "Authorization" not in client.session.headers:
                        self._authenticate(client)
                    response = client.post(client.get_url(path), json=payload,
                                           **self._request_options)
                except (exceptions.ConnectionFailedError, exceptions.ConnectionTimeoutError,
                        exceptions.InternalServerError) as error:
                    last_error = first_line(error)
                    continue
                except exceptions.Etcd3Exception as error:
                    code, message = _grpc_error(error)
                    if code in _RETRIED_GRPC_CODES:
                        last_error = message
                        continue
                    if code == _UNAUTHENTICATED and self.security.user and not renewed:
                        renewed = True  # an expired token: once more with a new one
                        client.session.headers.pop("Authorization", None)
                        last_error = message
                        continue
                    raise StoreRefused(f"the job store at {self.address.describe()} refused a "
                                       f"request: {message}", code) from None
                self._preferred = index
                return response
            if time.monotonic() >= deadline:
                _lost[self.address] = (
                    f"the etcd cluster is out of space ({last_error}): compact and defragment "
                    "it (etcdctl compact, defrag, alarm disarm) or raise its "
                    "--quota-backend-bytes" if _SPACE_EXCEEDED in last_error else
                    f"no member of the etcd cluster answered for {self._unavailable_s:g} s: "
                    f"{last_error}")
                raise StoreLost(_lost[self.address])
            time.sleep(next(retry_pauses))


class HistoryCompaction:
    """Keeps an etcd cluster's history of a job's writes bounded, whatever the job's length:
    at each tick at least ``interval_s`` after the last, compacts the cluster to the revision
    it read at that last tick, so that the history kept spans one to two intervals.

    One agent of the job ticks it at a time (the lowest running node's); where the cluster
    refuses compaction, it says so in one line through ``log`` and stops trying: the
    cluster must then compact itself (etcd's ``--auto-compaction-retention``)."""

    def __init__(self, interval_s: float, log: Callable[[str], None]) -> None:
        """Raises ``ValueError`` unless ``interval_s`` is positive."""
        if interval_s <= 0:
            raise ValueError(f"the compaction interval must be positive, got {interval_s:g} s")
        self.interval_s = interval_s
        self._log = log
        self._last: tuple[float, int] | None = None
        """When the last tick was, and the revision it read."""
        self._refused = False

    def tick(self, store: EtcdStore, now: float) -> None:
        """Compact ``store``'s cluster if an interval has passed since the last tick (a
        monotonic ``now``)."""
        if self._refused or (self._last is not None and now < self._last[0] + self.interval_s):
            return
        revision = store.revision()
        if self._last is not None and not self._compact(store):
            return
        self._last = (now, revision)

    def finish(self, store: EtcdStore) -> None:
        """Compact to the revision read at the last tick without waiting for the interval: the
        agent ends, and no later tick of it would."""
        if not self._refused and self._last is not None:
            self._compact(store)

    def _compact(self, store: EtcdStore) -> bool:
        """Compact to the revision read at the last tick; ``False`` once refused."""
        try:
            store.compact(self._last[1])
        except StoreRefused as refused:
            self._refused = True
            self._log(f"{refused}; the etcd cluster's history is not compacted by the job "
                      "(give it --auto-compaction-retention, or this user the permission)")
            return False
        return True


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _prefix_end(prefix: bytes) -> bytes:
    """The end of etcd's range of the keys that start with ``prefix`` (its last byte below 0xff)."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


def _encode(value: str | bytes) -> str:
    from etcd3gw.utils import _encode as encode

    return encode(_bytes(value))


def _decode(value: str) -> bytes:
    from etcd3gw.utils import _decode as decode

    return decode(value)


def _chunks(operations: list) -> Iterator[list]:
    for start in range(0, len(operations), _MAX_TXN_OPS):
        yield operations[start:start + _MAX_TXN_OPS]


def _grpc_error(error: BaseException) -> tuple[int | None, str]:
    """The gRPC code and message of an answer etcd's gateway refused (``None`` when its body
    says none)."""
    try:
        body = json.loads(getattr(error, "detail_text", None) or "{}")
    except ValueError:
        body = {}
    code = body.get("code") if isinstance(body, dict) else None
    message = body.get("message") or body.get("error") if isinstance(body, dict) else None
    return (code if isinstance(code, int) else None), (message or first_line(error))

