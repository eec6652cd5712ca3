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
        # Exactly max_tokens, whatever the model: the server's figures are compared only where it produced as
        # many, so both sides always did the same work.
        config.ignore_eos = True
        return config

    def generate(self, prompts: list[int], max_tokens: int, streamer=None) -> list:
        texts = [self.prompt(i) for i in prompts]
        return self.pipe.generate(texts, [self.config(max_tokens)] * len(texts), streamer)


def latencies(engine: InProcess, plan: workload.Plan, tokens: int) -> list[float]:
    for i in range(plan.warmup):
        engine.generate([i], tokens)
    samples = []
    for i in range(plan.overhead_requests):
        started = time.perf_counter()
        engine.generate([i], tokens)
        samples.append(time.perf_counter() - started)
    return samples


def stream_rates(engine: InProcess, plan: workload.Plan) -> list[float]:
    rates = []
    for i in range(plan.stream_requests + 1):  # the first one warms the longer KV cache
        times: list[float] = []

        def on_text(text: str):
            times.append(time.perf_counter())
            return engine.og.StreamingStatus.RUNNING

        started = time.perf_counter()
        engine.generate([i], workload.STREAM_TOKENS, on_text)
        rate = workload.stream_rate(started, times, workload.STREAM_TOKENS)
        if i and rate is not None:
            rates.append(rate)
    return rates


def aggregate_rates(engine: InProcess, plan: workload.Plan) -> tuple[dict[str, float], dict[str, float]]:
    """The same number of requests at once, as one batch, `rounds_per_client` times (times the blocks a run with
    peers cuts each figure into): tokens per second, and this process's CPU as a share of one core."""
    rates, cpu_shares = {}, {}
    for clients in workload.CONCURRENCY_LEVELS:
        prompts = list(range(clients))
        engine.generate(prompts, workload.CONCURRENCY_TOKENS)
        started, cpu = time.perf_counter(), time.process_time()
        tokens = 0
        for _ in range(plan.rounds_per_client * plan.blocks):
            results = engine.generate(prompts, workload.CONCURRENCY_TOKENS)
            tokens += clients * workload.CONCURRENCY_TOKENS
            assert len(results) == clients
        elapsed = time.perf_counter() - started
        rates[str(clients)] = tokens / elapsed
        cpu_shares[str(clients)] = (time.process_time() - cpu) / elapsed
    return rates, cpu_shares


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
              "latencies_s": latencies(engine, plan, workload.OVERHEAD_TOKENS),
              # after the longer requests, in the same order as against the server (the first ones run slower)
              "fixed_latencies_s": latencies(engine, plan, workload.FIXED_COST_TOKENS),
              "stream_tokens_per_s": stream_rates(engine, plan)}
    result["aggregate_tokens_per_s"], result["aggregate_cpu"] = aggregate_rates(engine, plan)
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
