"""`python -m bench [--quick] [--url URL] [--peer NAME=URL ...] [--peer-pid NAME=PID ...] [--model-path DIR]`."""

from __future__ import annotations

import argparse
import asyncio
import signal
import tempfile
import time
from pathlib import Path

import aiohttp

from appliance.host.telemetry import process_rss_bytes
from bench import client, figures, hostile, lora, phases, replicas, report, sessions, sidebyside, speculative, workload
from bench.launcher import FAULT_MODEL, PERF_MODEL, RESTART, STALL_TIMEOUT_S, OwnAppliance
from bench.phases import CpuWatch, Server, process_tree

OWN_NAME = "openarc"
DEMO_MODEL = ("the demo model, built with `openarc demo-model --eos-after 0` (never stops before max_tokens, "
              "so every reply has the length asked for)")
NOTES = [
    "Every figure compares the server with the same model, prompts and token counts driven in process through "
    "openvino_genai.ContinuousBatchingPipeline (the worker's engine), warm, in a bare process, run just before. "
    "The baseline ignores EOS and counts the tokens it generated; a server reply with fewer tokens (its usage, else "
    "its text chunks) makes that figure 'not comparable' instead of a ratio of unequal work.",
    "The headline is what the server adds: per request (1-token request, server median - generate() median) and "
    "per token ((32-token added - 1-token added) / 31, against the step loop: add_request + step() + reading every "
    "handle each step, the engine API the worker itself drives, so the figure is the worker's own per-step work). "
    "The 32-token ratio to generate() is information. Requests are timed one at a time over a kept-alive connection, "
    "at the client from send to parsed body; the baseline times templating + generation + decoding.",
    "Streaming: tokens / time from the request to the last token. Like with like: the server holds text up to 2 ms "
    "to send fewer frames; the baseline is the step loop's raw rate (no per-token callback). generate() with a "
    "per-token Python callback, what a Python program streaming with genai gets, is shown for information.",
    "Concurrency: N clients each send requests back to back; the baseline runs N requests as one generate() batch. "
    "The server's max_running is shown beside each level: a level above it queues by configuration. "
    "CPU: each process's CPU time over the phase's wall time (100 % = one core).",
    f"Faults hit a second copy of the model (`{FAULT_MODEL}`, stall_timeout_s={STALL_TIMEOUT_S:g}, restart backoff "
    f"{RESTART['backoff_initial_s']:g} s, included in recovery). Recovery ends at the first 200 of a 1-token request "
    "polled every 5 ms; what is subtracted is the pipeline's own load in the new worker (/openarc/status "
    "pipeline_load_seconds, imports excluded); the rest of spawn to ready (interpreter, imports) is its own row.",
    "Client cost: the load generator's CPU time (asyncio + aiohttp, one process) per request and as a share of one "
    "core; it runs on the same cores as the server, so it is part of what the server figures pay.",
    "Memory is in MiB (2^20 bytes); each row says when it was read.",
    "Speculative decoding rows: bench.speculative's, on the demo pair (a 12-layer main model, 1-layer drafts sharing "
    "its tokenizer), one client, the same prompts for every model, speed-up against the plain model in the same "
    "run; the acceptance ratio is the server's own (/openarc/status).",
    "LoRA rows: bench.lora's, on the demo model and its demo adapters: 16 clients on the base alone, then spread "
    "over 1, 2 and 4 adapters of one model (genai runs one adapter set at a time: the worker rotates between "
    "adapters, draining the batch at each switch); the median of the repeats, their range as the spread.",
    "Hostile storm row: bench.hostile's headline, on its own appliance serving the demo model: one honest client's "
    "chat latency (16 tokens) beside N clients replaying the hostile suite's corpus of known bombs, over the same "
    "client alone; its full table (p90, the hostile answers, 5xx) is `python -m bench.hostile`.",
    "Warm sessions row: bench.sessions' headline, on its own appliance serving a demo model twice (default config, "
    "and prefix caching off), multi-turn conversations of a system prompt, tools and a growing history interleaved "
    "turn by turn; its full table (turn 1, the in-process floor, the spread) is `python -m bench.sessions`.",
    "Replicas row: bench.replicas' headline, on its own appliance serving the demo model as one worker with every "
    "core and as two replicas (device: [CPU, CPU]) with half the cores each, with affinity and with round robin, "
    "each driven alone by clients holding multi-turn conversations; meant for a many-core host (on a few cores the "
    "replicas share them with the clients). Its full table is `python -m bench.replicas`.",
]
PEER_NOTE = ("Side by side: the servers take turns, block by block (the order reversed every other block), with the "
             "same requests; each cell is that server's own figure, 'median / p99' for latencies. Memory and CPU "
             "count the process named with --peer-pid and its children. The SIGABRT trial signals the largest of "
             "those processes, the one holding the model (for openarc: the model's worker), once the client has "
             "seen {chunks} chunks, then polls with one-token requests for up to {wait:g} s; a peer's trial runs "
             "last, since it may not survive it.")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="a few repetitions of each figure (a smoke run, not a measurement)")
    p.add_argument("--url", help="measure the HTTP figures of this OpenAI-compatible server instead of starting one")
    p.add_argument("--name", default="server", help="with --url: what to call that server in the tables")
    p.add_argument("--model", help="with --url: the model to ask for (default: the first of /v1/models)")
    p.add_argument("--device", default="CPU", help="OpenVINO device of the in-process baseline and of the bench's own "
                                                   "appliance (default CPU; GPU on an Arc box)")
    p.add_argument("--model-path", help="the model on disk, for the in-process baseline and ratios (default: the "
                                        "bench builds the demo model with --eos-after 0 and, without --url, serves it)")
    p.add_argument("--peer", action="append", default=[], metavar="NAME=URL[#MODEL]",
                   help="another OpenAI-compatible server to drive alternately with the same workload (repeatable); "
                        "#MODEL picks its model (default: the first of its /v1/models)")
    p.add_argument("--peer-pid", action="append", default=[], metavar="NAME=PID",
                   help="the main process of a peer (or of the --url server): its memory, its CPU, and a "
                        "SIGABRT-mid-stream trial that may end it for good")
    p.add_argument("--engine-threads", type=int, metavar="N",
                   help="INFERENCE_NUM_THREADS for the in-process baseline and the bench's own appliance alike "
                        "(default: OpenVINO's, every core)")
    p.add_argument("--demo-cache", type=Path, metavar="DIR",
                   help="where the speculative rows' demo pair is built or found (default: a temporary directory)")
    p.add_argument("--out", default=str(report.RESULTS), help="where results.json, results.md and the appliance's log go "
                                                       "(default: bench/results)")
    args = p.parse_args(argv)
    if args.engine_threads is not None and args.engine_threads < 1:
        p.error("--engine-threads must be at least 1")
    args.properties = {"INFERENCE_NUM_THREADS": args.engine_threads} if args.engine_threads else {}
    args.peers = [_named(p, value, "--peer") for value in args.peer]
    args.peer_pids = {}
    for value in args.peer_pid:
        name, pid = _named(p, value, "--peer-pid")
        if not pid.isdigit():
            p.error(f"--peer-pid {value}: PID must be a number")
        args.peer_pids[name] = int(pid)
    names = [name for name, _ in args.peers] + [args.name if args.url else OWN_NAME]
    if len(set(names)) != len(names):
        p.error(f"server names must differ: {', '.join(names)}")
    if unknown := set(args.peer_pids) - set(names):
        p.error(f"--peer-pid names no server: {', '.join(sorted(unknown))}")
    return args


