"""`omni-compile build --store URL`: nodes sharing compiled files through a real directory and a real Redis.

Each "node" is a separate CLI process with its own Inductor cache directory and output path. A file store's
first node is the session's flux-tiny artifact (`flux_artifact`, tests/conftest.py: two buckets, 16
AOTInductor packages), built into an empty file store, whose nodes then build its two buckets. Every other
build is of `generic_model:MiniDiT` (tests/generic_model.py: one block class and two glue projections, 3
packages, about 30 s on 2 CPU cores against flux-tiny's 70): what a store, a race or a failure mid-build does
is the same for any model.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import FLUX_ARTIFACT_BUCKETS, BackgroundRun, selected, with_tests_dir_on_path
from test_cache_store import RedisServer, _need_redis, redis_server  # noqa: F401  (fixture)
from test_cli import cli

pytestmark = pytest.mark.compile

SHAPE = "64x64"
FLUX = ("flux-tiny",)
MINI = ("generic_model:MiniDiT", "--example-inputs", "generic_model:mini_inputs")


def _env(subprocess_env, cache_dir) -> dict:
    """The CLI's environment with tests/ on PYTHONPATH (generic_model) and an Inductor cache of its own."""
    return with_tests_dir_on_path(subprocess_env, TORCHINDUCTOR_CACHE_DIR=str(cache_dir))


def _build(tmp_path, name, store, subprocess_env, *extra, shapes=SHAPE, model=MINI):
    env = _env(subprocess_env, tmp_path / f"inductor-{name}")
    out = tmp_path / name
    proc = cli("build", *model, "--shapes", shapes, "--out", str(out), "--store", store, *extra, env=env,
               timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "manifest.json").read_text()), proc.stderr


def _files(manifest):
    return {e["file"]: e for r in manifest["regions"] for es in r["buckets"].values() for e in es}


@pytest.fixture(scope="module")
def redis_url(redis_server):
    yield redis_server.url(0, "chunk_mb=1")


@pytest.fixture(scope="module")
def first_node(flux_artifact):
    """A first node's build into an empty file store: (manifest, artifact, store dir, its shapes), the
    session's flux-tiny artifact and store. Tests that need a published store copy it (shutil.copytree)
    and leave this one as it is."""
    m = json.loads((flux_artifact.path / "manifest.json").read_text())
    return m, flux_artifact.path, flux_artifact.store, ",".join(FLUX_ARTIFACT_BUCKETS)


def _copy_store(first_node, tmp_path) -> str:
    import shutil

    shutil.copytree(first_node[2], tmp_path / "shared")
    return f"file://{tmp_path / 'shared'}"


@pytest.fixture(params=["file", "redis"])
def published(request, tmp_path, first_node, subprocess_env):
    """(first node's manifest, the URL of a store it published into, its shapes, its model): a copy of the first
    node's file store (flux-tiny), or a Redis that a first node built MiniDiT into at SHAPE (a real second build:
    Redis is the point of the test)."""
    if request.param == "file":
        return first_node[0], _copy_store(first_node, tmp_path), first_node[3], FLUX
    url = request.getfixturevalue("redis_url")
    from omni_compile.cache import open_store

    open_store(url).client.flushdb()
    a, _ = _build(tmp_path, "node-a", url, subprocess_env)
    return a, url, SHAPE, MINI


def test_second_node_compiles_nothing_and_writes_the_same_files(tmp_path, published, subprocess_env):
    a, store_url, shapes, model = published
    buckets = shapes.split(",")
    assert a["build"]["buckets"] == buckets
    n = len(_files(a))
    assert a["compilations"]["aot_compiles"] == n and a["store"]["published"] == n and a["store"]["hits"] == 0
    b, err = _build(tmp_path, "node-b", store_url, subprocess_env, shapes=shapes, model=model)
    # nothing compiled, nothing exported (the store key comes from the recorded call's op trace)
    assert b["compilations"] == {"aot_compiles": 0, "region_exports": 0, "dynamo_graphs": 0}, b["compilations"]
    assert b["store"]["hits"] == n and b["store"]["misses"] == 0 and b["store"]["published"] == 0
    assert "from the store" in err and "hit(s)" in err
    fa, fb = _files(a), _files(b)
    assert {f: e["sha256"] for f, e in fa.items()} == {f: e["sha256"] for f, e in fb.items()}
    assert all(e["source"] == "store" for e in fb.values())
    # the keys do not depend on the output path, the time or the process: the same on both nodes
    assert {e["cache_key"] for e in fa.values()} == {e["cache_key"] for e in fb.values()}
    assert b["fusion"]["matches"] == a["fusion"]["matches"]  # pass results travel with the entries
    assert all(p["rel_l2_vs_eager"] < 1e-4 for p in b["parity"].values())
    # every file came from the store with the publisher's check of this bucket: not rerun, and said so
    by_store = dict.fromkeys(buckets, "by the publishing build (store)")
    assert {k: p["checked"] for k, p in b["parity"].items()} == by_store
    assert {k: p["checked"] for k, p in a["parity"].items()} == dict.fromkeys(buckets, "here")
    assert "checked by the store's publishing build" in err
    c, _ = _build(tmp_path, "node-c", store_url, subprocess_env, "--parity", "always", shapes=shapes, model=model)
    assert c["compilations"] == {"aot_compiles": 0, "region_exports": 0, "dynamo_graphs": 0}, c["compilations"]
    assert {k: p["checked"] for k, p in c["parity"].items()} == dict.fromkeys(buckets, "here")
    assert all(p["rel_l2_vs_eager"] < 1e-4 for p in c["parity"].values())


