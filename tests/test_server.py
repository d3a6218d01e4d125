"""End to end: the real `omni-compile serve` in a subprocess on a loopback port, against the session's
flux-tiny artifact (`flux_artifact`, tests/conftest.py: buckets 64x64 and 64x128, served as the sizes
64x64 and 128x64). Two servers: A (preset pipeline in memory, --api-key, a large queue) and B (the same
pipeline written to a directory and passed with --pipeline, a queue of 1)."""

from __future__ import annotations

import base64
import http.client
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from conftest import FLUX_ARTIFACT_BUCKETS

pytestmark = pytest.mark.compile

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _cli(*args, env, timeout=600, **kw):
    return subprocess.run([sys.executable, "-P", "-m", "omni_compile.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, **kw)  # fmt: skip


# The artifact's buckets (HEIGHTxWIDTH) as the sizes it serves, WIDTHxHEIGHT as OpenAI writes them
SIZES = ["64x64", "128x64"]


@pytest.fixture(scope="session")
def tiny_artifact(flux_artifact) -> Path:
    """The session's flux-tiny artifact, read-only (test_corrupt_artifact_refused changes a copy)."""
    assert FLUX_ARTIFACT_BUCKETS == ["64x64", "64x128"]  # SIZES
    return flux_artifact.path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(port, path, body=None, headers=None, method=None, raw: bytes | None = None, timeout=120):
    """(status, parsed JSON body or text) of one HTTP call to the server on 127.0.0.1:port."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


class Server:
    def __init__(self, artifact, env, log: Path, *extra):
        self.port = _free_port()
        self.log_path = log
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "omni_compile.cli", "serve", str(artifact), "--host", "127.0.0.1",
             "--port", str(self.port), *extra], env=env, stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def wait_healthy(self, limit=180) -> None:
        for _ in range(int(limit / 0.25)):
            assert self.proc.poll() is None, self.text()
            try:
                status, _ = call(self.port, "/health", timeout=5)
            except OSError:  # not listening yet
                status = None
            if status == 200:
                return
            time.sleep(0.25)
        raise AssertionError("server never became healthy:\n" + self.text())

    def text(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def metric(self, name: str, headers=None) -> float:
        _, text = call(self.port, "/metrics", headers=headers)
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        assert m, f"{name} not in /metrics"
        return float(m.group(1))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


@pytest.fixture(scope="module")
def server_a(tiny_artifact, subprocess_env, tmp_path_factory):
    s = Server(tiny_artifact, subprocess_env, tmp_path_factory.mktemp("logs") / "a.log", "--api-key", KEY,
               "--max-queue", "64", "--default-steps", "2", "--max-steps", "5000")  # fmt: skip
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory, subprocess_env) -> Path:
    out = tmp_path_factory.mktemp("pipe") / "flux-tiny-pipeline"
    proc = _cli("pipeline", "flux-tiny", "--out", str(out), env=subprocess_env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "model_index.json").is_file() and (out / "transformer" / "config.json").is_file()
    return out


def _pixels(b64: str):
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=np.int16)


def gen(port, headers=AUTH, **body):
    return call(port, "/v1/images/generations", {"prompt": "a red cat", "size": "64x64", **body}, headers=headers)


def test_same_seed_same_bytes(server_a):
    s1, r1 = gen(server_a.port, seed=7, num_inference_steps=3)
    s2, r2 = gen(server_a.port, seed=7, num_inference_steps=3)
    s3, r3 = gen(server_a.port, seed=8, num_inference_steps=3)
    s4, r4 = gen(server_a.port, seed=7, num_inference_steps=3, n=2)
    assert (s1, s2, s3, s4) == (200, 200, 200, 200)
    png = base64.b64decode(r1["data"][0]["b64_json"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert r1["data"][0]["b64_json"] == r2["data"][0]["b64_json"]
    assert r1["data"][0]["b64_json"] != r3["data"][0]["b64_json"]
    # image i of a request is drawn with seed + i: n=2 from seed 7 gives the seed-7 and seed-8 images
    assert [d["seed"] for d in r4["data"]] == [7, 8]
    assert [d["b64_json"] for d in r4["data"]] == [r1["data"][0]["b64_json"], r3["data"][0]["b64_json"]]


def test_models_health_auth(server_a):
    assert call(server_a.port, "/health") == (200, {"status": "ok"})  # no key needed
    status, body = call(server_a.port, "/v1/models", headers=AUTH)
    assert status == 200 and body["data"][0]["sizes"] == SIZES and body["data"][0]["compiled"] is True
    for path in ("/v1/models", "/metrics"):
        status, body = call(server_a.port, path)
        assert status == 401 and body["error"]["type"] == "authentication_error"
    status, body = gen(server_a.port, headers={"Authorization": "Bearer wrong"})
    assert status == 401


def test_openai_client_images(server_a):
    """The official `openai` client against the server: images.generate with b64_json draws the bytes of the same
    request sent as plain JSON; our errors reach it as its typed exceptions, with code and param."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server_a.port}/v1", api_key=KEY, max_retries=0)
    out = client.images.generate(model="flux-tiny", prompt="a red cat", size="64x64", response_format="b64_json",
                                 extra_body={"seed": 7, "num_inference_steps": 3})  # fmt: skip
    status, ref = gen(server_a.port, seed=7, num_inference_steps=3)
    assert status == 200 and [d.b64_json for d in out.data] == [ref["data"][0]["b64_json"]]
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(prompt="a red cat", size="128x128")
    assert (info.value.code, info.value.param) == ("unsupported_size", "size")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0).images.generate(prompt="a red cat")


