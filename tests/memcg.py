"""A small memory cgroup for tests that need a real kernel OOM kill.

It is made under the memory cgroup this test process is in: on cgroup v2 with `memory.max` (where the memory
controller is delegated to it), on cgroup v1 (how this build machine's kernel mounts the memory controller) with
`memory.limit_in_bytes`. Swap is capped too where the kernel has the knob, so the limit ends in an OOM kill, not in
swapping. On leaving, whatever is still inside is SIGKILLed and the cgroup removed.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from appliance.host.oom import OomCounter, memory_cgroup_counter


class MemoryCgroup:
    def __init__(self, limit_bytes: int):
        counter = memory_cgroup_counter(os.getpid())
        if counter is None:
            pytest.skip("this process is in no memory cgroup whose oom_kill counter is readable")
        self.v2 = counter.path.name == "memory.events"
        self.path = counter.path.parent / f"openarc-test-{uuid.uuid4().hex[:8]}"
        self.oom_kills = OomCounter(self.path / counter.path.name)  # this cgroup's own oom_kill counter
        try:
            self.path.mkdir()
        except OSError as exc:
            pytest.skip(f"cannot create a memory cgroup under {counter.path.parent}: {exc}")
        # v1's memsw limit is memory plus swap, so equal to the memory limit means no swap
        limit, swap, swap_value = (("memory.max", "memory.swap.max", 0) if self.v2
                                   else ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes", limit_bytes))
        if not (self.path / limit).exists():
            self.close()
            pytest.skip(f"the memory controller is not enabled for {self.path}")
        (self.path / limit).write_text(str(limit_bytes))
        if (self.path / swap).exists():
            (self.path / swap).write_text(str(swap_value))

    @property
    def procs_file(self) -> Path:
        return self.path / "cgroup.procs"

    def shell_prefix(self) -> list[str]:
        """A command prefix that enters this cgroup, then execs the rest of the command line."""
        return ["/bin/sh", "-c", f'echo $$ > {self.procs_file} && exec "$@"', "enter-memcg"]

    def pids(self) -> list[int]:
        try:
            return [int(pid) for pid in self.procs_file.read_text().split()]
        except OSError:
            return []

    def close(self) -> None:
        deadline = time.monotonic() + 10
        while self.path.exists() and time.monotonic() < deadline:
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self.path.rmdir()
            except OSError:
                time.sleep(0.05)

    def __enter__(self) -> MemoryCgroup:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
