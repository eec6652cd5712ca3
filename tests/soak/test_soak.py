"""Chaos soak: thousands of OpenAI SDK requests while workers are aborted, killed, frozen and sent garbage (bytes
that are not a frame, written into their real channel) and the KV cache overflows.

Concurrent SDK clients (threads) stream and not, against `alpha` and `beta` (the signal victims) and `tight`
(num_kv_blocks: 4, sent prompts too long for it), embed and rerank against `vectors` and `ranker`, and send audio
to `gamma` (a Whisper model) to transcribe, whole and streamed (signal victims of the other worker kinds). A seeded
fault schedule signals a worker only while its model
is ready and that worker has not been signalled yet, so every signal hits exactly one live worker and causes
exactly one restart: that is what makes the counters in /metrics checkable exactly.

Reproduce a run with OPENARC_SOAK_SEED=<the printed seed>.
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import openai

from audio_samples import TRANSCRIPT, tone, wav_bytes
from conftest import http, model_entry, parked_spare, pid_alive, wait_until
from test_failures import LONG_PROMPT
from test_lifecycle import steal_fd, worker_channel_fd
from test_metrics import samples, value

TOTAL_REQUESTS = 2000
CLIENTS = 10
FAULTS = 40                      # faults dealt to the victims
VICTIMS = ("alpha", "beta", "vectors", "ranker", "gamma")
SIGNALS = (signal.SIGABRT, signal.SIGKILL, signal.SIGSTOP)
GARBAGE = "garbage"              # a frame that is not JSON, as if the worker wrote it: a protocol error
FAULT_KINDS = (*(sig.name for sig in SIGNALS), GARBAGE)
STALL_TIMEOUT_S = 2.0
DEADLINE_S = 20.0                # a request still open after this is a hang (stall timeout + a restart + slack)
RECOVERY_TIMEOUT_S = 60.0        # only catches a model that never comes back
# Soak-sized restart policy: dozens of deliberate crashes in a minute must not use up the budget.
RESTART = {"backoff_initial_s": 0.05, "backoff_max_s": 0.2, "max_failures": 500, "window_s": 60}
# ~2 ms per engine step: a signal lands mid-generation, a disconnect lands mid-stream.
STEP_DELAY = {"OPENARC_DEBUG_STEP_DELAY_S": "0.002"}
# What each status may carry; a stream that fails after its headers has status 200 and an error event.
# 200 with "overloaded": a stream that waited for its model past its headers (keep-alives) and met a full queue
ALLOWED = {200: {None, "worker_crash", "stall", "scheduler_out_of_memory", "overloaded"}, 429: {"overloaded"},
           500: {"scheduler_out_of_memory"}, 503: {"worker_crash", "model_unavailable"}, 504: {"stall"}}
ERROR_KINDS = {"overloaded": "overloaded", "model_unavailable": "model_unavailable", "worker_crash": "worker_crash",
               "stall": "stall", "scheduler_out_of_memory": "scheduler_oom"}


class Malformed(AssertionError):
    """The server said something no OpenAI client should have to parse."""


@dataclass
class Outcome:
    model: str
    action: str
    status: int                # the HTTP status (200 for a stream, even one that ends in an error event)
    code: str | None = None    # the error code, None for a success
    seconds: float = 0.0
    disconnected: bool = False
    problem: str | None = None


# --- the client actions ----------------------------------------------------------------------------------

def chat_args(rng: random.Random, model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": rng.choice(("Hi.", "Say something.", "Go on."))}],
            "max_tokens": rng.randint(4, 24), **extra}


def whole(client: openai.OpenAI, rng: random.Random, model: str) -> Outcome:
    reply = client.chat.completions.create(**chat_args(rng, model))
    choice = reply.choices[0]
    if choice.finish_reason not in ("stop", "length") or not choice.message.content or reply.usage.completion_tokens < 1:
        raise Malformed(f"incomplete completion: {reply}")
    return Outcome(model, "whole", 200)


def sdk_stream(client: openai.OpenAI, rng: random.Random, model: str) -> Outcome:
    chunks = list(client.chat.completions.create(**chat_args(rng, model, stream=True)))
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    if len(finishes) != 1:
        raise Malformed(f"a stream without exactly one finish_reason: {finishes}")
    return Outcome(model, "sdk_stream", 200)


def check_sse(events: list[str]) -> str | None:
    """Every event is `data: <json>`, the last is [DONE]; an error event comes last before it. Returns its code."""
    if not events or events[-1] != "data: [DONE]" or events.count("data: [DONE]") != 1:
        raise Malformed(f"the stream does not end with exactly one [DONE]: {events[-3:]}")
    if not all(e.startswith("data: ") for e in events):
        raise Malformed(f"a line that is not an SSE data field: {[e for e in events if not e.startswith('data: ')][:1]}")
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    errors = [i for i, p in enumerate(payloads) if "error" in p]
    if errors:
        if errors != [len(payloads) - 1]:
            raise Malformed(f"error events at {errors} of {len(payloads)} payloads")
        return payloads[-1]["error"]["code"]
    if sum(1 for p in payloads for c in p["choices"] if c["finish_reason"]) != 1:
        raise Malformed("a stream without exactly one finish_reason")
    return None


def raw_stream(client: openai.OpenAI, rng: random.Random, model: str) -> Outcome:
    with client.chat.completions.with_streaming_response.create(**chat_args(rng, model, stream=True)) as response:
        events = [line for line in response.iter_lines() if line]
    return Outcome(model, "raw_stream", 200, check_sse(events))


def disconnect(client: openai.OpenAI, rng: random.Random, model: str) -> Outcome:
    """Read a few chunks of a long stream, then hang up."""
    stream = client.chat.completions.create(**chat_args(rng, model, stream=True, max_tokens=300))
    wanted = rng.randint(1, 5)
    for read, _ in enumerate(stream, 1):
        if read == wanted:
            break
    stream.close()
    return Outcome(model, "disconnect", 200, disconnected=True)


def transcribe(client: openai.OpenAI, rng: random.Random, model: str) -> Outcome:
    """Half a second to two seconds of sound, whole (json) or streamed (SSE deltas, then done)."""
    upload = ("clip.wav", wav_bytes(tone(rng.uniform(0.5, 2.0))))
    if rng.random() < 0.5:
        text = client.audio.transcriptions.create(model=model, file=upload).text
    else:
        events = list(client.audio.transcriptions.create(model=model, file=upload, stream=True))
        if not events or events[-1].type != "transcript.text.done":
            raise Malformed(f"a transcript stream that does not end with done: {events[-2:]}")
        text = events[-1].text
    if text != TRANSCRIPT:
        raise Malformed(f"transcript {text!r}")
    return Outcome(model, "transcribe", 200)


def too_long_for_the_cache(client: openai.OpenAI, rng: random.Random, model: str) -> Outcome:
    """A prompt larger than the whole KV cache: a real scheduler out-of-memory, whole or streamed."""
    if rng.random() < 0.5:
        client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=8)
    else:
        list(client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=8, stream=True))
    raise Malformed("a prompt larger than the KV cache was served")


def embed(client: openai.OpenAI, rng: random.Random, model: str) -> Outcome:
    texts = [rng.choice(("a cat on a mat", "GPU drivers crash", "Paris is in France")) for _ in range(rng.randint(1, 8))]
    reply = client.embeddings.create(model=model, input=texts)
    if [d.index for d in reply.data] != list(range(len(texts))) or any(len(d.embedding) != 128 for d in reply.data):
        raise Malformed(f"embeddings of the wrong shape: {len(reply.data)} for {len(texts)} inputs")
    return Outcome(model, "embed", 200)


def rerank(client: openai.OpenAI, rng: random.Random, model: str) -> Outcome:
    documents = ["the cat sat on the mat", "GPU drivers crash", "Paris is the capital of France"][:rng.randint(1, 3)]
    reply = client.post("/rerank", body={"model": model, "query": "cat", "documents": documents}, cast_to=object)
    scores = [r["relevance_score"] for r in reply["results"]]
    if sorted(r["index"] for r in reply["results"]) != list(range(len(documents))) or scores != sorted(scores)[::-1]:
        raise Malformed(f"a rerank answer out of order: {reply}")
    return Outcome(model, "rerank", 200)


LLM_VICTIMS = ("alpha", "beta")
ACTIONS = [(whole, LLM_VICTIMS, 30), (sdk_stream, LLM_VICTIMS, 15), (raw_stream, LLM_VICTIMS, 15),
           (disconnect, ("alpha",), 10), (whole, ("tight",), 10), (raw_stream, ("tight",), 10),
           (too_long_for_the_cache, ("tight",), 10), (embed, ("vectors",), 15), (rerank, ("ranker",), 10),
           (transcribe, ("gamma",), 15)]


def run_one(client: openai.OpenAI, rng: random.Random) -> Outcome:
    action, models, _ = rng.choices(ACTIONS, weights=[w for *_, w in ACTIONS])[0]
    model = rng.choice(models)
    started = time.monotonic()
    try:
        outcome = action(client, rng, model)
    except (openai.APITimeoutError, openai.APIConnectionError) as exc:  # both are APIErrors: first
        outcome = Outcome(model, action.__name__, 0, problem=f"transport: {exc!r}")
    except openai.APIStatusError as exc:  # refused before any streaming
        outcome = Outcome(model, action.__name__, exc.status_code, error_code(exc.body))
    except openai.APIError as exc:  # the SDK met an error event mid-stream
        outcome = Outcome(model, action.__name__, 200, error_code(exc.body))
    except (Malformed, ValueError, KeyError, TypeError, AttributeError) as exc:
        outcome = Outcome(model, action.__name__, 0, problem=f"malformed: {exc!r}")
    outcome.seconds = time.monotonic() - started
    outcome.problem = outcome.problem or judge(outcome)
    return outcome


def error_code(body) -> str:
    """The body's error code; for anything but an OpenAI error body, a description that judge() refuses."""
    if not isinstance(body, dict) or not isinstance(body.get("message"), str) or "code" not in body:
        return f"not an OpenAI error body: {body!r}"
    return body["code"]