def test_concurrent_requests(server_a):
    before = server_a.metric('omni_serve_requests_total{status="200"}', AUTH)
    results = [None] * 32

    def one(i):
        results[i] = gen(server_a.port, seed=100 + i, num_inference_steps=1)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [r[0] for r in results] == [200] * 32
    assert len({r[1]["data"][0]["b64_json"] for r in results}) == 32  # 32 seeds, 32 different images
    assert server_a.metric('omni_serve_requests_total{status="200"}', AUTH) == before + 32
    assert server_a.metric("omni_serve_queue_depth", AUTH) == 0
    assert "Traceback" not in server_a.text() and "ERROR" not in server_a.text()


BAD = [
    ({"size": "128x128"}, 400, "size", "64x64"),
    ({"size": "big"}, 400, "size", "WIDTHxHEIGHT"),
    ({"n": 0}, 400, "n", "between 1 and 4"),
    ({"n": 5}, 400, "n", "between 1 and 4"),
    ({"num_inference_steps": 0}, 400, "num_inference_steps", "between 1 and 5000"),
    ({"num_inference_steps": 5001}, 400, "num_inference_steps", "between 1 and 5000"),
    ({"prompt": "a red cat sitting on the big old house"}, 400, "prompt", "tokens"),
    ({"prompt": "   "}, 400, "prompt", "empty"),
    ({"response_format": "url"}, 400, "response_format", "b64_json"),
    ({"model": "other"}, 400, "model", "not served"),
    ({"guidance_scale": -1}, 400, "guidance_scale", "between 0 and 100"),
    ({"prompt": 5}, 422, "prompt", "valid string"),
    ({"n": "two"}, 422, "n", "valid integer"),
    ({"seed": 1.5}, 422, "seed", "valid integer"),
]


def test_bad_input_then_serves(server_a):
    before = server_a.metric('omni_serve_requests_total{status="400"}', AUTH)
    for body, status, param, words in BAD:
        got, err = gen(server_a.port, **body)
        assert got == status, (body, err)
        assert err["error"]["param"] == param and words in err["error"]["message"], (body, err)
    assert server_a.metric('omni_serve_requests_total{status="400"}', AUTH) == before + 11
    status, err = call(server_a.port, "/v1/images/generations", raw=b"{not json", headers=AUTH)
    assert status == 422 and err["error"]["code"] == "invalid_json"
    status, err = call(server_a.port, "/v1/images/generations", {"size": "64x64"}, headers=AUTH)
    assert status == 422 and "prompt" in err["error"]["message"]
    big = json.dumps({"prompt": "a" * (1 << 20)}).encode()
    status, err = call(server_a.port, "/v1/images/generations", raw=big, headers=AUTH)
    assert status == 413 and "larger than" in err["error"]["message"]
    conn = http.client.HTTPConnection("127.0.0.1", server_a.port, timeout=120)
    try:  # an iterable body goes as Transfer-Encoding: chunked, with no Content-Length
        conn.request("POST", "/v1/images/generations", body=iter([big[: 1 << 19], big[1 << 19 :]]), headers=AUTH)
        resp = conn.getresponse()
        status, err = resp.status, json.loads(resp.read())
    finally:
        conn.close()
    assert status == 413 and err["error"]["type"] == "invalid_request_error"
    assert "larger than" in err["error"]["message"]
    status, err = call(server_a.port, "/nowhere", headers=AUTH)
    assert status == 404 and "error" in err
    assert server_a.metric("omni_serve_queue_depth", AUTH) == 0
    assert gen(server_a.port, seed=1, num_inference_steps=1)[0] == 200  # and it still serves