def _named(parser: argparse.ArgumentParser, value: str, flag: str) -> tuple[str, str]:
    name, sep, rest = value.partition("=")
    if not sep or not name or not rest:
        parser.error(f"{flag} {value}: expected NAME=VALUE")
    return name, rest


async def peer_servers(session: aiohttp.ClientSession, peers: list[tuple[str, str]], pids: dict[str, int]) -> list[Server]:
    servers = []
    for name, target in peers:
        url, _, model = target.partition("#")
        url = url.rstrip("/")
        servers.append(Server(name, url, model or await client.first_model(session, url), pids.get(name)))
    return servers


async def measure(session: aiohttp.ClientSession, servers: list[Server], plan, cpu_probe,
                  baseline: phases.InProcess | None) -> sidebyside.Measured:
    for server in servers:
        await phases.warm(session, server, plan)
    latency = await phases.latency(session, servers, plan, workload.OVERHEAD_TOKENS, baseline)
    return sidebyside.Measured(
        fixed=await phases.latency(session, servers, plan, workload.FIXED_COST_TOKENS, baseline),
        latency=latency,
        streaming=await phases.streaming(session, servers, plan, baseline),
        concurrency=await phases.concurrency(session, servers, plan, cpu_probe, baseline))


def primary_figures(measured: sidebyside.Measured, name: str, baseline: dict | None,
                    max_running: int | None = None) -> list:
    base = baseline or {}
    return (figures.costs(measured.fixed[name], measured.latency[name], baseline)
            + figures.latency(measured.latency[name], base.get("latencies_s"), workload.OVERHEAD_TOKENS,
                              base.get("step_latencies_s"), figures.equal_work(baseline).get("latencies_s"))
            + [figures.streaming(measured.streaming[name], baseline)]
            + figures.concurrency(measured.concurrency[name], baseline, max_running)
            + [report.Figure("Dialect deviations from OpenAI's API (all replies)",
                             sidebyside.deviations_text(measured, name), None, "")])


