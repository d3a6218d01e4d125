"""Content stores for compiled region files, shared across nodes (DESIGN.md contract 7, docs/cache.md).

One small interface, two backends:

- `file://PATH`: a local or shared (NFS-like) directory. An entry is a blob stored under its own sha256
  (`blobs/ab/abcd...`) and an index file under the key (`entries/ke/key.json`: sha256, size, metadata).
  Both are written to a temporary name in their final directory, fsynced, then renamed into place, the
  index last, so a reader sees either no entry or a complete one; concurrent writers of one key each
  write their own blob and the last index rename wins, leaving one valid entry.
- `redis://[:password@]HOST:PORT/DB[?ttl=S&prefix=P&chunk_mb=M&timeout=S]`: a Redis server (redis-py).
  A blob is written as chunks (`P:chunk:KEY:SHA:i`, `chunk_mb` MiB each), then the index `P:entry:KEY`
  (JSON) last, so a reader never sees a partial entry; `ttl` applies to chunks and index.

Every `get` verifies the blob's size and sha256 against the index before returning it; a mismatch raises
`CorruptEntryError` (the caller rebuilds and `put(..., replace=True)` repairs the entry). A store that
cannot be reached or answers too slowly raises `StoreUnavailableError`. Both are `StoreError`s, which a
build turns into a warning: a store never fails a build.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

from omni_compile.errors import ConfigError, OmniCompileError


class StoreError(OmniCompileError):
    """A store operation that did not succeed; builds log it and go on locally."""


class StoreUnavailableError(StoreError):
    """The store cannot be reached, refused the credentials, or timed out."""


class CorruptEntryError(StoreError):
    """An entry whose blob does not match its index (truncated, bit-flipped, partly expired)."""


@dataclass
class Entry:
    key: str
    sha256: str
    size: int
    created: float
    meta: dict[str, Any] = field(default_factory=dict)
    data: bytes | None = None  # set by get(), not by list()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


KEY_CHARS = "0123456789abcdefghijklmnopqrstuvwxyz-_."
KEY_FORM = (
    "omni-compile's keys are 64 hex characters (a sha256); a store takes up to 128 characters of [0-9a-z-_.], "
    "the first a letter or digit"
)


def _check_key(key: str) -> str:
    """`key` (or a prefix of one) when it is safe in a path and a Redis pattern; a ConfigError (a ValueError) if not."""
    if not key or len(key) > 128 or key[0] in "-_." or not all(c in KEY_CHARS for c in key):
        raise ConfigError(f"invalid cache key {key!r}: {KEY_FORM}")
    return key


class Store(ABC):
    url: str

    @abstractmethod
    def get(self, key: str) -> Entry | None:
        """The verified entry, or None when there is none. Raises CorruptEntryError, StoreUnavailableError."""

    @abstractmethod
    def put(self, key: str, data: bytes, meta: dict[str, Any] | None = None, *, replace: bool = False) -> bool:
        """Publish `data` under `key`; False (nothing written) when a valid entry exists and not `replace`."""

    @abstractmethod
    def contains(self, key: str) -> bool: ...

    @abstractmethod
    def keys(self, prefix: str = "") -> list[str]:
        """The keys of the entries whose key starts with `prefix`, corrupt ones included, sorted."""

    def list(self) -> list[Entry]:
        """Every readable entry's index (no data), sorted by key."""
        out = []
        for key in self.keys():
            try:
                e = self._read_index(key)
            except CorruptEntryError:
                continue
            if e is not None:
                out.append(e)
        return out

    @abstractmethod
    def _read_index(self, key: str) -> Entry | None:
        """The entry's index without its data (no verification), or None when there is none."""

    @abstractmethod
    def delete(self, key: str) -> bool: ...

    @abstractmethod
    def gc(self, max_age_s: float | None = None) -> dict[str, int]:
        """Remove leftovers of interrupted writes and unreferenced blobs, and entries older than
        `max_age_s` when given; returns counts of what was removed."""

    def _parse_index(self, key: str, raw: str | bytes, **extra_fields: str) -> Entry:
        """An entry's index (JSON) as an Entry; `extra_fields` (meta name -> index field) are carried in
        `meta` for the store's own use. An unreadable index is a corrupt entry."""
        try:
            d = json.loads(raw)
            meta = dict(d.get("meta", {}), **{name: d[f] for name, f in extra_fields.items()})
            return Entry(key=key, sha256=d["sha256"], size=d["size"], created=d["created"], meta=meta)
        except (ValueError, KeyError) as e:
            raise CorruptEntryError(f"{self.url}: the index of entry {key} is unreadable: {e}") from e

    def _holds_valid(self, key: str) -> bool:
        """Whether `key` has a verified entry (a corrupt one does not count: put replaces it)."""
        try:
            return self.get(key) is not None
        except CorruptEntryError:
            return False

    def _verify(self, entry: Entry, data: bytes) -> Entry:
        if len(data) != entry.size or _sha256(data) != entry.sha256:
            raise CorruptEntryError(
                f"{self.url}: entry {entry.key} is corrupt (expected {entry.size} bytes with sha256 "
                f"{entry.sha256[:12]}..., read {len(data)} bytes with sha256 {_sha256(data)[:12]}...)"
            )
        entry.data = data
        return entry


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class FileStore(Store):
    TMP_PREFIX = ".tmp-"

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.url = f"file://{self.root}"  # nothing is created before the first put (listing a typo creates nothing)

    def _entry_path(self, key: str) -> Path:
        return self.root / "entries" / key[:2] / f"{_check_key(key)}.json"

    def _blob_path(self, sha: str) -> Path:
        return self.root / "blobs" / sha[:2] / sha

    def _write_atomic(self, path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{self.TMP_PREFIX}{uuid.uuid4().hex}-{path.name}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)

    def _read_index(self, key: str) -> Entry | None:
        try:
            raw = self._entry_path(key).read_text()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreUnavailableError(f"{self.url}: cannot read entry {key}: {e}") from e
        return self._parse_index(key, raw)

    def get(self, key: str) -> Entry | None:
        entry = self._read_index(key)
        if entry is None:
            return None
        try:
            data = self._blob_path(entry.sha256).read_bytes()
        except FileNotFoundError:
            raise CorruptEntryError(f"{self.url}: entry {key} has no blob {entry.sha256[:12]}...") from None
        except OSError as e:
            raise StoreUnavailableError(f"{self.url}: cannot read entry {key}: {e}") from e
        return self._verify(entry, data)

    def put(self, key: str, data: bytes, meta: dict[str, Any] | None = None, *, replace: bool = False) -> bool:
        _check_key(key)
        if not replace and self._holds_valid(key):
            return False
        sha = _sha256(data)
        index = json.dumps({"sha256": sha, "size": len(data), "created": time.time(), "meta": meta or {}}).encode()
        try:
            blob = self._blob_path(sha)
            if not self._blob_ok(blob, sha, len(data)):  # a corrupt blob of the same content is rewritten
                self._write_atomic(blob, data)
            self._write_atomic(self._entry_path(key), index)  # the index last
        except OSError as e:
            raise StoreUnavailableError(f"{self.url}: cannot write entry {key}: {e}") from e
        return True

    @staticmethod
    def _blob_ok(blob: Path, sha: str, size: int) -> bool:
        try:
            return blob.stat().st_size == size and _sha256(blob.read_bytes()) == sha
        except FileNotFoundError:
            return False

    def contains(self, key: str) -> bool:
        entry = self._read_index(key)
        return entry is not None and self._blob_path(entry.sha256).is_file()

    def keys(self, prefix: str = "") -> list[str]:
        if prefix:
            _check_key(prefix)
        # entries/ke/KEY.json: a prefix of two or more characters names its directory
        pattern = f"{prefix[:2]}/{prefix}*.json" if len(prefix) >= 2 else f"{prefix}*/*.json"
        paths = (self.root / "entries").glob(pattern)  # none when the directory does not exist
        return sorted(p.stem for p in paths if not p.name.startswith(self.TMP_PREFIX))

    def delete(self, key: str) -> bool:
        try:
            self._entry_path(key).unlink()
        except FileNotFoundError:
            return False
        return True  # the blob goes at the next gc (another entry may share it)

    def gc(self, max_age_s: float | None = None) -> dict[str, int]:
        removed = {"entries": 0, "blobs": 0, "temporary": 0}
        now = time.time()
        if max_age_s is not None:
            for e in self.list():
                if now - e.created > max_age_s and self.delete(e.key):
                    removed["entries"] += 1
        live = {e.sha256 for e in self.list()}
        for p in self.root.glob("*/*/*"):
            if p.name.startswith(self.TMP_PREFIX):
                if now - p.stat().st_mtime > 3600:  # an interrupted write (a live one is seconds old)
                    p.unlink(missing_ok=True)
                    removed["temporary"] += 1
            elif p.parent.parent.name == "blobs" and p.name not in live:
                p.unlink(missing_ok=True)
                removed["blobs"] += 1
        return removed


