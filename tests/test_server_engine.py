"""The server's engine, schemas and app without a model: a fake pipeline stands in for FLUX."""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import http.client
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from omni_compile.server import ServeConfig, build_app
from omni_compile.server.engine import Engine, Job, split_batch
from omni_compile.server.metrics import Metrics
from omni_compile.server.pipeline import Bucket
from omni_compile.server.schemas import ImageRequest, RequestError, parse_size, validate


class FakePipeline:
    """Runs "images" as the bytes of (prompt, seed); can be told to fail, block or die."""

    compiled = True
    dynamic = None  # no --dynamic range: the buckets only
    text_len = 8
    source = "fake"
    seconds: dict = {}
    loras = None  # no LoRA set

    def __init__(self, buckets=((64, 64, 1),)):
        self.buckets = [Bucket(*b) for b in buckets]
        self.calls: list[list[int]] = []
        self.step_cache_args: list[dict] = []
        self.fail: BaseException | None = None
        self.gate = threading.Event()
        self.gate.set()

    @property
    def sizes(self):
        return list(dict.fromkeys(f"{b.width}x{b.height}" for b in self.buckets))

    def batch_sizes(self, height, width):
        return sorted({b.batch for b in self.buckets if (b.height, b.width) == (height, width)}) or [1]

    def prompt_error(self, prompt):
        return "too long" if len(prompt.split()) > 6 else None

    def run(self, prompts, seeds, height, width, steps, guidance, on_step=None, **step_cache):
        self.calls.append(list(seeds))
        self.step_cache_args.append(step_cache)
        self.last_calls = (steps, steps - 1)  # as a step-cached run reports: calls, computed calls
        for i in range(steps):
            self.gate.wait(10)
            if self.fail is not None:
                err, self.fail = self.fail, None
                raise err
            if on_step:
                on_step(i)
        return [f"{p}|{s}".encode() for p, s in zip(prompts, seeds)]


def job(n=1, seed=0, steps=2, deadline=60.0, **kw):
    return Job(prompt="a cat", n=n, seed=seed, height=64, width=64, steps=steps, guidance=3.5,
               deadline=time.monotonic() + deadline, **kw)  # fmt: skip


def engine(pipe, **kw) -> Engine:
    e = Engine(pipe, Metrics(), max_queue=kw.pop("max_queue", 4), max_batch=kw.pop("max_batch", 1), **kw)
    e.start()
    for _ in range(200):
        if e.ready:
            return e
        time.sleep(0.01)
    raise AssertionError("engine never ready")


def test_split_batch():
    assert split_batch(4, [1]) == [1, 1, 1, 1]
    assert split_batch(5, [1, 2]) == [2, 2, 1]
    assert split_batch(4, [2, 4]) == [4]
    assert split_batch(3, [2]) is None
    assert split_batch(6, [4, 3]) == [3, 3]


def test_images_by_seed_and_batching():
    pipe = FakePipeline(buckets=((64, 64, 1), (64, 64, 2)))
    pipe.gate.clear()
    e = engine(pipe, max_batch=2)
    first = e.submit(job(seed=50))  # runs alone while the gate is closed...
    time.sleep(0.1)
    a, b = e.submit(job(seed=10)), e.submit(job(seed=20))  # ...these two queue and run as one batch of 2
    pipe.gate.set()
    assert first.result(10) == [(50, b"a cat|50")]
    assert a.result(10) == [(10, b"a cat|10")] and b.result(10) == [(20, b"a cat|20")]
    assert pipe.calls[-1] == [10, 20]
    assert e.submit(job(n=3, seed=5)).result(10) == [(5, b"a cat|5"), (6, b"a cat|6"), (7, b"a cat|7")]
    assert pipe.calls[-2:] == [[5, 6], [7]]
    e.stop(10)
    assert e.state == "stopped" and e.metrics.count("images") == 6 and e.metrics.count("batches") == 4


