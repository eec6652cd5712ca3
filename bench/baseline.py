"""The in-process baseline: the same model in a bare process, driven through openvino_genai directly.

Run as `python -m bench.baseline MODEL_PATH [--device DEVICE]` (the bench does): it loads the pipeline, prints one
JSON line, then measures block by block on command (one JSON line in, one out), taking turns with the servers so
that a machine whose load drifts during the run treats both sides alike; while a server is measured it waits
idle. Its resident memory at the end is what the pipeline alone takes after the same work.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time

from appliance.host.telemetry import process_rss_bytes
from bench import workload


class InProcess:
    """A warm ContinuousBatchingPipeline (the engine the appliance's worker runs) and the templating it needs."""

    def __init__(self, model_path: str, device: str = "CPU", properties: dict | None = None):
        import openvino_genai
        from appliance.config import ModelConfig
        from appliance.worker.engines.batching import scheduler_config
        self.og = openvino_genai
        started = time.monotonic()
        # the scheduler the server's worker runs (prefix caching, openarc's prefill chunk): the same on both sides
        settings = ModelConfig(name="baseline", path=model_path, device=device).scheduler_settings()
        self.pipe = openvino_genai.ContinuousBatchingPipeline(model_path, scheduler_config(settings), device,
                                                              properties or {})
        self.load_seconds = time.monotonic() - started
        self.tokenizer = self.pipe.get_tokenizer()

    def prompt(self, i: int) -> str:
        # Templating is part of the timed work: the worker does it for every chat request too.
        history = self.og.ChatHistory(workload.messages(i))
        return self.tokenizer.apply_chat_template(history, add_generation_prompt=True)

    def configs(self, count: int, tokens: int | list[int]) -> list:
        """One config per request: `tokens` each, or request i the i-th of a list (equal work with a server whose
        replies stopped early: the baseline generates what the server produced, reply by reply)."""
        return [self.config(tokens[i % len(tokens)] if isinstance(tokens, list) else tokens) for i in range(count)]

    def config(self, max_tokens: int):
        config = self.og.GenerationConfig()
        config.max_new_tokens = max_tokens
        config.eos_token_id = self.tokenizer.get_eos_token_id()
        # Exactly max_tokens, whatever the model: the server's figures are compared only where it produced as
        # many, so both sides always did the same work.
        config.ignore_eos = True
        return config

    def generate(self, prompts: list[int], max_tokens: int | list[int], streamer=None) -> int:
        """generate() on the templated prompts, the answers decoded (as a server must): the tokens it generated.
        `max_tokens`: for all, or a list, one per prompt."""
        ids = [self.tokenizer.encode(self.prompt(i), add_special_tokens=False).input_ids for i in prompts]
        results = self.pipe.generate(ids, self.configs(len(ids), max_tokens), streamer)
        outputs = [result.m_generation_ids[0] for result in results]
        self.tokenizer.decode(outputs)
        return sum(len(tokens) for tokens in outputs)

    def step_loop(self, prompts: list[int], max_tokens: int, on_step=None) -> int:
        """The worker's own engine API without the worker: add_request, step(), read every handle each step, decode
        at the end; `on_step(tokens so far)` after each step. The tokens it generated."""
        handles = [self.pipe.add_request(i, self.tokenizer.encode(self.prompt(p), add_special_tokens=False).input_ids,
                                         self.config(max_tokens)) for i, p in enumerate(prompts)]
        outputs: list[list[int]] = [[] for _ in handles]
        running = self.og.GenerationStatus.RUNNING.value
        while True:
            self.pipe.step()
            live = False
            for handle, tokens in zip(handles, outputs):
                while handle.can_read():
                    for output in handle.read().values():
                        tokens += output.generated_ids
                live = live or handle.get_status().value == running
            if on_step:
                on_step(sum(len(tokens) for tokens in outputs))
            if not live:
                break
        self.tokenizer.decode(outputs)
        return sum(len(tokens) for tokens in outputs)


def warm(engine: InProcess, tokens: int, requests: int) -> dict:
    for i in range(requests):
        engine.generate([i], tokens)
    return {}


def nth(tokens: int | list[int], i: int) -> int:
    return tokens[i % len(tokens)] if isinstance(tokens, list) else tokens


def latency(engine: InProcess, tokens: int | list[int], requests: int) -> dict:
    """One request at a time: templating + generate() + decoding, and the same through the step loop, timed
    request by request in turns (so load that drifts hits both alike); the tokens each generated. `tokens`: a
    list gives request i its i-th count (equal work)."""
    seconds, step_seconds, generated = [], [], []
    for i in range(requests):
        started = time.perf_counter()
        generated.append(engine.generate([i], nth(tokens, i)))
        seconds.append(time.perf_counter() - started)
        started = time.perf_counter()
        generated.append(engine.step_loop([i], nth(tokens, i)))
        step_seconds.append(time.perf_counter() - started)
    return {"seconds": seconds, "step_seconds": step_seconds, "generated": generated}


def stream(engine: InProcess, requests: int, warm_first: bool, tokens: int | list[int] = workload.STREAM_TOKENS) -> dict:
    """The streaming rate, two ways: the step loop reading every handle each step (the engine's raw rate, what the
    worker's loop runs on; no per-token Python callback), and generate() with a streamer callback per token (what
    a Python program streaming with genai gets). Tokens / time from the call to the last token; the first request,
    if warm_first, only warms the longer KV cache."""
    rates, callback_rates = [], []
    for i in range(requests + warm_first):
        times: list[float] = []
        counted: list[int] = []

        def on_step(tokens: int):
            if not counted or tokens > counted[-1]:
                times.append(time.perf_counter())
                counted.append(tokens)

        started = time.perf_counter()
        produced = engine.step_loop([i], nth(tokens, i), on_step)
        rate = workload.stream_rate(started, times, produced)
        callback_times: list[float] = []

        def on_text(text: str):
            callback_times.append(time.perf_counter())
            return engine.og.StreamingStatus.RUNNING

        started = time.perf_counter()
        produced_by_callback = engine.generate([i], nth(tokens, i), on_text)
        callback_rate = workload.stream_rate(started, callback_times, produced_by_callback)
        if (i or not warm_first) and rate is not None and callback_rate is not None:
            rates.append(rate)
            callback_rates.append(callback_rate)
    return {"rates": rates, "callback_rates": callback_rates}


def aggregate(engine: InProcess, clients: int, rounds: int, warm_first: bool,
              tokens: int | list[int] = workload.CONCURRENCY_TOKENS) -> dict:
    """The clients' requests at once, as one batch, `rounds` times: the tokens generated (counted, not planned),
    seconds, and this process's CPU time. `tokens`: a list gives the batch's requests their counts in turn."""
    prompts = list(range(clients))
    if warm_first:
        engine.generate(prompts, tokens)
    started, cpu = time.perf_counter(), time.process_time()
    generated = 0
    for r in range(rounds):
        counts = [nth(tokens, r * clients + c) for c in range(clients)]
        generated += engine.generate(prompts, counts)
    planned = sum(nth(tokens, i) for i in range(clients * rounds))
    return {"tokens": generated, "planned": planned,
            "seconds": time.perf_counter() - started, "cpu_seconds": time.process_time() - cpu}


def no_core_dumps() -> None:
    # The fault figures abort processes dozens of times per run: no core files.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def death_notice(model_path: str, device: str) -> float:
    """SIGABRT a bare process that is generating; seconds until the kernel closes its end of a socket."""
    ours, theirs = socket.socketpair()
    with ours:
        proc = subprocess.Popen([sys.executable, "-m", "bench.doomed", str(theirs.fileno()), model_path, device],
                                pass_fds=(theirs.fileno(),), preexec_fn=no_core_dumps)
        theirs.close()
        try:
            if ours.recv(1) != b"r":
                raise RuntimeError("the doomed process died before it generated")
            time.sleep(0.05)  # well into a generation
            os.kill(proc.pid, signal.SIGABRT)
            killed = time.perf_counter()
            while ours.recv(4096):
                pass
            return time.perf_counter() - killed
        finally:
            proc.kill()
            proc.wait()


def finish(engine: InProcess, model_path: str, device: str, death_trials: int) -> dict:
    # After the same work the worker will have done: the KV cache has grown to the same size.
    return {"rss_bytes": process_rss_bytes(os.getpid()),
            "death_notice_s": [death_notice(model_path, device) for _ in range(death_trials)]}


def serve(model_path: str, device: str, properties: dict) -> None:
    """Load, say so, then answer one JSON command per line of stdin with one JSON line, until `finish`."""
    engine = InProcess(model_path, device, properties)
    reply({"pipeline": "ContinuousBatchingPipeline", "load_seconds": engine.load_seconds})
    ops = {"warm": warm, "latency": latency, "stream": stream, "aggregate": aggregate}
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        if op == "finish":
            reply(finish(engine, model_path, device, **command))
            return
        reply(ops[op](engine, **command))


def reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.baseline")
    parser.add_argument("model_path")
    parser.add_argument("--device", default="CPU")
    parser.add_argument("--properties", default="{}", help="OpenVINO properties as JSON (INFERENCE_NUM_THREADS)")
    args = parser.parse_args(argv)
    serve(args.model_path, args.device, json.loads(args.properties))
    return 0


if __name__ == "__main__":
    sys.exit(main())