def judge(o: Outcome) -> str | None:
    """What is wrong with an outcome, if anything."""
    if o.seconds > DEADLINE_S:
        return f"took {o.seconds:.1f}s"
    if o.code not in ALLOWED.get(o.status, ()):
        return f"status {o.status} with code {o.code}"
    if o.model == "tight" and (o.code == "scheduler_out_of_memory") != (o.action == "too_long_for_the_cache"):
        return f"{o.action} on tight ended with {o.code}"  # tight is never signalled: nothing else may fail there
    return None


def client_loop(app, seed: int, index: int, outcomes: list, faults_done: threading.Event) -> None:
    rng = random.Random(f"{seed}/client/{index}")
    client = app.client(timeout=DEADLINE_S)
    while not (faults_done.is_set() and len(outcomes) >= TOTAL_REQUESTS):
        outcome = run_one(client, rng)
        outcomes.append(outcome)
        if outcome.status in (429, 503):
            time.sleep(rng.uniform(0.1, 0.3))  # a polite client backs off instead of spinning on a restarting model


# --- the fault schedule ----------------------------------------------------------------------------------

def next_victim(app, rng: random.Random, signalled: dict) -> tuple[str, int]:
    """A victim model that is ready on a live worker not signalled before (wait for one)."""
    def ready_victims():
        return sorted((m["name"], m["pid"]) for m in app.status()["models"] if m["name"] in VICTIMS
                      and m["state"] == "ready" and m["pid"] not in signalled.values() and pid_alive(m["pid"]))
    return rng.choice(wait_until(ready_victims, RECOVERY_TIMEOUT_S, "a victim recovered"))