def test_queue_full_and_error_recovery():
    pipe = FakePipeline()
    pipe.gate.clear()
    e = engine(pipe, max_queue=1)
    running = e.submit(job())
    time.sleep(0.1)
    queued = e.submit(job(seed=1))
    with pytest.raises(RequestError) as info:
        e.submit(job(seed=2))
    assert info.value.status == 429 and e.depth() == 1
    pipe.fail = MemoryError("out of memory (fake)")
    pipe.gate.set()
    with pytest.raises(RequestError) as info:
        running.result(10)
    assert info.value.status == 500 and "out of memory" in info.value.body.message
    assert queued.result(10) == [(1, b"a cat|1")]  # the worker went on
    assert e.ready and e.alive
    e.stop(10)


def test_worker_death_fails_waiting_jobs():
    pipe = FakePipeline()
    pipe.gate.clear()
    e = engine(pipe)
    running = e.submit(job())
    time.sleep(0.1)
    waiting = e.submit(job(seed=1))
    pipe.fail = SystemExit("fatal")  # not an Exception: ends the worker
    pipe.gate.set()
    with pytest.raises(RequestError) as info:
        waiting.result(10)
    assert info.value.status == 503
    e.thread.join(10)
    assert not e.alive and not e.ready and "fatal" in e.error
    with pytest.raises(RequestError) as info:
        e.submit(job())
    assert info.value.status == 503
    with pytest.raises(RequestError) as info:
        running.result(10)  # the job it was running fails too: no client hangs
    assert info.value.status == 503


def test_gone_jobs_dropped_at_step_boundary():
    pipe = FakePipeline()
    pipe.gate.clear()
    e = engine(pipe)
    j = job(steps=50)
    fut = e.submit(j)
    time.sleep(0.1)
    queued = job(seed=1)
    e.submit(queued)
    queued.gone = "disconnected"
    e.forget(queued)  # leaves the queue at once
    assert e.depth() == 0
    j.gone = "disconnected"
    pipe.gate.set()
    with pytest.raises(RequestError):
        fut.result(10)
    e.stop(10)
    assert len(pipe.calls) == 1 and e.metrics.count("transformer_steps", "compiled") == 1  # stopped after its first step
    assert e.metrics.count("dropped", "disconnected") == 2 and e.metrics.count("dropped", "deadline") == 0
    expired = job(deadline=-1)
    e2 = engine(FakePipeline())
    with pytest.raises(RequestError) as info:
        e2.submit(expired).result(10)
    assert info.value.status == 504 and e2.runner.calls == []
    e2.stop(10)