class Run:
    """One bench run: the servers, what was measured, and what goes into the report."""

    def __init__(self, args: argparse.Namespace, plan, model_path: Path | None):
        self.args, self.plan, self.model_path = args, plan, model_path
        self.baseline: dict | None = None  # the in-process figures, once measured
        self.servers: list[Server] = []
        self.processes: dict[str, dict[str, list[int]]] = {}  # server -> {label: pids} for CPU and memory
        self.rss: dict[str, int | None] = {}
        self.aborts: dict[str, sidebyside.AbortTrial | None] = {}

    async def cpu_probe(self, server: Server) -> CpuWatch | None:
        labelled = self.processes.get(server.name)
        return CpuWatch(labelled) if labelled else None

    def note_peer_processes(self) -> None:
        for server in self.servers:
            if server.pid is not None and server.name not in self.processes:
                self.processes[server.name] = {server.name: process_tree(server.pid)}

    async def abort_peers(self, session: aiohttp.ClientSession) -> None:
        for server in self.servers:
            if server.pid is not None and server.name not in self.aborts:
                tree = process_tree(server.pid)
                self.rss[server.name] = sidebyside.rss_bytes(tree)
                # the process that holds the model: the largest of the tree (the named one, for a single process)
                holder = max(tree, key=process_rss_bytes)
                self.aborts[server.name] = await sidebyside.abort_trial(
                    session, server.base, server.model, holder, self.plan.revive_timeout_s)

    def side_by_side(self, measured: sidebyside.Measured) -> dict | None:
        if len(self.servers) < 2:
            return None
        rows = sidebyside.rows(self.servers, measured, self.baseline, self.rss, self.aborts)
        return {"servers": [{"name": s.name, "url": s.base, "model": s.model} for s in self.servers], "rows": rows,
                "markdown": sidebyside.markdown(self.servers, rows)}

    async def start_baseline(self) -> phases.InProcess | None:
        """The in-process baseline's process (idle while the servers are measured), when there is a model on disk."""
        if not self.model_path:
            return None
        return await phases.InProcess.start(self.model_path, self.args.device, self.args.properties)

    async def finish_baseline(self, in_process: phases.InProcess | None, measured=None) -> None:
        if in_process and measured is not None:
            await phases.equal_work(in_process, measured, self.servers[0].name)
        if in_process:
            self.baseline = await in_process.finish(self.plan.death_trials)

    async def against_own_appliance(self, out: Path) -> tuple[list, dict | None]:
        app = OwnAppliance(self.model_path, out, device=self.args.device, runtime_config=self.args.properties)
        in_process = None
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
            try:
                in_process = await self.start_baseline()
                await app.start(session)
                worker = await app.worker_pid(session, PERF_MODEL)
                own = Server(OWN_NAME, app.base, PERF_MODEL, app.pid)
                self.servers = [own] + await peer_servers(session, self.args.peers, self.args.peer_pids)
                self.processes[OWN_NAME] = {"front": [app.pid], "worker": [worker]}
                self.note_peer_processes()
                await phases.warm(session, own, self.plan)
                front_idle = process_rss_bytes(app.pid)
                peak, lag = figures.PeakRss(app.pid), figures.LoopLag(session, app.base)
                samplers = [asyncio.create_task(peak.run()), asyncio.create_task(lag.run())]
                measured = await measure(session, self.servers, self.plan, self.cpu_probe, in_process)
                for sampler in samplers:
                    sampler.cancel()
                worker_rss = process_rss_bytes(worker)
                self.rss[OWN_NAME] = process_rss_bytes(app.pid) + worker_rss
                self.aborts[OWN_NAME] = await sidebyside.abort_trial(
                    session, app.base, FAULT_MODEL, await app.worker_pid(session, FAULT_MODEL),
                    self.plan.revive_timeout_s)
                aborts = await figures.trials(session, app, signal.SIGABRT, self.plan.fault_trials)
                stalls = await figures.trials(session, app, signal.SIGSTOP, self.plan.stall_trials)
                await self.abort_peers(session)
                app.stop()
                await self.finish_baseline(in_process, measured)
            finally:
                app.stop()
                if in_process:
                    in_process.kill()
        found = (primary_figures(measured, OWN_NAME, self.baseline, app.max_running(PERF_MODEL))
                 + figures.fault_figures(aborts, stalls, self.baseline)
                 + figures.memory(front_idle, peak.peak, worker_rss, self.baseline) + [lag.figure()])
        return found, self.side_by_side(measured)

    async def against_url(self, url: str) -> tuple[list, dict | None]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
            model = self.args.model or await client.first_model(session, url)
            primary = Server(self.args.name, url, model, self.args.peer_pids.get(self.args.name))
            self.servers = [primary] + await peer_servers(session, self.args.peers, self.args.peer_pids)
            self.note_peer_processes()
            in_process = await self.start_baseline()
            try:
                measured = await measure(session, self.servers, self.plan, self.cpu_probe, in_process)
                await self.abort_peers(session)
                await self.finish_baseline(in_process, measured)
            finally:
                if in_process:
                    in_process.kill()
        found = primary_figures(measured, primary.name, self.baseline)
        return found + figures.http_only("needs the bench's own appliance (not with --url)"), self.side_by_side(measured)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan, plan_name = (workload.QUICK, "quick") if args.quick else (workload.FULL, "full")
    started = time.monotonic()
    load_at_start = report.load_average()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="openarc-bench-") as tmp:
        model_path = Path(args.model_path) if args.model_path else None
        model_text = str(model_path) if model_path else DEMO_MODEL
        if model_path is None and not args.url:
            from appliance.demo.catalog import build_demo_model
            model_path = build_demo_model(Path(tmp) / "demo", eos_after=0, max_new_tokens=4096)  # never stops early
        elif model_path is None:
            model_text = f"{args.model or 'the first model'} as {args.url} serves it (no in-process baseline)"
        run = Run(args, plan, model_path)
        if args.url:
            target = args.url.rstrip("/")
            found, side = asyncio.run(run.against_url(target))
        else:
            target = f"its own appliance (python -m appliance serve, {args.device})"
            found, side = asyncio.run(run.against_own_appliance(out))
            if args.device == "CPU":  # the demo pair is built for the CPU
                spec_dir = Path(tmp) / "speculative"
                spec_dir.mkdir()
                found += asyncio.run(speculative.measure(spec_dir, args.quick, args.properties, args.demo_cache))[1]
                found += [f for f in asyncio.run(sessions.measure(args.quick))[1] if f.name == sessions.HEADLINE]
                found += asyncio.run(lora.measure(args.quick, args.properties))[1]
                found += [f for f in asyncio.run(replicas.measure(args.quick))[1] if f.name == replicas.HEADLINE]
            found += [f for f in asyncio.run(hostile.measure(args.quick))[1] if f.name == hostile.HEADLINE]
    names = ", ".join(f"{s.name} ({s.base})" for s in run.servers[1:])
    meta = {"date": report.now(), "mode": plan_name, "duration_s": time.monotonic() - started,
            "target": target + (f", alongside {names}" if names else ""), "primary": run.servers[0].name,
            "model": model_text, "machine": report.machine(),
            "load": f"{load_at_start} at the start, {report.load_average()} at the end",
            "baseline_load_seconds": run.baseline and run.baseline["load_seconds"]}
    notes = NOTES + ([PEER_NOTE.format(chunks=sidebyside.ABORT_AFTER_CHUNKS, wait=plan.revive_timeout_s)] if side else [])
    print(report.write(out, meta, found, notes, side))
    return 0