class RedisStore(Store):
    def __init__(self, url: str):
        try:
            import redis
        except ImportError as e:
            raise StoreUnavailableError("redis:// stores need the redis package: pip install redis") from e
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        own = {k: query.pop(k)[-1] for k in ("ttl", "prefix", "chunk_mb", "timeout") if k in query}
        self.ttl = int(own["ttl"]) if "ttl" in own else None
        self.prefix = own.get("prefix", "omni-compile")
        self.chunk = int(float(own.get("chunk_mb", 8)) * 2**20)
        timeout = float(own.get("timeout", 5))
        rest = "&".join(f"{k}={v}" for k, vs in query.items() for v in vs)
        self.url = redacted_url(url)
        self._redis = redis
        self.client = redis.Redis.from_url(
            urlunsplit((parts.scheme, parts.netloc, parts.path, rest, "")),
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
        )

    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except self._redis.exceptions.AuthenticationError as e:
            raise StoreUnavailableError(f"{self.url}: authentication failed ({e}); put the password in the URL: "
                                        "redis://:PASSWORD@HOST:PORT/DB") from e  # fmt: skip
        except self._redis.exceptions.ResponseError as e:
            if "NOAUTH" in str(e) or "WRONGPASS" in str(e):
                raise StoreUnavailableError(f"{self.url}: authentication failed ({e}); put the password in the "
                                            "URL: redis://:PASSWORD@HOST:PORT/DB") from e  # fmt: skip
            raise StoreError(f"{self.url}: {what} failed: {e}") from e
        except (self._redis.exceptions.ConnectionError, self._redis.exceptions.TimeoutError, OSError) as e:
            raise StoreUnavailableError(f"{self.url}: {what} failed: {type(e).__name__}: {e}") from e

    def _index_key(self, key: str) -> str:
        return f"{self.prefix}:entry:{_check_key(key)}"

    def _chunk_keys(self, key: str, sha: str, n: int) -> list[str]:
        return [f"{self.prefix}:chunk:{key}:{sha[:16]}:{i}" for i in range(n)]

    def _index(self, key: str) -> Entry | None:
        raw = self._call(f"reading entry {key}", self.client.get, self._index_key(key))
        if raw is None:
            return None
        return self._parse_index(key, raw, _chunks="chunks")

    def _read_index(self, key: str) -> Entry | None:
        entry = self._index(key)
        if entry is not None:
            entry.meta.pop("_chunks", None)
        return entry

    def get(self, key: str) -> Entry | None:
        entry = self._index(key)
        if entry is None:
            return None
        n = entry.meta.pop("_chunks")
        chunks = self._call(f"reading entry {key}", self.client.mget, self._chunk_keys(key, entry.sha256, n)) if n else []
        if any(c is None for c in chunks):
            missing = sum(c is None for c in chunks)
            raise CorruptEntryError(f"{self.url}: entry {key} is missing {missing} of its {n} chunks (expired or evicted)")
        return self._verify(entry, b"".join(chunks))

    def put(self, key: str, data: bytes, meta: dict[str, Any] | None = None, *, replace: bool = False) -> bool:
        _check_key(key)
        if not replace and self._holds_valid(key):
            return False
        sha = _sha256(data)
        pieces = [data[i : i + self.chunk] for i in range(0, len(data), self.chunk)]
        names = self._chunk_keys(key, sha, len(pieces))
        index = json.dumps({"sha256": sha, "size": len(data), "created": time.time(), "chunks": len(pieces),
                            "meta": meta or {}})  # fmt: skip
        pipe = self.client.pipeline(transaction=False)
        for name, piece in zip(names, pieces):
            pipe.set(name, piece, ex=self.ttl)
        self._call(f"writing entry {key}", pipe.execute)
        self._call(f"writing entry {key}", self.client.set, self._index_key(key), index, ex=self.ttl)  # last
        return True

    def contains(self, key: str) -> bool:
        return self._call(f"reading entry {key}", self.client.exists, self._index_key(key)) == 1

    def keys(self, prefix: str = "") -> list[str]:
        if prefix:
            _check_key(prefix)
        names = f"{self.prefix}:entry:"
        pattern = "".join(f"\\{c}" if c in "*?[]^\\" else c for c in names) + prefix + "*"  # the store prefix literally
        found = self._call("listing entries", lambda: list(self.client.scan_iter(match=pattern, count=500)))
        return sorted(name.decode()[len(names) :] for name in found)

    def delete(self, key: str) -> bool:
        try:
            entry = self._index(key)
        except CorruptEntryError:
            entry = None
        names = [self._index_key(key)]
        if entry is not None:
            names += self._chunk_keys(key, entry.sha256, entry.meta["_chunks"])
        return self._call(f"deleting entry {key}", self.client.delete, *names) > 0

    def gc(self, max_age_s: float | None = None) -> dict[str, int]:
        removed = {"entries": 0, "chunks": 0}
        now = time.time()
        live: set[str] = set()
        for e in self.list():
            if max_age_s is not None and now - e.created > max_age_s:
                removed["entries"] += int(self.delete(e.key))
            else:
                live.add(f"{e.key}:{e.sha256[:16]}")
        prefix = f"{self.prefix}:chunk:"
        for name in self._call("listing chunks", lambda: list(self.client.scan_iter(match=prefix + "*", count=500))):
            owner = name.decode()[len(prefix):].rsplit(":", 1)[0]
            if owner not in live:
                # a chunk of a write still in progress has no index yet: keep chunks younger than an hour
                idle = self._call("reading a chunk", self.client.object, "idletime", name)
                if idle is None or idle > 3600:
                    removed["chunks"] += self._call("deleting a chunk", self.client.delete, name)
        return removed


def redacted_url(url: str) -> str:
    """`url` without password and query: what messages and reports show of a Redis URL."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, (parts.hostname or "") + (f":{parts.port}" if parts.port else ""), parts.path, "", ""))


def open_store(url: str) -> Store:
    """The store for `url`: file://PATH or redis://[:password@]HOST:PORT/DB[?ttl=...]."""
    if url.startswith("file://"):
        path = url[len("file://"):]
        if not path:
            raise StoreError("file:// needs a path, e.g. file:///shared/omni-cache")
        return FileStore(path)
    if url.startswith(("redis://", "rediss://")):
        return RedisStore(url)
    raise StoreError(f"unsupported store URL {url!r}: use file://PATH or redis://[:password@]HOST:PORT/DB")
