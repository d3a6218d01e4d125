"""Text-to-video serving: a wan-tiny artifact (one bucket, 32x32 with 5 frames, built once for this module) behind
the real `omni-compile serve` in a subprocess. The job store's expiry and disk bound without a model:
tests/test_server_engine.py."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from test_server import Server, call

pytestmark = pytest.mark.compile

WAN_SHAPE = "32x32x5"  # served as size 32x32 (WIDTHxHEIGHT), 5 frames: 0.25 s at 16 fps
MAX_JOBS = 3


@pytest.fixture(scope="module")
def wan_artifact(tmp_path_factory, subprocess_env) -> Path:
    """wan-tiny built ahead of time at WAN_SHAPE (AOTInductor packages), in a subprocess with its own empty Inductor
    cache (about a minute on 2 CPU cores). Read-only."""
    root = tmp_path_factory.mktemp("wan-artifact")
    out = root / "wan-tiny"
    env = dict(subprocess_env, TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"))
    proc = subprocess.run([sys.executable, "-P", "-m", "omni_compile.cli", "build", "wan-tiny", "--shapes", WAN_SHAPE,
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def video_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("videos")


@pytest.fixture(scope="module")
def server_v(wan_artifact, video_dir, subprocess_env, tmp_path_factory):
    s = Server(wan_artifact, subprocess_env, tmp_path_factory.mktemp("logs") / "v.log", "--max-video-jobs",
               str(MAX_JOBS), "--default-steps", "2", "--max-steps", "5000", "--video-dir", str(video_dir))  # fmt: skip
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def create(port, **body):
    return call(port, "/v1/videos", {"prompt": "a red cat", **body})


def content(port, video_id) -> tuple[int, str, bytes]:
    """(status, content type, body bytes) of GET /v1/videos/{id}/content."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/videos/{video_id}/content", timeout=60) as r:
            return r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read()


def wait_for(port, video_id, status="completed", limit=120.0) -> tuple[dict, list[int]]:
    """Poll a job until it has `status`: its last object and the progress values seen on the way."""
    seen = []
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        code, video = call(port, f"/v1/videos/{video_id}")
        assert code == 200, video
        seen.append(video["progress"])
        if video["status"] == status:
            return video, seen
        assert video["status"] != "failed", video
        time.sleep(0.05)
    raise AssertionError(f"video job {video_id} never reached {status}: {video}")