def test_corrupt_entry_is_rebuilt_and_replaced(tmp_path, first_node, subprocess_env):
    a, url = first_node[0], _copy_store(first_node, tmp_path)
    from omni_compile.cache import FileStore

    store = FileStore(tmp_path / "shared")
    victim = next(e for e in _files(a).values() if e["file"].startswith("regions/FluxTransformerBlock"))
    blob = store._blob_path(store.get(victim["cache_key"]).sha256)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x04
    blob.write_bytes(bytes(data))
    b, err = _build(tmp_path, "node-b", url, subprocess_env, shapes=first_node[3], model=FLUX)
    assert "is corrupt" in err and "replacing the entry" in err
    assert b["compilations"]["aot_compiles"] == 1 and b["store"]["repaired"] == 1
    assert b["compilations"]["region_exports"] == 1  # only the rebuilt region was exported
    assert {p["checked"] for p in b["parity"].values()} == {"here"}  # something was compiled here: checked here
    assert store.get(victim["cache_key"]) is not None  # verified again after the repair
    c, _ = _build(tmp_path, "node-c", url, subprocess_env, shapes=first_node[3], model=FLUX)
    assert c["compilations"]["aot_compiles"] == 0 and c["store"]["errors"] == []


def test_redis_stopped_mid_build_the_build_succeeds_locally(tmp_path, subprocess_env):
    _need_redis()
    server = RedisServer(tmp_path / "redis")
    env = _env(subprocess_env, tmp_path / "inductor")
    out = tmp_path / "art"
    proc = subprocess.Popen([sys.executable, "-P", "-m", "omni_compile.cli", "build", *MINI, "--shapes", SHAPE,
                             "--out", str(out), "--store", server.url(0, "timeout=2")], env=env,
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)  # fmt: skip
    lines = []
    stopped = False
    for line in proc.stderr:
        lines.append(line)
        if not stopped and "compiling glue" in line:  # the block's lookup answered, then the store dies
            server.stop()
            stopped = True
    assert proc.wait(600) == 0, "".join(lines[-30:])
    text = "".join(lines)
    assert stopped and "warning:" in text and "building locally without it" in text
    m = json.loads((out / "manifest.json").read_text())
    assert m["store"]["misses"] >= 1 and m["store"]["published"] == 0 and m["store"]["errors"], m["store"]
    assert m["compilations"]["aot_compiles"] == len(_files(m))
    assert all(p["rel_l2_vs_eager"] < 1e-4 for p in m["parity"].values())


UNREACHABLE = "redis://127.0.0.1:1/0?timeout=1"


@pytest.fixture(scope="module", autouse=True)
def unreachable_store_build(request, tmp_path_factory, subprocess_env):
    """(BackgroundRun, out) of test_unreachable_store_does_not_fail_the_build's build, started with this
    module's first test so that it runs beside the others (None when that test is not selected)."""
    if not selected(request, "test_unreachable_store_does_not_fail_the_build"):
        yield None
        return
    root = tmp_path_factory.mktemp("unreachable")
    env = _env(subprocess_env, root / "inductor-art")
    run = BackgroundRun([sys.executable, "-P", "-m", "omni_compile.cli", "build", *MINI, "--shapes", SHAPE,
                         "--out", str(root / "art"), "--store", UNREACHABLE], env, root / "log")  # fmt: skip
    yield run, root / "art"
    run.stop()


def test_unreachable_store_does_not_fail_the_build(unreachable_store_build):
    run, out = unreachable_store_build
    proc = run.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    m, err = json.loads((out / "manifest.json").read_text()), proc.stderr
    assert "building locally without it" in err and m["store"]["hits"] == 0 and m["store"]["published"] == 0
    assert m["compilations"]["aot_compiles"] == len(_files(m))
    assert run.seconds < 600


