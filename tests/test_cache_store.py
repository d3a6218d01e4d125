"""Shared stores (file:// and a real redis-server) and the cache key.

The Redis tests start their own `redis-server` on a free loopback port. Without the binary they skip,
unless OMNI_COMPILE_REQUIRE_REDIS=1 (CI sets it, so that CI can never pass by skipping them).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omni_compile.cache import (
    CorruptEntryError,
    FileStore,
    KeyFactors,
    StoreError,
    StoreUnavailableError,
    open_store,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, tmp: Path, password: str | None = None):
        tmp.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.password = password
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(tmp)] + (["--requirepass", password] if password else [])  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not start")

    def url(self, db: int = 0, query: str = "", password: str | None = None) -> str:
        auth = f":{password}@" if password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/{db}" + (f"?{query}" if query else "")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _need_redis():
    if shutil.which("redis-server") is None:
        if os.environ.get("OMNI_COMPILE_REQUIRE_REDIS") == "1":
            pytest.fail("redis-server is not installed but OMNI_COMPILE_REQUIRE_REDIS=1")
        pytest.skip("redis-server is not installed (apt install redis-server)")


class ExternalRedis:
    """The server .ci/run starts (OMNI_COMPILE_TEST_REDIS_URL=redis://127.0.0.1:PORT); tests use its DBs."""

    def __init__(self, url: str):
        from urllib.parse import urlsplit

        self.port = urlsplit(url).port

    url = RedisServer.url

    def stop(self) -> None:
        pass


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    if os.environ.get("OMNI_COMPILE_TEST_REDIS_URL"):
        yield ExternalRedis(os.environ["OMNI_COMPILE_TEST_REDIS_URL"])
        return
    _need_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


_db = iter(range(1, 16))


@pytest.fixture(params=["file", "redis"])
def store(request, tmp_path):
    if request.param == "file":
        return open_store(f"file://{tmp_path / 'store'}")
    server = request.getfixturevalue("redis_server")
    s = open_store(server.url(next(_db), "chunk_mb=0.001"))  # ~1 KiB chunks: every blob below is chunked
    s.client.flushdb()
    return s


def test_roundtrip(store):
    data = os.urandom(10_000)
    assert store.get("k1") is None and not store.contains("k1")
    assert store.put("k1", data, {"region": "FluxTransformerBlock"}) is True
    e = store.get("k1")
    assert e.data == data and e.size == 10_000 and e.meta == {"region": "FluxTransformerBlock"}
    assert store.contains("k1")
    assert store.put("k1", b"other") is False  # a valid entry stays
    assert store.get("k1").data == data
    assert store.put("k1", b"other", replace=True) is True and store.get("k1").data == b"other"
    store.put("k0", b"")
    assert [e.key for e in store.list()] == ["k0", "k1"] and store.get("k0").data == b""
    assert store.delete("k1") is True and store.get("k1") is None and store.delete("k1") is False


def test_bad_keys_are_refused(store):
    for key in ("", "../escape", "UPPER", "x" * 129, "a/b"):
        with pytest.raises(ValueError, match="invalid cache key"):
            store.put(key, b"x")


def _corrupt(store, key: str, how: str) -> None:
    if isinstance(store, FileStore):
        e = store.get(key)
        blob = store._blob_path(e.sha256)
        data = bytearray(blob.read_bytes())
        if how == "flip":
            data[len(data) // 3] ^= 0x10
        else:
            data = data[: len(data) // 2]
        blob.write_bytes(bytes(data))
    else:
        e = store._index(key)
        names = store._chunk_keys(key, e.sha256, e.meta["_chunks"])
        if how == "flip":
            chunk = bytearray(store.client.get(names[2]))
            chunk[5] ^= 0x10
            store.client.set(names[2], bytes(chunk))
        else:
            store.client.delete(names[-1])


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_corrupt_entry_is_detected_and_replaced(store, how):
    data = os.urandom(8_000)
    store.put("k", data)
    _corrupt(store, "k", how)
    with pytest.raises(CorruptEntryError, match="entry k (is corrupt|is missing)"):
        store.get("k")
    assert store.put("k", data) is True  # a corrupt entry is not "present": put repairs it
    assert store.get("k").data == data


def test_reader_never_sees_a_partial_entry(store):
    """A writer that died after its blob/chunks but before the index leaves no entry at all."""
    data = os.urandom(5_000)
    if isinstance(store, FileStore):
        import hashlib

        store._write_atomic(store._blob_path(hashlib.sha256(data).hexdigest()), data)
    else:
        import hashlib

        sha = hashlib.sha256(data).hexdigest()
        pieces = [data[i : i + store.chunk] for i in range(0, len(data), store.chunk)]
        for name, piece in zip(store._chunk_keys("k", sha, len(pieces)), pieces):
            store.client.set(name, piece)
    assert store.get("k") is None and not store.contains("k") and store.list() == []


WRITER = r"""
import os, sys
from omni_compile.cache import open_store
url, i = sys.argv[1], int(sys.argv[2])
store = open_store(url)
data = bytes([i]) * 200_000 + os.urandom(64)  # every writer has its own content for the same key
store.put("samekey", data, {"writer": i})
print("ok")
"""


def test_concurrent_writers_of_one_key_leave_one_valid_entry(store):
    procs = [subprocess.Popen([sys.executable, "-P", "-c", WRITER, store.url if isinstance(store, FileStore)
                               else _url_of(store), str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(8)]  # fmt: skip
    results = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in results]
    entries = store.list()
    assert [e.key for e in entries] == ["samekey"]
    e = store.get("samekey")  # verified: blob and index belong together
    assert e.data[:200_000] == bytes([e.meta["writer"]]) * 200_000


def _url_of(store) -> str:
    kw = store.client.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/{kw['db']}?chunk_mb=0.001"


def test_gc_removes_leftovers_and_old_entries(store):
    store.put("old", b"a" * 3000)
    store.put("new", b"b" * 3000)
    store.put("new", b"c" * 3000, replace=True)  # the first blob of "new" is unreferenced now
    removed = store.gc()
    if isinstance(store, FileStore):
        assert removed["blobs"] == 1
    assert store.get("new").data == b"c" * 3000
    time.sleep(1.1)
    store.put("fresh", b"d")
    removed = store.gc(max_age_s=1.0)
    assert removed["entries"] == 2 and [e.key for e in store.list()] == ["fresh"]


def test_redis_ttl_expires_entries(redis_server):
    s = open_store(redis_server.url(next(_db), "ttl=1"))
    s.client.flushdb()  # an external Redis may hold this DB's "k" from an earlier run (a put never replaces)
    s.put("k", b"x" * 100)
    assert s.get("k").data == b"x" * 100
    time.sleep(2.1)
    assert s.get("k") is None


def test_redis_password(tmp_path):
    _need_redis()
    server = RedisServer(tmp_path, password="s3cret")
    try:
        with pytest.raises(StoreUnavailableError, match="authentication failed"):
            open_store(server.url()).get("k")
        good = open_store(server.url(password="s3cret"))
        good.put("k", b"v")
        assert good.get("k").data == b"v"
        assert "s3cret" not in good.url  # messages never show the password
    finally:
        server.stop()


def test_unreachable_redis_fails_fast_with_a_store_error():
    t0 = time.perf_counter()
    with pytest.raises(StoreUnavailableError, match="127.0.0.1:1/0: reading entry k failed"):
        open_store("redis://127.0.0.1:1/0?timeout=1").get("k")
    assert time.perf_counter() - t0 < 10


def test_redis_stopped_mid_use(tmp_path):
    _need_redis()
    server = RedisServer(tmp_path)
    s = open_store(server.url(query="timeout=1"))
    s.put("k", b"v")
    server.stop()
    with pytest.raises(StoreUnavailableError):
        s.put("k2", b"v2")


def test_bad_urls():
    with pytest.raises(StoreError, match="unsupported store URL 'http://x'"):
        open_store("http://x")
    with pytest.raises(StoreError, match="file:// needs a path"):
        open_store("file://")


BASE = KeyFactors(
    graph_hash="a" * 64,
    signature="((1, 4096, 3072), bf16)",
    pass_uuid="p" * 64,
    torch_version="2.11.0+cu130",
    triton_version="3.6.0",
    device_arch="cuda sm90",
    omni_compile_version="0.1.0",
    build_options={"mode": "aot", "dtype": "bf16"},
)


@pytest.mark.parametrize("factor", [f.name for f in dataclasses.fields(KeyFactors)])
def test_every_key_factor_changes_the_key(factor):
    value = getattr(BASE, factor)
    changed = {**value, "dtype": "fp16"} if isinstance(value, dict) else (value or "") + "x"
    assert dataclasses.replace(BASE, **{factor: changed}).key() != BASE.key()


def test_the_key_is_stable_and_order_free():
    again = KeyFactors(**{f.name: getattr(BASE, f.name) for f in reversed(dataclasses.fields(KeyFactors))})
    assert again.key() == BASE.key() and len(BASE.key()) == 64
    reordered = dataclasses.replace(BASE, build_options={"dtype": "bf16", "mode": "aot"})
    assert reordered.key() == BASE.key()


def test_bad_keys_are_user_errors(store):
    """A bad key is an OmniCompileError (the CLI prints one line), still a ValueError for callers."""
    import re

    from omni_compile.errors import OmniCompileError

    for key in ("UPPER", ".hidden", "a*"):
        with pytest.raises(OmniCompileError, match=re.escape(f"invalid cache key {key!r}") + ".*64 hex characters"):
            store.delete(key)
        with pytest.raises(OmniCompileError, match="invalid cache key"):
            store.keys(key)


def test_keys_by_prefix(store):
    for key in ("ab12", "ab13", "b", "k1"):
        store.put(key, b"v")
    store.put("ab14", b"v")
    _corrupt_index(store, "ab14")  # a corrupt entry still has a key (`cache rm` must reach it)
    assert store.keys() == ["ab12", "ab13", "ab14", "b", "k1"]
    assert store.keys("ab1") == ["ab12", "ab13", "ab14"] and store.keys("a") == ["ab12", "ab13", "ab14"]
    assert store.keys("ab12") == ["ab12"] and store.keys("c") == []
    assert [e.key for e in store.list()] == ["ab12", "ab13", "b", "k1"]


def _corrupt_index(store, key: str) -> None:
    if isinstance(store, FileStore):
        store._entry_path(key).write_text("{not json")
    else:
        store.client.set(store._index_key(key), b"{not json")


def test_a_missing_file_store_is_empty_and_only_put_creates_it(tmp_path):
    root = tmp_path / "a" / "store"
    s = open_store(f"file://{root}")
    assert s.list() == [] and s.keys() == [] and s.keys("ab") == []
    assert s.get("k") is None and not s.contains("k") and s.delete("k") is False
    assert s.gc(max_age_s=0) == {"entries": 0, "blobs": 0, "temporary": 0}
    assert not (tmp_path / "a").exists()
    assert s.put("k", b"v") and s.get("k").data == b"v" and root.is_dir()
