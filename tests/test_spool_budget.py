"""The front's one spool budget (appliance.front.spool_budget): the bytes of every spool file it holds for requests in
flight, whichever route decoded it (a chat request's images, an image edit's picture and mask, an upload's audio
samples), under one capacity; each file's bytes come back once its request ends, however it ends.

The pure object against generated sequences of claims, refusals and releases; then the real front in this process
(its routes, its decoder processes and its model workers are the real ones, on loopback), its budget set small so
that a few small files fill it: an edit or an upload is refused with a 503 while another route's files hold the
budget, and every byte comes back after requests that succeed, one whose client hangs up while it is queued and
one whose worker is killed mid-picture.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import signal
import tempfile
import threading
from http.client import HTTPConnection
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings, strategies as st

from audio_samples import TRANSCRIPT, multipart, tone, wav_bytes
from conftest import free_port, http, model_entry, pid_alive, wait_until

HANG_BOUND_S = 60  # catches a hang, never a timing
PICTURE = 64 * 64 * 3  # the spool bytes of a 64 x 64 edit picture (or mask): RGB pixels
SECOND = 16000 * 4  # the spool bytes of a second of decoded audio: 16 kHz float32


# --- the pure budget -----------------------------------------------------------------------------------------------

PATHS = [f"/spool/{i}" for i in range(6)]
OPS = st.lists(st.one_of(
    st.tuples(st.just("claim"), st.sampled_from(PATHS), st.integers(0, 120)),
    st.tuples(st.just("release"), st.sampled_from(PATHS)),
    st.tuples(st.just("reserve"), st.sampled_from(PATHS), st.integers(0, 120)),
    st.tuples(st.just("settle"), st.sampled_from(PATHS), st.integers(0, 120)),
    st.tuples(st.just("capacity"), st.integers(0, 300))), max_size=60)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(0, 300), ops=OPS)
def test_generated_claims_and_releases_keep_the_budget_within_capacity_and_end_at_zero(capacity, ops):
    """Claims that fit are counted, those that do not are a 503 spool_full and count nothing, a reservation takes
    what its writer may write up to the room and is settled down (never up) to its file's size, a path is given back
    once however often it is released (a request's finally, a file removed twice), and a capacity lowered under
    what is held refuses until enough comes back. Held bytes never go negative, never pass the capacity they were
    claimed under, always equal what the files hold, the gauge says the same, and all of it comes back at the end."""
    from appliance.front.request import RequestFailed
    from appliance.front.spool_budget import SpoolBudget
    gauge: list[int] = []
    budget = SpoolBudget(capacity, gauge.append)
    model: dict[str, int] = {}  # the claims a correct budget holds
    for op in ops:
        if op[0] == "claim":
            _, path, size = op
            if path in model:
                with pytest.raises(ValueError):
                    budget.claim(path, size, "a file")
                continue
            fits = size <= max(0, budget.capacity - sum(model.values()))
            try:
                budget.claim(path, size, "a file")
            except RequestFailed as refused:
                assert not fits and (refused.status, refused.code, refused.retry_after) == (503, "spool_full", 1)
            else:
                assert fits
                model[path] = size
        elif op[0] == "reserve":  # (a decoder taking a file: what it may write, at most the room)
            _, path, at_most = op
            if path in model:
                with pytest.raises(ValueError):
                    budget.reserve(path, at_most)
                continue
            model[path] = budget.reserve(path, at_most)
            assert model[path] == min(at_most, max(0, budget.capacity - sum(model.values()) + model[path]))
        elif op[0] == "settle":  # (its file decoded: the claim down to its size, never up)
            _, path, size = op
            if path not in model or size > model[path]:
                with pytest.raises((ValueError, KeyError)):
                    budget.settle(path, size)
                continue
            budget.settle(path, size)
            model[path] = size
        elif op[0] == "release":
            budget.release(op[1])
            model.pop(op[1], None)
        else:
            budget.capacity = op[1]
        assert budget.held == sum(model.values()) == sum(budget.files.values()) >= 0
        assert budget.room() == max(0, budget.capacity - budget.held)
        assert not gauge or gauge[-1] == budget.held
    for path in PATHS:
        budget.release(path)
    assert (budget.held, budget.files, gauge[-1] if gauge else 0) == (0, {}, 0)


def test_remove_unlinks_the_file_and_gives_its_bytes_back_once(tmp_path):
    from appliance.front.spool_budget import SpoolBudget
    budget = SpoolBudget(100)
    path = tmp_path / "0.rgb"
    path.write_bytes(b"x" * 60)
    budget.claim(str(path), 60, "a file")
    budget.remove(str(path))
    budget.remove(str(path))  # gone already: nothing more comes back, nothing fails
    assert (budget.held, path.exists()) == (0, False)


# --- the real front, in this process -------------------------------------------------------------------------------

class InProcessFront:
    """The front `openarc serve` runs (appliance.front.server.Appliance, its app and its model workers), in this
    process on an event loop of its own thread, so the test can reach its spool budget and its routes."""

    def __init__(self, config: dict, tmp: Path):
        from appliance.config import load_config
        self.port = free_port()
        config["server"] = {"host": "127.0.0.1", "port": self.port}
        path = tmp / "openarc.yaml"
        path.write_text(yaml.safe_dump(config))
        self.config = load_config(path)
        self.base = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.worker_pids: set[int] = set()

    def call(self, coroutine, timeout: float = HANG_BOUND_S):
        """Run `coroutine` on the front's loop; its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def start(self) -> InProcessFront:
        self.thread.start()
        self.call(self._start(), timeout=120)
        return self

    async def _start(self) -> None:
        from aiohttp import web

        from appliance.front.app import make_app
        from appliance.front.server import Appliance
        self.appliance = Appliance(self.config)
        self.app = make_app(self.appliance)
        # as Appliance.serve runs it: a client that hangs up cancels its handler
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        self.appliance.supervisor.start()
        while not self.appliance.supervisor.settled():
            await self.appliance.supervisor.changes.wait(1.0)

    @property
    def budget(self):
        return self.appliance.spool_budget

    def model_status(self, model: str) -> dict:
        status, _, body = http("GET", self.base + "/openarc/status", timeout=5)
        assert status == 200, body
        found = next(m for m in body["models"] if m["name"] == model)
        if found["pid"]:
            self.worker_pids.add(found["pid"])
        return found

    def stop(self) -> None:
        async def stop():
            self.appliance.draining = True
            await self.appliance.supervisor.stop(5.0)
            await self.runner.cleanup()
        try:
            self.call(stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
        wait_until(lambda: not any(pid_alive(p) for p in self.worker_pids), 10, "the workers gone")


@pytest.fixture(scope="module")
def slow_image_model(tmp_path_factory):
    """The demo image model with more work a step (about 20 ms): an edit of many steps holds its files seconds."""
    from appliance.demo.catalog import build_demo_model
    return build_demo_model(tmp_path_factory.mktemp("models") / "slow-image", "image", step_work=64)


@pytest.fixture(scope="module")
def spool_dir(tmp_path_factory):
    """Where the front's spool directories go (the system's temporary directory, as without systemd)."""
    return tmp_path_factory.mktemp("spool")


@pytest.fixture(scope="module")
def front(slow_image_model, demo_whisper, spool_dir, tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setattr(tempfile, "tempdir", str(spool_dir))  # every route's spool directory (mkdtemp, gettempdir)
    for name in ("CACHE_DIRECTORY", "STATE_DIRECTORY"):  # the chat images' spool base under systemd
        patch.delenv(name, raising=False)
    server = InProcessFront({"models": [
        model_entry("pictures", slow_image_model, kind="image", max_inference_steps=500, max_running=1),
        model_entry("whisper", demo_whisper, kind="transcription")]}, tmp_path_factory.mktemp("front"))
    try:
        yield server.start()
    finally:
        try:
            server.stop()
        finally:
            patch.undo()


@pytest.fixture
def budget(front):
    """The front's budget, its capacity set small for one test and given back after; nothing held before or after."""
    assert front.budget.held == 0
    capacity = front.budget.capacity
    yield front.budget
    front.budget.capacity = capacity
    assert front.budget.held == 0


def spool_files(spool_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(spool_dir)) for p in spool_dir.rglob("*") if p.is_file())


def png(colour, size=(64, 64), mode="RGB") -> bytes:
    from PIL import Image
    out = io.BytesIO()
    Image.new(mode, size, colour).save(out, "PNG")
    return out.getvalue()


def edit_form(steps: int = 2, mask: bool = True, side: int = 64) -> dict:
    form = {"model": "pictures", "prompt": "a red square", "num_inference_steps": str(steps), "strength": "1.0",
            "image": png((0, 0, 255), (side, side))}
    return {**form, "mask": png((0, 0, 0, 0), (side, side), mode="RGBA")} if mask else form


def post_form(front, path: str, form: dict, timeout: float = HANG_BOUND_S) -> tuple[int, dict, dict]:
    content_type, body = multipart(form)
    return http("POST", front.base + path, raw=body, headers={"Content-Type": content_type}, timeout=timeout)


def transcribe(front, seconds: float) -> tuple[int, dict, dict]:
    return post_form(front, "/v1/audio/transcriptions", {"model": "whisper", "file": wav_bytes(tone(seconds))})


def assert_spool_full(reply: tuple[int, dict, dict], what: str) -> None:
    status, headers, body = reply
    assert status == 503 and headers.get("Retry-After") == "1", reply
    assert set(body["error"]) == {"message", "type", "param", "code"}, body  # the route's OpenAI shape
    assert (body["error"]["code"], body["error"]["type"]) == ("spool_full", "server_error"), body
    assert what in body["error"]["message"] and "retry later" in body["error"]["message"], body


def test_edits_and_uploads_are_refused_while_chat_images_hold_the_shared_spool(front, budget, spool_dir):
    """The chat route's resolver (the front's own, on its own decoder process) holds most of the budget with one
    image's pixels: an edit and a transcription past what is left are each a 503 spool_full with Retry-After, in
    the OpenAI shape of their route, decoded no further than the room left; once the image's request ends, both are
    served. Before, edits and audio had no server-wide bound at all."""
    from appliance.config import ModelConfig
    from appliance.front.api.generate import GENERATION
    from appliance.front.api.images import Content, ImagePart
    budget.capacity = 100_000
    resolver = front.app[GENERATION].images
    image = "data:image/png;base64," + base64.b64encode(png((255, 0, 0), size=(150, 200))).decode()
    held = front.call(resolver.resolve(Content([ImagePart("messages[0].content[0]", image)]),
                                       ModelConfig(name="vlm", path="/m", kind="vlm")))
    try:
        assert budget.held == 150 * 200 * 3 and len(spool_files(spool_dir)) == 1
        assert_spool_full(post_form(front, "/v1/images/edits", edit_form(mask=False)), "'image': the image is 64x64")
        assert_spool_full(transcribe(front, 1.0), "the audio is longer than 0.15625 s")
        assert budget.held == 150 * 200 * 3 and len(spool_files(spool_dir)) == 1  # the refused left nothing
    finally:
        async def release():  # on the front's loop: the budget's one writer
            resolver.release(held)
        front.call(release())
    status, _, body = post_form(front, "/v1/images/edits", edit_form())
    assert status == 200 and len(body["data"]) == 1, body
    status, _, body = transcribe(front, 1.0)
    assert (status, body["text"]) == (200, TRANSCRIPT)
    assert budget.held == 0 and spool_files(spool_dir) == []


def metric(front, name: str) -> float:
    _, _, text = http("GET", front.base + "/metrics")
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_every_byte_comes_back_after_a_hang_up_mid_queue_and_a_worker_killed_mid_picture(front, budget, spool_dir):
    """A long edit runs (its 128 x 128 picture and mask held: LONG bytes); a transcription whose samples pass the room
    left is a 503 while one that fits is served beside it; a second edit queued behind the first holds its files
    until its client hangs up, then gives them back; the first edit's worker is killed mid-picture, and its files go
    too. The held bytes (the budget, the openarc_spool_bytes gauge) and the spool directory end empty."""
    LONG = 2 * 128 * 128 * 3  # (500 steps of 128 x 128: tens of seconds here, killed after a few)
    budget.capacity = LONG + SECOND + SECOND // 2  # a running edit and 1.5 s of audio
    replies: dict[str, tuple] = {}
    long_edit = threading.Thread(target=lambda: replies.update(
        long=post_form(front, "/v1/images/edits", edit_form(steps=500, side=128))))
    long_edit.start()
    wait_until(lambda: front.model_status("pictures")["requests_running"], HANG_BOUND_S, "the long edit running")
    assert budget.held == LONG and metric(front, "openarc_spool_bytes") == LONG

    assert_spool_full(transcribe(front, 2.0), "the audio is longer than 1.5 s")
    status, _, body = transcribe(front, 1.0)  # fits beside the edit's files
    assert (status, body["text"]) == (200, TRANSCRIPT)
    assert budget.held == LONG

    content_type, body = multipart(edit_form(steps=2))
    queued = HTTPConnection("127.0.0.1", front.port, timeout=HANG_BOUND_S)
    queued.request("POST", "/v1/images/edits", body, {"Content-Type": content_type})
    # (its place in the queue is reserved before its files are decoded: waiting, with its files held, it is queued)
    wait_until(lambda: budget.held == LONG + 2 * PICTURE, HANG_BOUND_S, "the second edit's files held")
    assert front.model_status("pictures")["requests_waiting"] == 1 and len(spool_files(spool_dir)) == 4
    queued.close()  # the client hangs up mid-queue
    wait_until(lambda: budget.held == LONG, HANG_BOUND_S, "the queued edit's files given back")
    assert len(spool_files(spool_dir)) == 2 and not front.model_status("pictures")["requests_waiting"]

    pid = front.model_status("pictures")["pid"]
    os.kill(pid, signal.SIGABRT)
    long_edit.join(HANG_BOUND_S)
    status, _, body = replies["long"]
    assert status == 503 and body["error"]["code"] == "worker_crash", body
    assert budget.held == 0 and spool_files(spool_dir) == []
    assert metric(front, "openarc_spool_bytes") == 0
    wait_until(lambda: front.model_status("pictures")["state"] == "ready", HANG_BOUND_S, "the image model back")
    status, _, body = post_form(front, "/v1/images/edits", edit_form())  # the whole budget is there again
    assert status == 200, body
    assert budget.held == 0 and spool_files(spool_dir) == []


def test_audio_longer_than_the_whole_spool_is_a_413_not_a_503_to_retry(front, budget, spool_dir):
    """max_audio_seconds has no upper bound (a meeting model may take 10 hours: 2.3 GB of samples), the spool budget
    has one. With nothing held, audio past the whole budget can never be served: a 503 spool_full told its client to
    retry for ever. It is a 413 audio_too_long naming the spool's size; one that fits the budget but not the room
    left is still the 503 (test_every_byte_comes_back...), and the budget ends empty."""
    budget.capacity = SECOND + SECOND // 2  # 1.5 s of samples in all, none held
    status, headers, body = transcribe(front, 2.0)
    assert status == 413 and "Retry-After" not in headers, body
    assert (body["error"]["code"], body["error"]["type"]) == ("audio_too_long", "invalid_request_error"), body
    assert "1.5 s" in body["error"]["message"] and f"{budget.capacity} bytes" in body["error"]["message"], body
    status, _, body = transcribe(front, 1.0)  # within it: served
    assert (status, body["text"]) == (200, TRANSCRIPT)
    assert budget.held == 0 and spool_files(spool_dir) == []


def helper_pid(module: str) -> int:
    """The pid of the in-process front's helper process running `python -m module` (started by its loop's thread)."""
    pids = [int(pid) for task in Path(f"/proc/{os.getpid()}/task").iterdir()
            for pid in (task / "children").read_text().split()
            if module in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")]
    assert len(pids) == 1, pids
    return pids[0]


def test_a_decoder_holds_the_room_it_may_write_from_when_it_takes_a_file(front, budget, spool_dir):
    """The front's three decoders (chat images, edits, audio) write at once. Each was given the room left and its file
    claimed only once written: while the audio decoder wrote its samples, the chat resolver's saw the same room free,
    wrote an image into it and claimed it; the audio, written past the budget beside it (on disk, or in RAM on a
    tmpfs: each decoder up to the whole room at once), was refused after. The audio decoder, stopped here while it
    holds an upload, now holds the room it may write from when it takes the file: the image decoded after it sees
    none left and stops at its header (a 503, nothing written), and the audio is served once its decoder goes on."""
    from appliance.config import ModelConfig
    from appliance.front.api.generate import GENERATION
    from appliance.front.api.images import Content, ImagePart
    from appliance.front.request import RequestFailed
    budget.capacity = 100_000
    decoder = helper_pid("appliance.front.audio_decoder")
    replies: dict[str, tuple] = {}
    audio = threading.Thread(target=lambda: replies.update(audio=transcribe(front, 1.0)))
    os.kill(decoder, signal.SIGSTOP)
    try:
        audio.start()
        wait_until(lambda: budget.held == budget.capacity, HANG_BOUND_S, "the audio decoder's room reserved")
        image = "data:image/png;base64," + base64.b64encode(png((255, 0, 0), size=(150, 200))).decode()
        with pytest.raises(RequestFailed) as refused:
            front.call(front.app[GENERATION].images.resolve(Content([ImagePart("messages[0].content[0]", image)]),
                                                            ModelConfig(name="vlm", path="/m", kind="vlm")))
        assert (refused.value.status, refused.value.code) == (503, "image_spool_full"), refused.value
        assert "150x200" in refused.value.message and spool_files(spool_dir) == []  # stopped at its header
    finally:
        os.kill(decoder, signal.SIGCONT)
    audio.join(HANG_BOUND_S)
    status, _, body = replies["audio"]
    assert (status, body["text"]) == (200, TRANSCRIPT)
    assert budget.held == 0 and spool_files(spool_dir) == []