def test_cache_cli_ls_push_pull_rm_gc(tmp_path, first_node, subprocess_env):
    import shutil

    a = first_node[0]
    shutil.copytree(first_node[1], tmp_path / "node-a")
    url = f"file://{tmp_path / 'second'}"
    proc = cli("cache", "push", str(tmp_path / "node-a"), "--store", url, env=subprocess_env)
    n = len(_files(a))
    assert proc.returncode == 0 and f"pushed {n} of {n} files" in proc.stderr, proc.stderr
    proc = cli("cache", "ls", "--store", url, "--json", env=subprocess_env)
    listed = json.loads(proc.stdout)
    assert sorted(e["key"] for e in listed) == sorted(e["cache_key"] for e in _files(a).values())
    victim = next(iter(_files(a).values()))
    (tmp_path / "node-a" / victim["file"]).unlink()
    proc = cli("cache", "pull", str(tmp_path / "node-a"), "--store", url, env=subprocess_env)
    assert proc.returncode == 0 and f"pulled 1 of {n} files" in proc.stderr, proc.stderr
    assert cli("verify", str(tmp_path / "node-a"), env=subprocess_env).returncode == 0
    proc = cli("cache", "rm", victim["cache_key"], "--store", url, env=subprocess_env)
    assert proc.returncode == 0 and "removed 1 of 1" in proc.stderr
    proc = cli("cache", "gc", "--store", url, env=subprocess_env)
    assert proc.returncode == 0 and "1 blobs" in proc.stderr, proc.stderr
    proc = cli("cache", "ls", "--store", "ftp://x", env=subprocess_env)
    assert proc.returncode == 2 and "unsupported store URL" in proc.stderr


BUILDER = r"""
import json, sys
from omni_compile.builder import BuildEvents, BuildOptions, build
m = build(BuildOptions(model="generic_model:MiniDiT", example_inputs="generic_model:mini_inputs", shapes=sys.argv[1],
                       out=sys.argv[2], store=sys.argv[3]), BuildEvents())
print("RESULT " + json.dumps({"store": m["store"], "compilations": m["compilations"]}))
"""


def test_concurrent_builders_leave_one_valid_entry_per_key(tmp_path, redis_url, subprocess_env):
    """Two builders of one model racing on one Redis (each compiles every file: a full build each, so two,
    not more; eight writers racing on one key are tests/test_cache_store.py's, at the store's level)."""
    from omni_compile.cache import open_store

    store = open_store(redis_url)
    store.client.flushdb()
    procs = []
    for i in range(2):
        env = _env(subprocess_env, tmp_path / f"inductor-{i}")
        procs.append(subprocess.Popen([sys.executable, "-P", "-c", BUILDER, SHAPE, str(tmp_path / f"art-{i}"), redis_url],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))  # fmt: skip
    outs = [p.communicate(timeout=1500) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs if err]
    results = [json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:]) for out, _ in outs]
    assert all(r["store"]["errors"] == [] for r in results)
    keys = set()
    for i in range(2):
        keys |= {e["cache_key"] for e in _files(json.loads((tmp_path / f"art-{i}" / "manifest.json").read_text())).values()}
    entries = store.list()
    assert sorted(e.key for e in entries) == sorted(keys)
    assert all(store.get(k) is not None for k in keys)  # each one verifies


def test_store_with_jit_mode_is_refused(tmp_path, subprocess_env):
    proc = cli("build", "flux-tiny", "--mode", "jit", "--store", f"file://{tmp_path}", "--out", str(tmp_path / "o"),
               env=subprocess_env)  # fmt: skip
    assert proc.returncode == 2 and "--mode jit --store needs a redis:// store" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "o").exists()


def _jit(tmp_path, name, store, subprocess_env):
    env = _env(subprocess_env, tmp_path / f"inductor-{name}")
    proc = cli("build", *MINI, "--mode", "jit", "--shapes", SHAPE, "--out", str(tmp_path / name), "--store",
               store, env=env, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / name / "build_report.json").read_text()), proc.stderr


def test_jit_mode_shares_inductor_remote_caches_through_redis(tmp_path, redis_url, subprocess_env):
    """--mode jit --store redis://: Inductor's remote FX-graph cache on our Redis. Two nodes with their own
    empty local caches: the first misses and writes, the second hits every graph from Redis."""
    from omni_compile.cache import open_store

    client = open_store(redis_url).client
    client.flushdb()
    a, _ = _jit(tmp_path, "a", redis_url, subprocess_env)
    st = a["compiler"]["store"]
    assert st["reachable"] and st["fxgraph_cache_miss"] == 1 and st["fxgraph_cache_hit"] == 0  # MiniDiT: one block
    assert client.dbsize() > 0  # torch wrote its entries there
    b, err = _jit(tmp_path, "b", redis_url, subprocess_env)
    st = b["compiler"]["store"]
    assert st["fxgraph_cache_hit"] == 1 and st["fxgraph_cache_miss"] == 0, st
    assert "FX graph cache 1 hit(s), 0 miss(es)" in err
    assert "TORCHINDUCTOR_REDIS_URL" not in subprocess_env


def test_jit_mode_with_unreachable_redis_builds_locally(tmp_path, subprocess_env):
    r, err = _jit(tmp_path, "a", "redis://127.0.0.1:1/0?timeout=1", subprocess_env)
    assert "warning:" in err and "compiling with the local Inductor caches only" in err
    st = r["compiler"]["store"]
    assert st["reachable"] is False and st["fxgraph_cache_miss"] == 1
