"""`omni-compile cache ls|push|pull|rm|gc` in-process (`omni_compile.cli.main`) on both stores.

No model is built: the entries are written through the store API, and push/pull use a hand-written
manifest whose file is a few random bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid

import pytest
from test_cache_store import _db, redis_server  # noqa: F401  (fixture)

from omni_compile.artifact.manifest import MANIFEST, SCHEMA
from omni_compile.cache import open_store
from omni_compile.cli import main


@pytest.fixture(scope="module")
def redis_db(request):
    return request.getfixturevalue("redis_server").url(next(_db))  # one DB for the module, a prefix of its own per test


@pytest.fixture(params=["file", "redis"])
def store(request, tmp_path):
    if request.param == "file":
        yield open_store(f"file://{tmp_path / 'store'}")
        return
    s = open_store(request.getfixturevalue("redis_db") + f"?prefix=cli-{uuid.uuid4().hex[:8]}")
    yield s
    for name in s.client.scan_iter(match=f"{s.prefix}:*"):
        s.client.delete(name)


def _url(store) -> str:
    if store.url.startswith("file://"):
        return store.url
    kw = store.client.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/{kw['db']}?prefix={store.prefix}"


def _key(start: str = "") -> str:
    return start + hashlib.sha256(os.urandom(16)).hexdigest()[len(start) :]


def _cache(capsys, *args) -> tuple[int, str, str]:
    rc = main(["cache", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line_error(rc: int, err: str, *fragments: str) -> None:
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("omni-compile: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_ls_prints_the_listing_on_stdout(store, capsys):
    a, b = _key(), _key()
    store.put(a, b"x" * 2000, {"label": "regions/block.0.pt2"})
    store.put(b, b"y" * 1000, {"label": "regions/block.1.pt2"})
    rc, out, err = _cache(capsys, "ls", "--store", _url(store))
    assert rc == 0 and err == ""
    lines = out.strip().splitlines()
    assert len(lines) == 3, out
    assert {line.split()[0] for line in lines[:2]} == {a[:16], b[:16]}
    assert any(line.startswith(a[:16]) and line.endswith("regions/block.0.pt2") for line in lines)
    assert lines[2].startswith("2 entries, 0.0 MiB in ")
    rc, out, err = _cache(capsys, "ls", "--store", _url(store), "--json")
    assert rc == 0 and err == ""
    assert sorted(e["key"] for e in json.loads(out)) == sorted([a, b])


@pytest.mark.parametrize("key", ["UPPER", "../escape", "a/b", "x" * 129, ".hidden", "abc*"])
def test_rm_of_an_invalid_key_is_a_one_line_error(store, capsys, key):
    store.put(_key(), b"x")
    rc, out, err = _cache(capsys, "rm", key, "--store", _url(store))
    _one_line_error(rc, err, f"invalid cache key {key!r}", "64 hex characters", "at least 8")
    assert out == "" and len(store.list()) == 1


def test_rm_takes_the_prefix_ls_shows(store, capsys):
    keys = [_key() for _ in range(3)]
    for k in keys:
        store.put(k, b"z" * 100)
    rc, out, _ = _cache(capsys, "ls", "--store", _url(store))
    shown = [line.split()[0] for line in out.strip().splitlines()[:-1]]
    assert sorted(shown) == sorted(k[:16] for k in keys)

    rc, out, err = _cache(capsys, "rm", keys[0][:16], "--store", _url(store))
    assert rc == 0 and f"removed {keys[0]}" in err and "removed 1 of 1 entries" in err, err
    rc, out, err = _cache(capsys, "rm", keys[1][:8], keys[2], "--store", _url(store))  # 8 characters, a full key
    assert rc == 0 and "removed 2 of 2 entries" in err, err
    assert store.keys() == []


def test_rm_refuses_an_ambiguous_prefix_and_names_the_matches(store, capsys):
    a, b, other = _key("abcdef0123"), _key("abcdef0145"), _key("0" * 8)
    for k in (a, b, other):
        store.put(k, b"v")
    rc, _, err = _cache(capsys, "rm", other[:10], "abcdef01", "--store", _url(store))
    _one_line_error(rc, err, "'abcdef01' is ambiguous", a, b, "matches 2 entries")
    assert sorted(store.keys()) == sorted([a, b, other])  # all or nothing: `other` is still there
    rc, _, err = _cache(capsys, "rm", "abcdef012", "--store", _url(store))
    assert rc == 0 and f"removed {a}" in err and sorted(store.keys()) == sorted([b, other])


def test_rm_of_a_prefix_matching_nothing_or_too_short(store, capsys):
    k = _key("12345678")
    store.put(k, b"v")
    rc, _, err = _cache(capsys, "rm", "fedcba98", "--store", _url(store))
    _one_line_error(rc, err, "no entry", "'fedcba98'", "omni-compile cache ls")
    rc, _, err = _cache(capsys, "rm", "1234567", "--store", _url(store))
    _one_line_error(rc, err, "'1234567' is too short", "at least 8")
    assert store.keys() == [k]


def test_rm_takes_a_full_key_of_any_form(store, capsys):
    """Keys the store accepts but omni-compile does not make (tests, other tools) are removed by their full name."""
    store.put("k1", b"v")
    store.put("k10", b"v")
    rc, _, err = _cache(capsys, "rm", "k1", "--store", _url(store))
    assert rc == 0 and "removed 1 of 1 entries" in err and store.keys() == ["k10"]


def _artifact(tmp_path, key: str) -> tuple:
    art = tmp_path / "art"
    (art / "regions").mkdir(parents=True)
    data = os.urandom(300)
    (art / "regions" / "r.pt2").write_bytes(data)
    entry = {"signature": "s", "call": "1x16x32", "key": [], "file": "regions/r.pt2",
             "sha256": hashlib.sha256(data).hexdigest(), "graph_hash": "trace:x", "instances": ["blocks.0"],
             "passes": {}, "compile_seconds": 0.0, "cache_key": key, "region_identity": "trace:x", "source": "compiled"}
    build = {"mode": "aot", "format": "aoti-package", "region_call": "state+tensor-leaves", "dtype": "fp32",
             "device": "cpu", "buckets": ["64x64"], "text_len": None, "seed": 0, "example_inputs": None,
             "compile_config": {}, "compile_config_hash": "h"}
    manifest = {"schema": SCHEMA, "omni_compile_version": "0", "created": "", "pass_uuid": "u",
                "model": {"source": "m", "family": "generic", "class": "C", "config": {}, "config_hash": "h"},
                "weights": {"reference": "random seed 0", "seed": 0, "tensors": {}}, "build": build, "platform": {},
                "regions": [{"name": "r", "kind": "block", "class": "C", "instances": ["blocks.0"],
                             "buckets": {"64x64": [entry]}}],
                "attention": {}, "fusion": {}, "parity": {}, "timing": {}, "compilations": {}}  # fmt: skip
    (art / MANIFEST).write_text(json.dumps(manifest))
    return art, data


def test_only_push_creates_a_missing_file_store(tmp_path, capsys):
    root = tmp_path / "missing" / "store"
    url = f"file://{root}"
    rc, out, err = _cache(capsys, "ls", "--store", url)
    assert rc == 0 and out.strip() == f"0 entries, 0.0 MiB in {url}"
    assert "does not exist" in err and "cache push" in err, err
    rc, out, err = _cache(capsys, "ls", "--store", url, "--json")
    assert rc == 0 and json.loads(out) == [] and "does not exist" in err
    rc, out, err = _cache(capsys, "gc", "--store", url)
    assert rc == 0 and "does not exist" in err
    rc, out, err = _cache(capsys, "rm", _key(), "--store", url)
    _one_line_error(rc, err, "no entry", "does not exist")
    key = _key()
    art, data = _artifact(tmp_path, key)
    (art / "regions" / "r.pt2").unlink()
    rc, out, err = _cache(capsys, "pull", str(art), "--store", url)
    _one_line_error(rc, err, "has no entry for regions/r.pt2", "does not exist")
    assert not (tmp_path / "missing").exists()

    (art / "regions" / "r.pt2").write_bytes(data)
    rc, out, err = _cache(capsys, "push", str(art), "--store", url)
    assert rc == 0 and "pushed 1 of 1 files" in err and open_store(url).get(key).data == data
    (art / "regions" / "r.pt2").unlink()
    rc, out, err = _cache(capsys, "pull", str(art), "--store", url)
    assert rc == 0 and "pulled 1 of 1 files" in err and (art / "regions" / "r.pt2").read_bytes() == data


def test_a_file_in_place_of_the_store_directory_is_an_error(tmp_path, capsys):
    (tmp_path / "store").write_text("not a store")
    rc, _, err = _cache(capsys, "ls", "--store", f"file://{tmp_path / 'store'}")
    _one_line_error(rc, err, "is not a directory")


def test_the_command_prints_one_line_for_a_bad_key_and_creates_nothing(tmp_path, subprocess_env):
    """The real entry point, in a subprocess: no traceback, exit 2, no store directory made."""
    from test_cli import assert_user_error, cli

    proc = cli("cache", "rm", "NOT/A-KEY", "--store", f"file://{tmp_path / 'store'}", env=subprocess_env, timeout=120)
    assert_user_error(proc, "invalid cache key 'NOT/A-KEY': a key is the 64 hex characters")
    assert proc.stdout == "" and not (tmp_path / "store").exists()
