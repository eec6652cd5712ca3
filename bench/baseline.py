"""The in-process baseline: the same model in a bare process, driven through openvino_genai directly.

Run as `python -m bench.baseline MODEL_PATH --plan full|quick`; prints one JSON object. It runs in its own
process, before the appliance starts, so the two never compete for the 2 cores and the process's resident
memory is what the pipeline alone takes (the worker's overhead is measured against it).
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

from appliance.telemetry import process_rss_bytes
from bench import workload


class InProcess:
    """A warm ContinuousBatchingPipeline (the engine the appliance's worker runs) and the templating it needs."""

    def __init__(self, model_path: str):
        import openvino_genai
        self.og = openvino_genai
        started = time.monotonic()
        self.pipe = openvino_genai.ContinuousBatchingPipeline(model_path, openvino_genai.SchedulerConfig(), "CPU", {})
        self.load_seconds = time.monotonic() - started
        self.tokenizer = self.pipe.get_tokenizer()

    def prompt(self, i: int) -> str:
        # Templating is part of the timed work: the worker does it for every chat request too.
        history = self.og.ChatHistory(workload.messages(i))
        return self.tokenizer.apply_chat_template(history, add_generation_prompt=True)

    def config(self, max_tokens: int):
        config = self.og.GenerationConfig()
        config.max_new_tokens = max_tokens
        config.eos_token_id = self.tokenizer.get_eos_token_id()
        return config

    def generate(self, prompts: list[int], max_tokens: int, streamer=None) -> list:
        texts = [self.prompt(i) for i in prompts]
        return self.pipe.generate(texts, [self.config(max_tokens)] * len(texts), streamer)


def latencies(engine: InProcess, plan: workload.Plan) -> list[float]:
    for i in range(plan.warmup):
        engine.generate([i], workload.OVERHEAD_TOKENS)
    samples = []
    for i in range(plan.overhead_requests):
        started = time.perf_counter()
        engine.generate([i], workload.OVERHEAD_TOKENS)
        samples.append(time.perf_counter() - started)
    return samples


def stream_rates(engine: InProcess, plan: workload.Plan) -> list[float]:
    rates = []
    for i in range(plan.stream_requests + 1):  # the first one warms the longer KV cache
        times: list[float] = []

        def on_text(text: str):
            times.append(time.perf_counter())
            return engine.og.StreamingStatus.RUNNING

        engine.generate([i], workload.STREAM_TOKENS, on_text)
        if i:
            rates.append(workload.decode_rate(times, workload.STREAM_TOKENS))
    return rates


def aggregate_rates(engine: InProcess, plan: workload.Plan) -> dict[str, float]:
    """The same number of requests at once, as one batch, `rounds_per_client` times: tokens per second."""
    rates = {}
    for clients in workload.CONCURRENCY_LEVELS:
        prompts = list(range(clients))
        engine.generate(prompts, workload.CONCURRENCY_TOKENS)
        started = time.perf_counter()
        tokens = 0
        for _ in range(plan.rounds_per_client):
            results = engine.generate(prompts, workload.CONCURRENCY_TOKENS)
            tokens += clients * workload.CONCURRENCY_TOKENS
            assert len(results) == clients
        rates[str(clients)] = tokens / (time.perf_counter() - started)
    return rates


def no_core_dumps() -> None:
    # The fault figures abort processes dozens of times per run: no core files.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def death_notice(model_path: str) -> float:
    """SIGABRT a bare process that is generating; seconds until the kernel closes its end of a socket."""
    ours, theirs = socket.socketpair()
    with ours:
        proc = subprocess.Popen([sys.executable, "-m", "bench.doomed", str(theirs.fileno()), model_path],
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


def run(model_path: str, plan: workload.Plan) -> dict:
    engine = InProcess(model_path)
    result = {"pipeline": "ContinuousBatchingPipeline", "load_seconds": engine.load_seconds,
              "latencies_s": latencies(engine, plan), "stream_tokens_per_s": stream_rates(engine, plan),
              "aggregate_tokens_per_s": aggregate_rates(engine, plan)}
    # After the same work the worker will have done: the KV cache has grown to the same size.
    result["rss_bytes"] = process_rss_bytes(os.getpid())
    result["death_notice_s"] = [death_notice(model_path) for _ in range(plan.death_trials)]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.baseline")
    parser.add_argument("model_path")
    parser.add_argument("--plan", choices=("full", "quick"), default="full")
    args = parser.parse_args(argv)
    plan = workload.QUICK if args.plan == "quick" else workload.FULL
    json.dump(run(args.model_path, plan), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