def test_metrics(server_a):
    _, text = call(server_a.port, "/metrics", headers=AUTH)
    for name in ("omni_serve_requests_total", "omni_serve_request_seconds_bucket", "omni_serve_queue_depth",
                 "omni_serve_step_seconds_count", 'omni_serve_transformer_steps_total{path="compiled"}',
                 'omni_serve_transformer_steps_total{path="fallback"} 0', "omni_serve_ready 1"):  # fmt: skip
        assert name in text
    steps = server_a.metric('omni_serve_transformer_steps_total{path="compiled"}', AUTH)
    assert gen(server_a.port, seed=2, num_inference_steps=3)[0] == 200
    assert server_a.metric('omni_serve_transformer_steps_total{path="compiled"}', AUTH) == steps + 3


def test_disconnected_client_dropped(server_a):
    """A client that goes away mid-request: its work stops at a step boundary, and the server goes on."""
    steps = server_a.metric("omni_serve_step_seconds_count", AUTH)
    body = json.dumps({"prompt": "a red cat", "size": "64x64", "num_inference_steps": 5000}).encode()
    sock = socket.create_connection(("127.0.0.1", server_a.port))
    sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    for _ in range(600):
        if server_a.metric("omni_serve_step_seconds_count", AUTH) > steps:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the request never started")
    sock.close()
    for _ in range(600):
        if server_a.metric('omni_serve_dropped_total{reason="disconnected"}', AUTH) == 1:
            break
        time.sleep(0.05)
    assert server_a.metric('omni_serve_dropped_total{reason="disconnected"}', AUTH) == 1
    assert server_a.metric("omni_serve_step_seconds_count", AUTH) - steps < 5000  # it stopped early
    assert gen(server_a.port, seed=1, num_inference_steps=1)[0] == 200
    assert "Traceback" not in server_a.text() and "ERROR" not in server_a.text()


def test_pipeline_dir_queue_full_and_sigterm(server_a, tiny_artifact, pipeline_dir, subprocess_env, tmp_path):
    """Server B reads the pipeline directory; it draws the same images as A (same seeded weights), answers
    429 when its queue of 1 is full, and on SIGTERM finishes the request in flight, then exits 0."""
    b = Server(tiny_artifact, subprocess_env, tmp_path / "b.log", "--pipeline", str(pipeline_dir),
               "--max-queue", "1")  # fmt: skip
    try:
        b.wait_healthy()
        status, body = call(b.port, "/v1/models")
        assert body["data"][0]["pipeline"] == str(pipeline_dir)
        ra, rb = gen(server_a.port, seed=7, num_inference_steps=3), gen(b.port, headers=None, seed=7, num_inference_steps=3)
        # same seeded weights read another way (from the directory): equal up to float rounding, not bytes
        pa, pb = (_pixels(r[1]["data"][0]["b64_json"]) for r in (ra, rb))
        assert pa.shape == pb.shape == (64, 64, 3) and np.abs(pa - pb).max() <= 2

        results = [None] * 6

        def one(i):
            results[i] = gen(b.port, headers=None, seed=i, num_inference_steps=20)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        statuses = sorted(r[0] for r in results)
        assert set(statuses) == {200, 429} and statuses.count(200) >= 2, statuses
        full = next(r[1] for r in results if r[0] == 429)
        assert full["error"]["type"] == "overloaded_error" and "queue is full" in full["error"]["message"]
        assert b.metric("omni_serve_queue_depth") == 0
        assert gen(b.port, headers=None, seed=1, num_inference_steps=1)[0] == 200

        # SIGTERM while a request runs: it finishes with 200, then the process exits 0
        steps = b.metric("omni_serve_step_seconds_count")
        box = {}
        t = threading.Thread(target=lambda: box.update(r=gen(b.port, headers=None, seed=3, num_inference_steps=60)))
        t.start()
        for _ in range(400):
            if b.metric("omni_serve_step_seconds_count") > steps:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the request never started")
        b.proc.send_signal(signal.SIGTERM)
        t.join(300)
        assert box["r"][0] == 200 and len(box["r"][1]["data"]) == 1
        assert b.proc.wait(120) == 0
        assert "Traceback" not in b.text()
    finally:
        b.stop()