def inject_faults(app, seed: int, sent: collections.Counter, errors: list, faults_done: threading.Event) -> None:
    rng = random.Random(f"{seed}/faults")
    signalled: dict[str, int] = {}
    try:
        for _ in range(FAULTS):
            time.sleep(rng.uniform(1.0, 3.0))  # room between faults for traffic that succeeds
            model, pid = next_victim(app, rng, signalled)
            kind = rng.choice(FAULT_KINDS)
            if kind == GARBAGE:
                channel = steal_fd(pid, worker_channel_fd(pid))
                os.write(channel, b"\x00\x00\x00\x03{{{")
                os.close(channel)
            else:
                os.kill(pid, signal.Signals[kind])
            signalled[model] = pid
            app.worker_pids.add(pid)
            sent[(model, kind)] += 1
        for model, pid in signalled.items():  # the last victims must come back too (clients still send)
            app.wait_model(model, "ready", RECOVERY_TIMEOUT_S, new_pid_not=pid)
    except BaseException as exc:  # reported by the test, not lost in a thread
        errors.append(exc)
    finally:
        faults_done.set()


# --- the run and its checks ------------------------------------------------------------------------------

def worker_children(front_pid: int) -> set[int]:
    """Every live process whose parent is the front and that runs appliance.worker with a model (not the parked
    spare, which holds none)."""
    found = set()
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
            stat = (proc / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"\0appliance.worker\0" in cmdline and ppid == front_pid and pid_alive(int(proc.name)) \
                and not parked_spare(stat, cmdline):
            found.add(int(proc.name))
    return found


def observed(outcomes: list[Outcome], model: str, code: str | None = None, status: int | None = None) -> int:
    return sum(1 for o in outcomes if o.model == model and (code is None or o.code == code)
               and (status is None or o.status == status))


def check_counters(scrape: dict, outcomes: list[Outcome], sent: collections.Counter) -> None:
    for model in (*VICTIMS, "tight"):
        faults = {kind: sent[(model, kind)] for kind in FAULT_KINDS}
        crashes = {sig.name: value(scrape, "openarc_worker_crashes_total", model=model, signal=sig.name, reason="crash")
                   for sig in SIGNALS}
        # Exact: each SIGABRT/SIGKILL hit one live worker once, and nothing else crashed a worker.
        assert crashes["SIGABRT"] == faults["SIGABRT"] and crashes["SIGKILL"] == faults["SIGKILL"], (model, crashes, faults)
        assert crashes["SIGSTOP"] == 0  # a frozen worker is killed by the stall monitor: a stall, not a crash
        assert sum(v for (name, labels), v in scrape.items() if name == "openarc_worker_crashes_total"
                   and dict(labels)["model"] == model) == faults["SIGABRT"] + faults["SIGKILL"]
        # Exact: each garbage frame ended one worker as a protocol error, which is not a crash.
        assert value(scrape, "openarc_worker_exits_total", model=model, reason="protocol_error") == faults[GARBAGE]
        # Exact: every fault cost one restart, and nothing else restarted a worker.
        assert value(scrape, "openarc_worker_restarts_total", model=model) == sum(faults.values()), (model, faults)
        errors = {kind: value(scrape, "openarc_request_errors_total", model=model, kind=kind) for kind in ERROR_KINDS.values()}
        # Exact: these are answered before any byte of a stream, so no client can miss them.
        for code in ("overloaded", "model_unavailable", "scheduler_out_of_memory"):
            assert errors[ERROR_KINDS[code]] == observed(outcomes, model, code), (model, code, errors)
        # A stream that hangs up can be counted an error its client never read (the error raced the hang-up):
        # so the counter lies between what clients saw and that plus the hang-ups.
        hangups = sum(1 for o in outcomes if o.model == model and o.disconnected)
        for code in ("worker_crash", "stall"):
            seen = observed(outcomes, model, code)
            assert seen <= errors[ERROR_KINDS[code]] <= seen + hangups, (model, code, errors, seen, hangups)
        # Each SIGSTOP is noticed through the requests it freezes: at least one stall error per SIGSTOP.
        assert errors["stall"] >= faults["SIGSTOP"], (model, errors, faults)
        for status in (429, 500, 503, 504):
            counted = sum(v for (name, labels), v in scrape.items() if name == "openarc_requests_total"
                          and dict(labels)["model"] == model and dict(labels)["status"] == str(status))
            assert counted == observed(outcomes, model, status=status), (model, status, counted)


def test_chaos_soak(appliance_factory, long_demo_model, demo_model, embedding_model, rerank_model, demo_whisper):
    seed = int(os.environ.get("OPENARC_SOAK_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"\nsoak seed: {seed} (rerun with OPENARC_SOAK_SEED={seed})")
    victim = {"max_running": 4, "max_queue": 4, "stall_timeout_s": STALL_TIMEOUT_S, "restart": RESTART}
    app = appliance_factory({"models": [
        model_entry("alpha", long_demo_model, **victim),
        model_entry("beta", demo_model, **victim),
        # prefix caching off: with it on, genai drops a small request beside one that cannot fit a 4-block cache
        # (docs/warm-sessions.md, as tests/test_failures.py's oom_config); max_context set past what the 4 blocks
        # hold, so a long prompt reaches genai's scheduler (left unset, the window is fitted to the cache: a 400)
        model_entry("tight", demo_model, scheduler_config={"num_kv_blocks": 4, "enable_prefix_caching": False},
                    max_running=2, max_queue=64, max_context=4096),
        model_entry("vectors", embedding_model, kind="embedding", **victim),
        model_entry("ranker", rerank_model, kind="rerank", **victim),
        model_entry("gamma", demo_whisper, kind="transcription", **victim)]},
        env=STEP_DELAY)
    outcomes: list[Outcome] = []
    sent: collections.Counter = collections.Counter()
    fault_errors: list[BaseException] = []
    faults_done = threading.Event()
    started = time.monotonic()
    threads = [threading.Thread(target=inject_faults, args=(app, seed, sent, fault_errors, faults_done))]
    threads += [threading.Thread(target=client_loop, args=(app, seed, i, outcomes, faults_done))
                for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    duration = time.monotonic() - started
    summary = collections.Counter((o.status, o.code) for o in outcomes)
    print(f"soak: {len(outcomes)} requests in {duration:.0f}s, faults {dict(sent)}, outcomes {dict(summary)}, "
          f"hang-ups {sum(o.disconnected for o in outcomes)}")
    assert not any(t.is_alive() for t in threads), f"seed {seed}: a client or the fault thread hung"
    assert not fault_errors, f"seed {seed}: {fault_errors}"
    assert len(outcomes) >= TOTAL_REQUESTS and sum(sent.values()) == FAULTS
    problems = [o for o in outcomes if o.problem]
    kinds = collections.Counter(f"{o.model} {o.action} -> {o.status} {o.code}" for o in problems)
    assert not problems, f"seed {seed}: {len(problems)} bad outcomes: {dict(kinds)}; first: {problems[:3]}"

    assert app.proc.poll() is None and http("GET", app.base + "/health")[0] == 200
    status, _, ready = http("GET", app.base + "/ready")
    assert status == 200, f"seed {seed}: {ready}"
    current = {m["pid"] for m in app.status()["models"]}
    assert worker_children(app.proc.pid) == current, "a worker the front no longer supervises is still running"
    assert not [pid for pid in app.worker_pids - current if pid_alive(pid)], "a signalled worker is still alive"
    check_counters(samples(app.metrics()), outcomes, sent)