def test_validate():
    kw = dict(sizes=["128x64"], default_size="128x64", max_n=4, max_steps=50, default_steps=28, model_name="m",
              any_size=False)  # fmt: skip
    assert parse_size("128x64") == (64, 128)  # WIDTHxHEIGHT in, (height, width) out
    assert validate(ImageRequest(prompt="x", size="128x64"), **kw) == (64, 128, 28)
    with pytest.raises(RequestError, match="128x64"):
        validate(ImageRequest(prompt="x", size="64x128"), **kw)
    assert validate(ImageRequest(prompt="x", size="64x128"), **{**kw, "any_size": True}) == (128, 64, 28)
    with pytest.raises(RequestError, match="num_inference_steps"):
        validate(ImageRequest(prompt="x", num_inference_steps=51), **kw)


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port, path, headers=None, method="GET"):
    """(status, parsed JSON body, or the text when it is not JSON) of one call."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


@contextlib.contextmanager
def _serving(app):
    """Runs `app` under uvicorn on a loopback port in a thread until /health is 200; yields the port."""
    import uvicorn

    port = _port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if server.started and _get(port, "/health")[0] == 200:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the app never became healthy")
        yield port
    finally:
        server.should_exit = True
        thread.join(30)


def _chunked_post(port, path, body: bytes, chunk: int, pause: float = 0.0):
    """(status, JSON body) of a POST whose body goes as `Transfer-Encoding: chunked` (no Content-Length),
    `chunk` bytes a chunk, written on a raw socket: all at once, or with `pause` seconds before each chunk (so
    that the server receives the body in several parts)."""
    head = "Host: test\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    pieces = [b"%x\r\n%s\r\n" % (len(c), c) for c in (body[i : i + chunk] for i in range(0, len(body), chunk))]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\n{head}".encode())
        for piece in [*pieces, b"0\r\n\r\n"] if pause else [b"".join(pieces) + b"0\r\n\r\n"]:
            time.sleep(pause)
            sock.sendall(piece)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        return resp.status, json.loads(resp.read())


def test_every_route_but_health_needs_the_key():
    """With an API key, every route (the OpenAPI schema included) answers 401 without it; there are no docs pages;
    without a key the schema is open, as before."""
    app = build_app(ServeConfig(artifact="/nowhere/fake", api_key="s3cret"), loader=lambda cfg: FakePipeline())
    routes = [(m, r.path) for r in app.routes for m in sorted(r.methods - {"HEAD"}) if r.path != "/health"]
    assert ("GET", "/openapi.json") in routes and ("POST", "/v1/images/generations") in routes
    with _serving(app) as port:
        for method, path in routes:
            status, body = _get(port, path, method=method)
            assert status == 401 and body["error"]["type"] == "authentication_error", (method, path, body)
        assert _get(port, "/health") == (200, {"status": "ok"})
        status, schema = _get(port, "/openapi.json", {"Authorization": "Bearer s3cret"})
        assert status == 200 and "/v1/images/generations" in schema["paths"] and "/openapi.json" not in schema["paths"]
        for path in ("/docs", "/redoc"):
            status, body = _get(port, path, {"Authorization": "Bearer s3cret"})
            assert status == 404 and body["error"]["type"] == "not_found_error"
    with _serving(build_app(ServeConfig(artifact="/nowhere/fake"), loader=lambda cfg: FakePipeline())) as port:
        status, schema = _get(port, "/openapi.json")
        assert status == 200 and "/v1/models" in schema["paths"]


def test_bearer_scheme_case_insensitive():
    app = build_app(ServeConfig(artifact="/nowhere/fake", api_key="s3cret"), loader=lambda cfg: FakePipeline())
    with _serving(app) as port:
        for header in ("Bearer s3cret", "bearer s3cret", "BEARER s3cret", "bEaReR s3cret", "Bearer    s3cret"):
            status, body = _get(port, "/v1/models", {"Authorization": header})
            assert status == 200 and body["data"][0]["id"] == "fake", header
        for header in ("Bearer wrong", "Bearer s3cret2", "Bearer s3cre", "Basic s3cret", "Bearers3cret", "s3cret",
                       "Bearer", "Bearer s3cret extra", ""):  # fmt: skip
            status, body = _get(port, "/v1/models", {"Authorization": header})
            assert status == 401 and body["error"]["type"] == "authentication_error", header


def test_chunked_body_over_limit_413():
    """A chunked body (no Content-Length) over --max-body-bytes gets our 413; one under it is served, after."""
    pipe = FakePipeline()
    app = build_app(ServeConfig(artifact="/nowhere/fake", max_body_bytes=1000), loader=lambda cfg: pipe)
    gen = "/v1/images/generations"
    with _serving(app) as port:
        warmup_calls = len(pipe.calls)
        big = json.dumps({"prompt": "a" * 5000}).encode()
        for pause in (0.0, 0.02):  # the body in one part (read whole), in several (the rest is drained)
            status, body = _chunked_post(port, gen, big, chunk=700, pause=pause)
            assert status == 413, body
            assert body["error"]["type"] == "invalid_request_error"
            assert "larger than 1000 bytes (--max-body-bytes)" in body["error"]["message"]
        assert len(pipe.calls) == warmup_calls  # nothing was queued
        status, body = _chunked_post(port, gen, json.dumps({"prompt": "a cat", "seed": 3}).encode(), chunk=5)
        assert status == 200 and base64.b64decode(body["data"][0]["b64_json"]) == b"a cat|3"
        status, body = _chunked_post(port, gen, b"{not json", chunk=4)
        assert status == 422 and body["error"]["code"] == "invalid_json"
        _, text = _get(port, "/metrics")
        for line in ('omni_serve_requests_total{status="413"} 2.0', 'omni_serve_requests_total{status="200"} 1.0'):
            assert line in text.splitlines()


def test_health_503_until_warm():
    import uvicorn

    pipe = FakePipeline()
    pipe.gate.clear()  # the warm-up run blocks until the gate opens
    port = _port()
    app = build_app(ServeConfig(artifact="/nowhere/fake", warmup_steps=1), loader=lambda cfg: pipe)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if server.started:
                break
            time.sleep(0.05)
        assert _get(port, "/health") == (503, {"status": "starting"})
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/images/generations", method="POST",
                                     data=b'{"prompt": "a cat"}', headers={"Content-Type": "application/json"})  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=10)
        assert info.value.code == 503 and "warming up" in json.loads(info.value.read())["error"]["message"]
        pipe.gate.set()
        for _ in range(200):
            if _get(port, "/health")[0] == 200:
                break
            time.sleep(0.05)
        assert _get(port, "/health") == (200, {"status": "ok"})
        assert _get(port, "/v1/models")[1]["data"][0]["id"] == "fake"
    finally:
        server.should_exit = True
        thread.join(30)


def test_pipeline_dir_from_manifest(tmp_path):
    from omni_compile.errors import ConfigError
    from omni_compile.server.pipeline import pipeline_dir

    root = tmp_path / "pipe"
    (root / "transformer").mkdir(parents=True)
    (root / "model_index.json").write_text("{}")
    built_from_root = str(root / "transformer")  # `omni-compile build DIR` records DIR/transformer as the source
    assert pipeline_dir(ServeConfig(artifact="a"), built_from_root) == root
    assert pipeline_dir(ServeConfig(artifact="a"), "preset:flux-tiny") is None
    assert pipeline_dir(ServeConfig(artifact="a", pipeline=str(root)), "preset:flux-tiny") == root
    with pytest.raises(ConfigError, match="--pipeline"):
        pipeline_dir(ServeConfig(artifact="a"), str(tmp_path / "elsewhere" / "transformer"))
    with pytest.raises(ConfigError, match="model_index.json"):
        pipeline_dir(ServeConfig(artifact="a", pipeline=str(tmp_path)), built_from_root)


def test_prompt_check_leaves_the_pipelines_tokenizers_alone():
    """The request path checks prompts while the worker runs the pipeline. A fast tokenizer keeps padding as state
    that every call sets: a check through the pipeline's own tokenizer, racing its padded T5 call, once made that
    call unpadded and the transformer ran at a text length the artifact does not hold (a 500 on CI)."""
    import types

    import torch

    from omni_compile.models.flux_pipeline import make_tokenizer
    from omni_compile.server.text_to_image import ImagePipeline

    pipe = types.SimpleNamespace(tokenizer=make_tokenizer(77), tokenizer_2=make_tokenizer(8))
    loaded = ImagePipeline(pipe=pipe, manifest={}, device=torch.device("cpu"), text_len=8, buckets=[], compiled=True,
                            source="test")  # fmt: skip
    # what FluxPipeline's T5 call leaves set on its tokenizer
    ids = pipe.tokenizer_2(["a red cat"], padding="max_length", max_length=8, truncation=True).input_ids
    assert [len(i) for i in ids] == [8]
    padding = pipe.tokenizer_2._tokenizer.padding
    assert padding is not None and padding["length"] == 8

    assert loaded.prompt_error("a red cat") is None
    why = loaded.prompt_error("a red cat on the big old house")
    assert "9 tokens for the T5 tokenizer, which takes at most 8" in why
    assert pipe.tokenizer_2._tokenizer.padding == padding  # a check through this tokenizer resets it to None
    assert loaded._check_tokenizers["tokenizer_2"] is not pipe.tokenizer_2


def test_step_cache_settings_do_not_share_a_batch():
    """Requests with different step cache settings never run in one pipeline call; each call gets its setting and
    the engine counts the calls it computed."""
    pipe = FakePipeline(buckets=((64, 64, 1), (64, 64, 2)))
    pipe.gate.clear()
    e = engine(pipe, max_batch=2)
    first = e.submit(job(seed=50, step_cache="off"))
    time.sleep(0.1)
    a = e.submit(job(seed=10, step_cache="schedule:0.5:2"))
    b = e.submit(job(seed=20, step_cache="off"))
    c = e.submit(job(seed=30, step_cache="schedule:0.5:2"))
    pipe.gate.set()
    for f in (first, a, b, c):
        f.result(10)
    assert pipe.calls == [[50], [10, 30], [20]]
    assert pipe.step_cache_args == [{"step_cache": "off"}, {"step_cache": "schedule:0.5:2"}, {"step_cache": "off"}]
    e.stop(10)
    assert e.metrics.count("step_cache_calls", "computed") == 3 and e.metrics.count("step_cache_calls", "skipped") == 3
    e2 = engine(pipe)  # jobs with no setting (a server without --step-cache): the pipeline is called without one
    e2.submit(job(seed=1)).result(10)
    assert pipe.step_cache_args[-1] == {}
    e2.stop(10)


def test_step_cache_setting_checks():
    from omni_compile.server.schemas import step_cache_setting

    def setting(value, default):
        return step_cache_setting(ImageRequest(prompt="x", step_cache=value), default)

    assert setting(None, None) is None and setting("off", None) is None
    with pytest.raises(RequestError, match="runs without step caching; start it with --step-cache") as info:
        setting("schedule:0.5", None)
    assert info.value.status == 400 and info.value.body.param == "step_cache"
    assert setting(None, "first_block:0.1") == "first_block:0.1:2"
    assert setting("off", "first_block:0.1") == "off"
    assert setting("schedule:0.75:3", "first_block:0.1") == "schedule:0.75:3"
    for bad, why in (("schedule:2", "fraction must be a number in (0, 1], not 2.0"), ("magic", "method 'magic'"),
                     ("first_block:0.1:1.5", "warmup must be an integer")):  # fmt: skip
        with pytest.raises(RequestError, match=why.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")) as info:
            setting(bad, "first_block:0.1")
        assert info.value.status == 400 and info.value.body.message.endswith(", or 'off'")


def test_serve_flag_step_cache():
    import argparse

    from omni_compile.errors import ConfigError
    from omni_compile.server.serve import add_serve_arguments, serve_config

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert serve_config(p.parse_args(["art"])).step_cache is None
    assert serve_config(p.parse_args(["art", "--step-cache", "schedule:0.5"])).step_cache == "schedule:0.5"
    with pytest.raises(ConfigError, match=r"--step-cache: step cache threshold must be a number in \(0, 1\], not 3.0"):
        serve_config(p.parse_args(["art", "--step-cache", "first_block:3"]))


def test_metrics_exposition_parses():
    """/metrics is valid Prometheus text (parsed by prometheus_client's own parser), every family there from the
    start, the labelled counters at 0, and the gauges as render sets them."""
    from prometheus_client.parser import text_string_to_metric_families

    from omni_compile.server.metrics import Metrics

    m = Metrics()
    m.request_done(200, 0.3)
    m.step_done(0.01, "compiled")
    m.step_cache_done(4, 3)
    families = {f.name: f for f in text_string_to_metric_families(m.render(queue_depth=2, ready=True,
                                                                           worker_alive=False))}  # fmt: skip
    assert set(families) == {f"omni_serve_{n}" for n in ("requests", "request_seconds", "queue_depth", "step_seconds",
                                                          "transformer_steps", "images", "batches", "dropped",
                                                          "step_cache_calls", "ready", "worker_alive", "videos",
                                                          "video_jobs")}  # fmt: skip
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert values[("omni_serve_requests_total", (("status", "200"),))] == 1
    assert values[("omni_serve_requests_total", (("status", "429"),))] == 0
    assert values[("omni_serve_step_cache_calls_total", (("result", "skipped"),))] == 1
    assert values[("omni_serve_queue_depth", ())] == 2 and values[("omni_serve_worker_alive", ())] == 0
    assert values[("omni_serve_request_seconds_count", ())] == 1 and m.count("transformer_steps", "compiled") == 1


def test_serve_lora_flags(tmp_path):
    from omni_compile.cli import _parser
    from omni_compile.errors import ConfigError
    from omni_compile.server.serve import serve_config

    f = tmp_path / "a.safetensors"
    f.write_bytes(b"x")
    args = _parser().parse_args(["serve", "art", "--lora", f"a={f}", "--lora", f"b={f}"])
    assert serve_config(args).loras == {"a": str(f), "b": str(f)}
    for flags, message in ((["--lora", "a"], "--lora 'a': expected NAME=PATH"),
                           (["--lora", f"a={f}", "--lora", f"a={f}"], "the name 'a' is given twice"),
                           (["--lora", f"a={tmp_path / 'none'}"], "no file")):  # fmt: skip
        with pytest.raises(ConfigError, match=re.escape(message)):
            serve_config(_parser().parse_args(["serve", "art", *flags]))


class _Metrics:
    def __init__(self):
        self.ended: list[str] = []

    def video_job_done(self, status):
        self.ended.append(status)


def _job_store(tmp_path, **kw):
    from omni_compile.server.videos import VideoJobs

    kw = {"max_jobs": 8, "ttl_s": 600.0, "max_bytes": 100, "timeout_s": 60.0, **kw}
    return VideoJobs(str(tmp_path), metrics=_Metrics(), **kw)


def _finished(store, name: str, mp4: bytes | None = None, error: Exception | None = None):
    """A job reserved in `store` and ended with `mp4` (or `error`), as the engine's future would end it."""
    from omni_compile.server.engine import Job
    from omni_compile.server.videos import VideoJob

    job = Job(prompt="a cat", n=1, seed=0, height=32, width=32, steps=2, guidance=5.0, deadline=time.monotonic() + 60,
              frames=5)  # fmt: skip
    video = VideoJob(id=name, job=job, model="m", seconds="0.25", fps=16, created_at=int(time.time()))
    store.reserve(video)
    future = concurrent.futures.Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result([(0, mp4)])
    store.finish(video, future)
    return video


def test_job_store_expiry_and_disk_bound(tmp_path):
    from omni_compile.server.schemas import RequestError

    store = _job_store(tmp_path, ttl_s=0.3)
    a = _finished(store, "a", b"x" * 40)
    b = _finished(store, "b", b"y" * 40)
    assert a.path.read_bytes() == b"x" * 40 and store.content("b") == b"y" * 40
    c = _finished(store, "c", b"z" * 40)  # 120 bytes > 100: the oldest finished one goes first
    assert not a.path and sorted(p.name for p in store.root.iterdir()) == ["b.mp4", "c.mp4"]
    with pytest.raises(RequestError, match="no video job 'a'"):
        store.get("a")
    big = _finished(store, "big", b"w" * 101)
    assert big.status() == "failed" and big.failure.code == "generation_failed"
    assert "is 101 bytes, more than --video-max-bytes 100" in big.failure.message
    with pytest.raises(RequestError, match="failed .*it has no content") as info:
        store.content("big")
    assert info.value.status == 409
    failed = _finished(store, "oom", error=RequestError(500, "generation failed: OutOfMemoryError: CUDA"))
    assert failed.failure.model_dump() == {"code": "generation_failed",
                                           "message": "generation failed: OutOfMemoryError: CUDA"}  # fmt: skip
    time.sleep(0.35)  # past --video-ttl: every finished job and its file go at the next call
    assert store.listing(None, 20, "desc") == ([], False)
    assert list(store.root.iterdir()) == [] and b.path is None and c.path is None
    assert store.metrics.ended == ["completed", "completed", "evicted", "completed", "failed", "failed", "expired",
                                   "expired", "expired", "expired"]  # fmt: skip
    root = store.root
    assert store.close() == [] and not root.exists()


class FakeVideoPipeline(FakePipeline):
    """A text-to-video stand-in: one bucket of 32x32 with 5 frames; its "MP4" is the bytes of (prompt, seed)."""

    task = "text-to-video"
    fps = 16
    default_guidance = 5.0

    def __init__(self):
        super().__init__(buckets=((32, 32, 1, 5),))

    def frames(self, height, width):
        return sorted({b.frames for b in self.buckets if (b.height, b.width) == (height, width)})

    def duration(self, frames):
        return (frames - 1) / self.fps

    def batch_sizes(self, height, width, frames=None):
        return [1]


def _wait_status(port, video_id, status):
    for _ in range(200):
        got = _get(port, f"/v1/videos/{video_id}")[1]
        if got["status"] == status:
            return got
        time.sleep(0.02)
    raise AssertionError(f"{video_id} never {status}: {got}")


def test_video_job_failures_and_shutdown(tmp_path):
    """A video job whose generation fails, or that passes its deadline, is `failed` with a code and message (its
    content a 409); the jobs' frames reach the pipeline; at shutdown the unfinished jobs are cancelled and the job
    directory is removed."""
    pipe = FakeVideoPipeline()
    config = ServeConfig(artifact="/nowhere/fake", warmup_steps=1, timeout_s=0.5, video_dir=str(tmp_path))
    app = build_app(config, loader=lambda cfg: pipe)

    def post(body):
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/videos", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    with _serving(app) as port:
        root = app.state.videos.root
        assert root.parent == tmp_path and root.is_dir()
        done = _wait_status(port, post({"prompt": "a cat", "seed": 4})["id"], "completed")
        assert (done["num_frames"], done["seconds"], done["guidance_scale"]) == (5, "0.25", 5.0)
        assert pipe.step_cache_args[-1] == {"frames": 5} and (root / f"{done['id']}.mp4").read_bytes() == b"a cat|4"
        pipe.fail = RuntimeError("boom")
        failed = _wait_status(port, post({"prompt": "a cat"})["id"], "failed")
        assert failed["error"] == {"code": "generation_failed", "message": "generation failed: RuntimeError: boom"}
        status, body = _get(port, f"/v1/videos/{failed['id']}/content")
        assert status == 409 and body["error"]["code"] == "video_failed"
        pipe.gate.clear()  # the next job blocks in its first step until its deadline has passed
        late = post({"prompt": "a cat", "num_inference_steps": 3})
        time.sleep(0.6)
        pipe.gate.set()
        late = _wait_status(port, late["id"], "failed")
        assert late["error"]["code"] == "deadline_exceeded" and "--timeout" in late["error"]["message"]
        pipe.gate.clear()
        waiting = post({"prompt": "a cat", "num_inference_steps": 3})
        assert _get(port, f"/v1/videos/{waiting['id']}")[1]["status"] in ("queued", "in_progress")
        threading.Timer(0.3, pipe.gate.set).start()  # let the worker reach its step boundary during the shutdown
    assert not root.exists()
    assert app.state.metrics.count("video_jobs", "cancelled") == 1 and app.state.metrics.count("videos") == 1