def test_corrupt_artifact_refused(tiny_artifact, subprocess_env, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_artifact, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    victim = bad / manifest["regions"][0]["buckets"]["64x64"][0]["file"]
    victim.write_bytes(victim.read_bytes()[:-1] + bytes([victim.read_bytes()[-1] ^ 1]))
    proc = _cli("serve", str(bad), "--port", str(_free_port()), env=subprocess_env, timeout=120)
    assert proc.returncode == 2
    assert "fails its checksum" in proc.stderr and "rebuild the artifact" in proc.stderr
    os.remove(bad / "manifest.json")
    proc = _cli("serve", str(bad), "--port", str(_free_port()), env=subprocess_env, timeout=120)
    assert proc.returncode == 2 and "manifest.json" in proc.stderr


def test_port_in_use_refused_before_loading(tiny_artifact, subprocess_env):
    """A port another process listens on: one line naming it and exit 2, before the pipeline loads (uvicorn
    itself binds only after the lifespan has loaded everything)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _cli("serve", str(tiny_artifact), "--port", str(port), env=subprocess_env, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"omni-compile: error: cannot listen on 127.0.0.1:{port}: the port is already in use by another process; "
        "stop that process or pick another --port"
    )
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output and "serving" not in output and "pipeline loaded" not in output


def test_start_reads_the_manifest_and_hashes_the_files_once(tiny_artifact, monkeypatch):
    """What `omni-compile serve` does before and while loading: `check` once, then the pipeline load takes its
    result; neither reads the manifest nor hashes the files again."""
    from omni_compile.artifact import loader, manifest
    from omni_compile.server.config import ServeConfig
    from omni_compile.server.pipeline import load_pipeline

    calls = {"read": 0, "hash": 0}

    def counting(fn, key):
        def wrapped(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)

        return wrapped

    for module in (loader, manifest):
        monkeypatch.setattr(module, "read_manifest", counting(manifest.read_manifest, "read"))
    monkeypatch.setattr(loader, "verify_files", counting(loader.verify_files, "hash"))
    checked = loader.check(tiny_artifact, device="cpu")
    assert calls == {"read": 1, "hash": 1}
    pipe = load_pipeline(ServeConfig(artifact=str(tiny_artifact), device="cpu"), checked=checked)
    assert calls == {"read": 1, "hash": 1}
    assert pipe.pipe.transformer._omni_artifact.manifest is checked[0]


def test_step_cache_per_request(server_a, tiny_artifact, subprocess_env, tmp_path):
    """A server started with --step-cache: its default on requests that say nothing, a request's own setting, and
    'off', which draws server A's bytes (no step caching there). The computed share is in the response and
    /metrics; a bad setting is a 400, and server A refuses any setting with the flag to use."""
    c = Server(tiny_artifact, subprocess_env, tmp_path / "c.log", "--step-cache", "schedule:0.5")
    try:
        c.wait_healthy()
        status, body = gen(c.port, headers=None, seed=3, num_inference_steps=6)
        assert status == 200, body
        # warm-up 2, then every other one of the 4 others: 4 of the 6 calls (no CFG: one call a step)
        assert body["step_cache"] == {"setting": "schedule:0.5:2", "fraction_computed": 0.6667}
        status, own = gen(c.port, headers=None, seed=3, num_inference_steps=6, step_cache="first_block:1")
        assert status == 200, own
        assert own["step_cache"] == {"setting": "first_block:1:2", "fraction_computed": round(2 / 6, 4)}  # warm-up only
        status, off = gen(c.port, headers=None, seed=3, num_inference_steps=6, step_cache="off")
        assert off["step_cache"] == {"setting": "off", "fraction_computed": 1.0}
        status, plain = gen(server_a.port, seed=3, num_inference_steps=6)
        assert "step_cache" not in plain
        assert off["data"][0]["b64_json"] == plain["data"][0]["b64_json"]  # off: every block, the same bytes
        assert body["data"][0]["b64_json"] != plain["data"][0]["b64_json"]
        assert c.metric('omni_serve_step_cache_calls_total{result="computed"}') == 4 + 2 + 6
        assert c.metric('omni_serve_step_cache_calls_total{result="skipped"}') == 2 + 4
        status, bad = gen(c.port, headers=None, step_cache="schedule:2")
        assert status == 400 and bad["error"]["param"] == "step_cache", bad
        assert "fraction must be a number in (0, 1], not 2.0" in bad["error"]["message"]
        status, bad = gen(server_a.port, step_cache="schedule:0.5")
        assert status == 400 and "start it with --step-cache" in bad["error"]["message"]
        assert gen(server_a.port, step_cache="off")[0] == 200
        assert "Traceback" not in c.text()
    finally:
        c.stop()


def test_lora_load_apply_unload(server_a, tmp_path):
    """POST /v1/loras loads a LoRA, a request's `lora` merges it for its batch, the next request without one gets
    the base image bit for bit, DELETE removes it; bad names, scales and files are 400s naming what was wrong."""
    import torch
    from safetensors.torch import save_file
    from test_lora import _flux_tiny, _write_lora

    model, _ = _flux_tiny()  # the artifact's config: the LoRA is made to fit it
    path = tmp_path / "style.safetensors"
    _write_lora(path, model)
    port = server_a.port
    status, base = gen(port, seed=5, num_inference_steps=2)
    assert status == 200
    status, body = call(port, "/v1/loras", {"name": "style", "path": str(path)}, headers=AUTH)
    assert (status, body) == (201, {"name": "style", "modules": 4, "rank": 4})
    try:
        status, body = call(port, "/v1/loras", {"name": "style", "path": str(path)}, headers=AUTH)
        assert status == 409 and "already loaded" in body["error"]["message"]
        status, styled = gen(port, seed=5, num_inference_steps=2, lora={"name": "style", "scale": 1.0})
        assert status == 200 and styled["data"][0]["b64_json"] != base["data"][0]["b64_json"]
        status, listed = call(port, "/v1/loras", headers=AUTH)
        assert listed["active"] == {"name": "style", "scale": 1.0} and listed["loaded"]["style"]["modules"] == 4
        status, again = gen(port, seed=5, num_inference_steps=2)  # no lora: the base weights back
        assert status == 200 and again["data"][0]["b64_json"] == base["data"][0]["b64_json"]
        for lora, param, message in (({"name": "nope"}, "lora.name", "no LoRA named 'nope' is loaded (loaded: style"),
                                     ({"name": "style", "scale": 50}, "lora.scale", "scale must be from -10 to 10")):  # fmt: skip
            status, body = gen(port, seed=5, num_inference_steps=2, lora=lora)
            assert status == 400 and body["error"]["param"] == param and message in body["error"]["message"], body
        save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 7),
                   "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(8, 4)},
                  str(tmp_path / "bad.safetensors"))  # fmt: skip
        status, body = call(port, "/v1/loras", {"name": "bad", "path": str(tmp_path / "bad.safetensors")}, headers=AUTH)
        assert status == 400 and "transformer_blocks.0.attn.to_q: lora_A [4, 7]" in body["error"]["message"]
        status, body = call(port, "/v1/loras", {"name": "gone", "path": str(tmp_path / "none")}, headers=AUTH)
        assert status == 400 and "no file" in body["error"]["message"]
    finally:
        status, body = call(port, "/v1/loras/style", method="DELETE", headers=AUTH)
    assert (status, body) == (200, {"name": "style", "deleted": True})
    status, body = call(port, "/v1/loras/style", method="DELETE", headers=AUTH)
    assert status == 404 and "no LoRA named 'style'" in body["error"]["message"]
    status, body = gen(port, seed=5, num_inference_steps=2, lora={"name": "style"})
    assert status == 400


def test_serve_another_checkpoint(tiny_artifact, tmp_path):
    """--weights DIR: the artifact serves another checkpoint of its architecture with zero compiles (the weights
    bound are the directory's); a checkpoint of another config is refused with the difference named."""
    import torch

    import omni_compile
    from omni_compile.artifact.manifest import ArtifactError
    from omni_compile.models import resolve_model
    from omni_compile.server import ServeConfig
    from omni_compile.server.pipeline import load_pipeline, weights_dir

    other = resolve_model("flux-tiny").load(dtype=torch.float32, device="cpu", seed=123)
    other.save_pretrained(tmp_path / "ckpt")
    with omni_compile.counters.expect(regions_compiled=0, aot_compiles=0):
        pipe = load_pipeline(ServeConfig(artifact=str(tiny_artifact), weights=str(tmp_path / "ckpt")))
    served = pipe.pipe.transformer.state_dict()
    assert all(torch.equal(served[k], v) for k, v in other.state_dict().items())
    assert pipe.compiled and len(pipe.run(["a red cat"], [5], 64, 64, 2, 3.5)) == 1
    wider = resolve_model("flux-tiny", model_config={"num_layers": 3}).load(dtype=torch.float32, device="cpu", seed=1)
    wider.save_pretrained(tmp_path / "wider")
    with pytest.raises(ArtifactError, match="config differs from the one the artifact was compiled for.*num_layers"):
        load_pipeline(ServeConfig(artifact=str(tiny_artifact), weights=str(tmp_path / "wider")))
    with pytest.raises(omni_compile.ConfigError, match="is not a diffusers transformer directory"):
        weights_dir(str(tmp_path))