def decode(mp4: bytes):
    """(frames as RGB arrays, frames per second) of an MP4, decoded with PyAV."""
    import av

    with av.open(io.BytesIO(mp4)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264"
        return [f.to_ndarray(format="rgb24") for f in container.decode(stream)], stream.average_rate


def test_video_life_cycle(server_v, video_dir):
    """Create, poll (progress rises step by step to 100), download a valid MP4 (5 frames of 32x32 at 16 fps), list,
    delete; the same seed gives the same bytes; the MP4 lives under the job directory until deleted."""
    port = server_v.port
    completed = server_v.metric('omni_serve_video_jobs_total{status="completed"}')  # the server is the module's
    status, video = create(port, seed=7, num_inference_steps=30)
    assert status == 200, video
    assert video["object"] == "video" and video["id"].startswith("video_") and video["status"] in ("queued", "in_progress")
    assert (video["model"], video["size"], video["seconds"], video["num_frames"], video["fps"]) == (
        "wan-tiny", "32x32", "0.25", 5, 16)  # fmt: skip
    assert (video["seed"], video["num_inference_steps"], video["guidance_scale"]) == (7, 30, 5.0)
    assert video["completed_at"] is None and video["error"] is None
    status, ctype, body = content(port, video["id"])
    assert status == 409, body
    assert json.loads(body)["error"]["code"] == "video_not_ready"
    done, seen = wait_for(port, video["id"])
    assert seen == sorted(seen) and seen[-1] == 100 and any(0 < p < 100 for p in seen), seen
    assert done["steps_done"] == 30 and done["completed_at"] >= done["created_at"]
    assert done["expires_at"] == done["completed_at"] + 3600
    status, ctype, mp4 = content(port, video["id"])
    assert (status, ctype) == (200, "video/mp4") and mp4[4:8] == b"ftyp"
    frames, fps = decode(mp4)
    assert len(frames) == 5 and fps == 16 and {f.shape for f in frames} == {(32, 32, 3)}
    files = list(video_dir.glob("omni-videos-*/*.mp4"))
    assert [f.name for f in files] == [f"{video['id']}.mp4"] and files[0].read_bytes() == mp4

    ids = [create(port, seed=3, num_inference_steps=2, seconds="0.25")[1]["id"] for _ in range(2)]
    mp4s = [content(port, wait_for(port, i)[0]["id"])[2] for i in ids]
    assert mp4s[0] == mp4s[1] != mp4
    status, listed = call(port, "/v1/videos")
    assert status == 200 and [v["id"] for v in listed["data"]] == [*reversed(ids), video["id"]]
    status, page = call(port, f"/v1/videos?order=asc&limit=1&after={video['id']}")
    assert [v["id"] for v in page["data"]] == ids[:1] and page["has_more"] is True

    for i in (video["id"], *ids):
        assert call(port, f"/v1/videos/{i}", method="DELETE") == (200, {"id": i, "object": "video.deleted",
                                                                         "deleted": True})  # fmt: skip
    status, err = call(port, f"/v1/videos/{video['id']}")
    assert status == 404 and err["error"]["type"] == "not_found_error"
    assert content(port, video["id"])[0] == 404
    assert list(video_dir.glob("omni-videos-*/*")) == []
    assert server_v.metric('omni_serve_video_jobs_total{status="completed"}') - completed == 3


def test_cancel_running_and_queued(server_v):
    """DELETE of a queued job takes it out of the queue; of a running one stops it at the next step boundary; the
    worker then runs the next job."""
    port = server_v.port
    steps = server_v.metric("omni_serve_step_seconds_count")
    # the module's server is shared: other tests (in any order) cancel jobs too, so these are deltas
    dropped = server_v.metric('omni_serve_dropped_total{reason="cancelled"}')
    cancelled = server_v.metric('omni_serve_video_jobs_total{status="cancelled"}')
    running = create(port, seed=1, num_inference_steps=5000)[1]
    queued = create(port, seed=2, num_inference_steps=5000)[1]
    wait_for(port, running["id"], status="in_progress")
    assert call(port, f"/v1/videos/{queued['id']}")[1]["status"] == "queued"
    for v in (queued, running):
        assert call(port, f"/v1/videos/{v['id']}", method="DELETE")[1]["deleted"] is True
        assert call(port, f"/v1/videos/{v['id']}")[0] == 404
    quick = create(port, seed=3, num_inference_steps=1)[1]
    assert wait_for(port, quick["id"])[0]["steps_done"] == 1
    assert server_v.metric("omni_serve_step_seconds_count") - steps < 5000  # the running one stopped early
    assert server_v.metric('omni_serve_dropped_total{reason="cancelled"}') - dropped == 2
    assert server_v.metric('omni_serve_video_jobs_total{status="cancelled"}') - cancelled == 2
    call(port, f"/v1/videos/{quick['id']}", method="DELETE")


BAD = [
    ({"size": "64x64"}, "size", "unsupported_size", "is not served: the artifact was compiled for 32x32"),
    ({"size": "wide"}, "size", None, "is not WIDTHxHEIGHT"),
    ({"seconds": "4"}, "seconds", "unsupported_frames", ("seconds: 65 frames (4 s at 16 fps) are not served at "
                                                         "32x32: the artifact was compiled for 5 frames (0.25 s) there")),
    ({"num_frames": 9}, "num_frames", "unsupported_frames", "num_frames: 9 frames (0.5 s at 16 fps) are not served"),
    ({"seconds": "1", "num_frames": 5}, "seconds", None, "seconds 1 is 17 frames at 16 fps, not num_frames 5"),
    ({"seconds": "soon"}, "seconds", None, "seconds must be a positive number, got 'soon'"),
    ({"seconds": -1}, "seconds", None, "seconds must be a positive number, got -1"),
    ({"prompt": "a red cat on the big old house"}, "prompt", "prompt_too_long",
     "prompt is 9 tokens for the UMT5 tokenizer, which takes at most 8 here"),
    ({"prompt": " "}, "prompt", None, "prompt is empty"),
    ({"num_inference_steps": 0}, "num_inference_steps", None, "between 1 and 5000"),
    ({"guidance_scale": 101}, "guidance_scale", None, "between 0 and 100"),
    ({"model": "sora-2"}, "model", "model_not_found", "model 'sora-2' is not served here; this server serves 'wan-tiny'"),
    ({"step_cache": "schedule:0.5"}, "step_cache", None, "this server runs without step caching; start it with "
     "--step-cache"),
    ({"input_reference": {"image_url": "x"}}, "input_reference", None, "image-to-video is not served"),
]


def test_bad_requests_then_serves(server_v):
    """Each bad request is a 400 (422 for a wrong type) naming the parameter; unknown ids are 404; the server goes on."""
    port = server_v.port
    for body, param, code, words in BAD:
        status, err = create(port, **body)
        assert status == 400, (body, err)
        assert (err["error"]["param"], err["error"]["code"]) == (param, code) and words in err["error"]["message"], err
    status, err = create(port, seed="7")
    assert status == 422 and err["error"]["param"] == "seed"
    status, err = call(port, "/v1/videos", raw=b"{not json")
    assert status == 422 and err["error"]["code"] == "invalid_json"
    for method, path in (("GET", "/v1/videos/video_nope"), ("DELETE", "/v1/videos/video_nope"),
                         ("GET", "/v1/videos/video_nope/content")):  # fmt: skip
        status, err = call(port, path, method=method)
        assert status == 404 and err["error"]["message"].startswith("no video job 'video_nope'"), err
    status, err = call(port, "/v1/videos?limit=0")
    assert status == 400 and err["error"]["param"] == "limit"
    status, err = call(port, "/v1/images/generations", {"prompt": "a red cat"})
    assert status == 400 and err["error"]["code"] == "unsupported_task" and "use POST /v1/videos" in err["error"]["message"]
    status, models = call(port, "/v1/models")
    assert models["data"][0]["task"] == "text-to-video" and models["data"][0]["frames"] == {"32x32": [5]}
    assert server_v.metric("omni_serve_queue_depth") == 0
    video = create(port, seed=1, num_inference_steps=1)[1]
    assert wait_for(port, video["id"])[0]["status"] == "completed"
    call(port, f"/v1/videos/{video['id']}", method="DELETE")
    assert "Traceback" not in server_v.text()


def test_job_count_bound(server_v):
    """--max-video-jobs: with every job unfinished a new one gets 429 and Retry-After; once they are finished, a new
    job takes the place of the oldest finished one."""
    port = server_v.port
    long = [create(port, seed=i, num_inference_steps=5000)[1] for i in range(MAX_JOBS)]
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/videos", data=b'{"prompt": "a cat"}',
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 429 and info.value.headers["Retry-After"] == "5"
    err = json.loads(info.value.read())["error"]
    assert err["type"] == "overloaded_error" and f"the video job store is full ({MAX_JOBS} jobs" in err["message"]
    for v in long:
        call(port, f"/v1/videos/{v['id']}", method="DELETE")
    short = [create(port, seed=i, num_inference_steps=1)[1] for i in range(MAX_JOBS)]
    for v in short:
        wait_for(port, v["id"])
    evicted = server_v.metric('omni_serve_video_jobs_total{status="evicted"}')
    status, newest = create(port, seed=9, num_inference_steps=1)
    assert status == 200
    assert call(port, f"/v1/videos/{short[0]['id']}")[0] == 404  # the oldest finished one made room
    assert [call(port, f"/v1/videos/{v['id']}")[0] for v in short[1:]] == [200] * (MAX_JOBS - 1)
    assert server_v.metric('omni_serve_video_jobs_total{status="evicted"}') == evicted + 1
    for v in (*short[1:], newest):
        call(port, f"/v1/videos/{v['id']}", method="DELETE")


@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")  # the client's note about OpenAI's own service
def test_openai_client_videos(server_v):
    """The official `openai` client (multipart/form-data create, retrieve, download_content, delete): the same seed
    gives the same MP4 as a JSON request."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server_v.port}/v1", api_key="unused", max_retries=0)
    if not hasattr(client, "videos"):
        pytest.skip(f"openai {openai.__version__} has no videos API")
    port = server_v.port
    made = client.videos.create(prompt="a red cat", model="wan-tiny", size="32x32", seconds="0.25",
                                extra_body={"seed": 11, "num_inference_steps": 2})  # fmt: skip
    assert made.object == "video" and made.size == "32x32" and made.seconds == "0.25"
    for _ in range(1200):
        got = client.videos.retrieve(made.id)
        if got.status in ("completed", "failed"):
            break
        time.sleep(0.05)
    assert got.status == "completed" and got.progress == 100
    mp4 = client.videos.download_content(made.id).read()
    reference = create(port, seed=11, num_inference_steps=2)[1]
    assert mp4 == content(port, wait_for(port, reference["id"])[0]["id"])[2]
    assert len(decode(mp4)[0]) == 5
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve("video_nope")
    with pytest.raises(openai.BadRequestError, match="65 frames") as info:
        client.videos.create(prompt="a red cat", seconds="4")
    assert info.value.code == "unsupported_frames" and info.value.param == "seconds"
    assert client.videos.delete(made.id).deleted is True
    call(port, f"/v1/videos/{reference['id']}", method="DELETE")


def test_wan_pipeline_directory(wan_artifact, tmp_path):
    """`--pipeline DIR` with a WanPipeline directory (the preset's, written by `omni-compile pipeline wan-tiny`) runs
    as the preset's pipeline in memory does; a FluxPipeline directory is refused for a Wan artifact."""
    import numpy as np
    import torch

    import omni_compile
    from omni_compile.models.wan_pipeline import save_pipeline
    from omni_compile.server import ServeConfig
    from omni_compile.server.pipeline import load_pipeline
    from omni_compile.server.text_to_video import VideoPipeline

    directory = save_pipeline("wan-tiny", tmp_path / "wan-pipe")
    outputs = []
    with omni_compile.counters.expect(regions_compiled=0, aot_compiles=0):
        for pipeline in (None, str(directory)):
            served = load_pipeline(ServeConfig(artifact=str(wan_artifact), pipeline=pipeline))
            assert isinstance(served, VideoPipeline) and served.compiled and served.frames(32, 32) == [5]
            with torch.no_grad():
                out = served.pipe(prompt=["a red cat"], height=32, width=32, num_frames=5, num_inference_steps=2,
                                  max_sequence_length=served.text_len, generator=torch.Generator().manual_seed(4),
                                  output_type="np")  # fmt: skip
            outputs.append((served.source, np.asarray(out.frames)))
    (preset, from_preset), (source, from_dir) = outputs
    assert preset == "random wan-tiny pipeline (seed 0)" and source == str(directory)
    assert from_dir.shape == (1, 5, 32, 32, 3) and np.abs(from_dir - from_preset).max() < 1e-4
    flux = tmp_path / "flux-pipe"
    flux.mkdir()
    (flux / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(omni_compile.ConfigError, match="holds a FluxPipeline; this artifact's model runs in a "
                       "WanPipeline: pass --pipeline with a WanPipeline directory"):  # fmt: skip
        load_pipeline(ServeConfig(artifact=str(wan_artifact), pipeline=str(flux)))


def test_video_step_cache(wan_artifact):
    """`--step-cache` on a video server: each of the pipeline's transformer calls (conditional and unconditional,
    each with its own cached state) is counted; 'off' computes them all and matches the pipeline without the
    cache bit for bit; schedule:0.5 skips some and changes the video; zero compiles."""
    import omni_compile
    from omni_compile.server import ServeConfig
    from omni_compile.server.pipeline import load_pipeline

    plain = load_pipeline(ServeConfig(artifact=str(wan_artifact)))
    served = load_pipeline(ServeConfig(artifact=str(wan_artifact), step_cache="schedule:0.5"))
    args = (["a red cat"], [4], 32, 32, 8, 5.0)
    with omni_compile.counters.expect(regions_compiled=0, aot_compiles=0):
        reference = plain.run(*args, frames=5)
        every = served.run(*args, frames=5, step_cache="off")
        assert served.last_calls == (16, 16)  # 8 steps, two calls each (guidance 5)
        cached = served.run(*args, frames=5, step_cache="schedule:0.5")
    calls, computed = served.last_calls
    assert every == reference and calls == 16 and 4 < computed < 16 and cached != every
