"""One headless run of a real client against a server, through the recording proxy: what it printed, how it
exited, and every request it made with the answer it got.

A run gets a fresh home and work directory under `root` (its configuration, sessions and caches stay there) and
its own process group, so a client that hangs is killed with everything it started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.clients.catalog import Client, Turn
from bench.clients.install import Installed
from bench.clients.proxy import Answer, Exchange, RecordingProxy, ToolCallOnce
from bench.clients.reading import dumps

RUN_TIMEOUT_S = 300  # only catches a hang: a run is one or two turns on a demo model
MARKER_TEXT = "openarc-marker-5150"  # what the round trip's file holds, so its result can be recognised
TOOL_PROMPT = "Read the file marker.txt in the current directory and tell me what it says."
TEXT_PROMPT = "Say hello in one short sentence."


@dataclass
class ClientRun:
    client: str
    version: str
    turn: Turn
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    exchanges: list[Exchange] = field(default_factory=list)

    def report(self) -> str:
        """Everything a failing assertion should show: exit status, the client's last words, the wire."""
        return (f"{self.client} {self.version} ({self.turn.model or 'its default model'}) exited {self.returncode} "
                f"after {self.seconds:.1f}s\n--- requests\n{dumps(self.exchanges)}\n"
                f"--- stdout (end)\n{self.stdout[-1500:]}\n--- stderr (end)\n{self.stderr[-1500:]}")


def run_client(installed: Installed, client: Client, upstream: str, turn: Turn, root: Path,
               answer: Answer | None = None, timeout: float = RUN_TIMEOUT_S) -> ClientRun:
    """Run `client` once with `turn` against `upstream` (the server's base URL) through a recording proxy."""
    home, work = root / "home", root / "work"
    home.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    with RecordingProxy(upstream, answer) as proxy:
        invocation = client.invoke(installed.executable, proxy.base, turn, home)
        started = time.monotonic()
        process = subprocess.Popen(invocation.argv, cwd=work, env=invocation.env, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stdout, stderr = _kill(process)
            stderr += f"\n[bench.clients: killed after {timeout:.0f} s]"
        finally:
            _kill_group(process.pid)
        seconds = time.monotonic() - started
        return ClientRun(client.name, installed.version, turn, process.returncode, stdout, stderr, seconds,
                         proxy.take())


def tool_round_trip(installed: Installed, client: Client, upstream: str, model: str | None, root: Path,
                    timeout: float = RUN_TIMEOUT_S) -> ClientRun:
    """A run whose first turn the proxy answers with one call to the client's probe tool, which reads a file
    holding MARKER_TEXT; the client runs it and sends call and result to the server for the next turn."""
    work = root / "work"
    work.mkdir(parents=True, exist_ok=True)
    marker = work / "marker.txt"
    marker.write_text(MARKER_TEXT + "\n")
    answer = ToolCallOnce(client.tool.name, lambda schema: client.tool.arguments(marker, schema))
    return run_client(installed, client, upstream, Turn(TOOL_PROMPT, model, tool=True), root, answer, timeout)


def _kill(process: subprocess.Popen) -> tuple[str, str]:
    _kill_group(process.pid)
    stdout, stderr = process.communicate()
    return stdout or "", stderr or ""


def _kill_group(pgid: int) -> None:
    """The client's process group, all of it (a client may leave helpers: language servers, sandboxes)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
