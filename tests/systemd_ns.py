"""A real systemd (PID 1) in throwaway namespaces, for testing the shipped units.

systemd boots as PID 1 of new PID/mount/cgroup/UTS namespaces on an overlay of the
host's `/` whose upper layer is a tmpfs: everything it (or a test) writes vanishes
on exit, while the host's /opt/openarc/venv and the repository stay visible.
The network namespace is shared with the host, so a test reaches services on
127.0.0.1 directly (and must pick free ports); with private_network=True it gets
its own (loopback only, brought up by systemd), where podman may create bridges
and firewall rules without touching the host's, and `in_network()` runs a host
program in it.

Never run a system-mode systemd on the host's own root: Debian's tmpfiles rule
`D /tmp` would wipe the host's /tmp. Here it only sees its private tmpfs.

    with SystemdNamespace(units={"toy.service": text}, files={"/etc/x": "..."}) as ns:
        ns.systemctl("start", "toy")
        pid = ns.main_pid("toy")
        ns.kill(pid, "ABRT")
        ns.show("toy", "NRestarts")

Teardown always powers off and then kills whatever is left (the unshare process
has a parent-death signal, the namespace lives in its own cgroup, and PID 1's
death kills every process of its PID namespace), also when the test body raises
or the test process itself is killed.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

BOOT_TARGET = "openarc-test.target"

# Units that would act on the host's kernel, clock, devices or firmware (the
# namespace shares them), or that wait for hardware that is not there.
HOST_CHANGING_UNITS = (
    "systemd-sysctl.service",
    "systemd-modules-load.service",
    "kmod-static-nodes.service",
    "systemd-binfmt.service",
    "proc-sys-fs-binfmt_misc.automount",
    "proc-sys-fs-binfmt_misc.mount",
    "systemd-udevd.service",
    "systemd-udevd-control.socket",
    "systemd-udevd-kernel.socket",
    "systemd-udev-trigger.service",
    "systemd-udev-settle.service",
    "systemd-hwdb-update.service",
    "getty.target",
    "getty@.service",
    "console-getty.service",
    "serial-getty@.service",
    "systemd-timesyncd.service",
    "systemd-random-seed.service",
    "systemd-pstore.service",
    "systemd-firstboot.service",
    "systemd-repart.service",
    "systemd-pcrphase.service",
    "systemd-pcrphase-sysinit.service",
    "systemd-remount-fs.service",
    "systemd-fsck-root.service",
    "systemd-logind.service",
    "sys-kernel-config.mount",
    "sys-kernel-debug.mount",
    "sys-kernel-tracing.mount",
    "sys-fs-fuse-connections.mount",
)

# Device nodes a container gets; everything else (GPUs included) is absent.
DEVICE_NODES = ("null", "zero", "full", "random", "urandom", "tty")

CGROUP2_ROOT = Path("/sys/fs/cgroup/unified")
if not (CGROUP2_ROOT / "cgroup.procs").exists():  # a pure cgroup2 host
    CGROUP2_ROOT = Path("/sys/fs/cgroup")

BOOT_SCRIPT = r"""
set -eu
stage=$1; name=$2
root=$stage/root
mount -t tmpfs -o mode=0755 "$name-layer" "$stage/layer"
mkdir "$stage/layer/upper" "$stage/layer/work"
mount -t overlay "$name" -o "lowerdir=$LOWER_DIR,upperdir=$stage/layer/upper,workdir=$stage/layer/work" "$root"

mount -t proc -o nosuid,nodev,noexec proc "$root/proc"
mount -t sysfs -o ro,nosuid,nodev,noexec sysfs "$root/sys"
mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 "$root/sys/fs/cgroup"

mount -t tmpfs -o mode=0755,nosuid dev "$root/dev"
for node in $DEVICE_NODES; do
    touch "$root/dev/$node"
    mount --bind "/dev/$node" "$root/dev/$node"
done
mkdir -m 0755 "$root/dev/pts"
mkdir -m 1777 "$root/dev/shm"
mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts "$root/dev/pts"
mount -t tmpfs -o mode=1777,nosuid,nodev shm "$root/dev/shm"
ln -s pts/ptmx "$root/dev/ptmx"
ln -s /proc/self/fd "$root/dev/fd"
ln -s /proc/self/fd/0 "$root/dev/stdin"
ln -s /proc/self/fd/1 "$root/dev/stdout"
ln -s /proc/self/fd/2 "$root/dev/stderr"

mount -t tmpfs -o mode=0755,nosuid,nodev run "$root/run"
mount -t tmpfs -o mode=1777,nosuid,nodev tmp "$root/tmp"

# Read-only bind mounts: lines "host_path<TAB>path_inside".
while IFS="$(printf '\t')" read -r src dst; do
    [ -n "$src" ] || continue
    if [ -d "$src" ]; then mkdir -p "$root$dst"; else mkdir -p "$(dirname "$root$dst")"; touch "$root$dst"; fi
    mount --bind "$src" "$root$dst"
    mount -o remount,bind,ro "$root$dst"
done < "$stage/binds"

cp -a "$stage/tree/." "$root/"
hostname "$name"

cd "$root"
mkdir -p .oldroot
pivot_root . .oldroot
umount -l /.oldroot
rmdir /.oldroot
exec env -i container="$name" PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    /lib/systemd/systemd --system --unit=$BOOT_TARGET
"""

# With /dev/kmsg bound in (devices=("kmsg",)), journald would read the host's kernel log and
# log its own messages into it: keep the host's kernel log out of the test, and the test out of it.
JOURNALD_CONF = "[Journal]\nReadKMsg=no\n"
JOURNALD_DROPIN = "[Service]\nEnvironment=SYSTEMD_LOG_TARGET=null\n"

TARGET_UNIT = """[Unit]
Description=Boot target of the openarc test namespace (starts nothing by itself)
DefaultDependencies=no
AllowIsolate=yes
"""

PR_SET_PDEATHSIG = 1
LEFTOVER_PREFIX = "openarc-ns-"  # names both the stage directory and the cgroup of a namespace


class NamespaceError(RuntimeError):
    pass


def _die_with_parent() -> None:
    """preexec hook: SIGKILL us when the test process dies, so even a killed
    pytest leaves no namespace behind (unshare --kill-child then kills PID 1)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class SystemdNamespace:
    """Context manager: boots systemd in fresh namespaces, tears it all down on exit.

    units:   {"name.service": unit text} -> /etc/systemd/system/name.service
    dropins: {"name.service": {"10-x.conf": text}} -> /etc/systemd/system/name.service.d/
    files:   {"/abs/path": str | bytes | pathlib.Path (host file or directory to copy)}
    binds:   {"/host/path": "/path/inside"} read-only bind mounts
    devices: extra host device nodes to bind into /dev (e.g. ("kmsg",))
    lower:   the root file system the overlay covers (default the host's /; e.g. a debootstrapped tree)
    private_network: a network namespace of its own instead of the host's
    """

    def __init__(self, units=None, dropins=None, files=None, binds=None, devices=(),
                 name="openarc-test", boot_timeout=30.0, lower="/", private_network=False):
        self.lower = str(lower)
        self.private_network = private_network
        self.units = dict(units or {})
        self.dropins = dict(dropins or {})
        self.files = dict(files or {})
        self.binds = dict(binds or {})
        self.devices = DEVICE_NODES + tuple(devices)
        self.name = name
        self.boot_timeout = boot_timeout
        self.pid = None            # host PID of systemd (PID 1 inside)
        self.pid_namespace = None  # "pid:[inode]", for leak checks after close()
        self.stage = None
        self.cgroup = None
        self._unshare = None
        self._log = None

    # -- lifecycle ---------------------------------------------------------

    def __enter__(self) -> "SystemdNamespace":
        try:
            self._boot()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _boot(self) -> None:
        started = time.monotonic()
        # Also when the interpreter exits without closing us (an abandoned generator, sys.exit).
        atexit.register(self.close)
        _sweep_abandoned()
        name = f"{LEFTOVER_PREFIX}{uuid.uuid4().hex[:12]}"
        self.stage = Path(tempfile.gettempdir()) / name
        self.stage.mkdir(mode=0o700)
        self._write_stage()
        self.cgroup = CGROUP2_ROOT / name
        self.cgroup.mkdir()
        self._log = open(self.stage / "console.log", "wb")
        cgroup_procs = str(self.cgroup / "cgroup.procs")

        def enter_cgroup_and_die_with_parent():
            with open(cgroup_procs, "w") as procs:
                procs.write("0")
            _die_with_parent()

        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DEVICE_NODES": " ".join(self.devices),
               "BOOT_TARGET": BOOT_TARGET, "LOWER_DIR": self.lower}
        network = ["--net"] if self.private_network else []
        self._unshare = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--kill-child", "--mount", "--propagation", "private",
             "--cgroup", "--uts", *network, "/bin/sh", "-c", BOOT_SCRIPT, "boot", str(self.stage), self.name],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=env,
            preexec_fn=enter_cgroup_and_die_with_parent)
        self.pid = self._wait_for_child_systemd(started)
        self.pid_namespace = os.readlink(f"/proc/{self.pid}/ns/pid")
        self._wait_until_running(started)

    def _write_stage(self) -> None:
        for sub in ("root", "layer", "tree"):
            (self.stage / sub).mkdir()
        etc = "/etc/systemd/system"
        tree_files = {f"{etc}/{BOOT_TARGET}": TARGET_UNIT,
                      "/etc/systemd/journald.conf.d/50-openarc-test.conf": JOURNALD_CONF,
                      f"{etc}/systemd-journald.service.d/50-openarc-test.conf": JOURNALD_DROPIN}
        for unit, text in self.units.items():
            tree_files[f"{etc}/{unit}"] = text
        for unit, confs in self.dropins.items():
            for conf, text in confs.items():
                tree_files[f"{etc}/{unit}.d/{conf}"] = text
        tree_files.update(self.files)
        for path, content in tree_files.items():
            self._stage_file(path, content)
        for unit in HOST_CHANGING_UNITS:
            mask = self.stage / "tree" / etc.lstrip("/") / unit
            mask.parent.mkdir(parents=True, exist_ok=True)
            mask.symlink_to("/dev/null")
        (self.stage / "binds").write_text(
            "".join(f"{Path(src).resolve()}\t{dst}\n" for src, dst in self.binds.items()))

    def _stage_file(self, path: str, content) -> None:
        target = self.stage / "tree" / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            if content.is_dir():
                shutil.copytree(content, target, symlinks=True)
            else:
                shutil.copy2(content, target)
        elif isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content)

    def _wait_for_child_systemd(self, started: float) -> int:
        """The host PID of unshare's child, once it has exec'd systemd."""
        children = Path(f"/proc/{self._unshare.pid}/task/{self._unshare.pid}/children")
        while time.monotonic() - started < self.boot_timeout:
            if self._unshare.poll() is not None:
                raise NamespaceError(f"namespace setup failed:\n{self.console_log()}")
            with contextlib.suppress(OSError, ValueError, IndexError):
                pid = int(children.read_text().split()[0])
                if os.readlink(f"/proc/{pid}/exe").endswith("/systemd"):
                    return pid
            time.sleep(0.02)
        raise NamespaceError(f"systemd did not start:\n{self.console_log()}")

    def _wait_until_running(self, started: float) -> None:
        state = ""
        while time.monotonic() - started < self.boot_timeout:
            if self._unshare.poll() is not None:
                raise NamespaceError(f"systemd exited during boot:\n{self.console_log()}")
            state = self.systemctl("is-system-running", check=False, timeout=10).stdout.strip()
            if state in ("running", "degraded"):
                return
            time.sleep(0.05)
        raise NamespaceError(f"system state {state!r} after {self.boot_timeout}s:\n{self.console_log()}")

    def close(self) -> None:
        """Power off, then make sure nothing at all is left (idempotent)."""
        atexit.unregister(self.close)
        if self._unshare is not None:
            self._power_off()
            self._unshare = None
        if self.cgroup is not None:
            _kill_cgroup(self.cgroup)  # a no-op once it is gone
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.stage is not None:
            shutil.rmtree(self.stage, ignore_errors=True)
            self.stage = None

    def _power_off(self, timeout: float = 20.0) -> None:
        if self._unshare.poll() is None and self.pid is not None:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                self.systemctl("poweroff", "--no-block", check=False, timeout=5)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._unshare.wait(timeout)
        if self._unshare.poll() is None:
            self._unshare.kill()  # --kill-child: PID 1 and so the whole PID namespace die with it
            self._unshare.wait()

    def console_log(self) -> str:
        if self.stage is None or not (self.stage / "console.log").exists():
            return ""
        return (self.stage / "console.log").read_text(errors="replace")[-8000:]

    # -- driving -----------------------------------------------------------

    def run(self, argv, check=True, timeout=60.0, input=None) -> subprocess.CompletedProcess:
        """Run argv inside the namespaces (as root, in the namespace's root)."""
        network = ["-n"] if self.private_network else []
        cmd = ["nsenter", "-t", str(self.pid), "-m", "-p", "-u", "-C", *network, "--", *map(str, argv)]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, input=input,
                                env={"PATH": "/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                                     "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0"})
        if check and result.returncode != 0:
            raise NamespaceError(f"{' '.join(map(str, argv))} exited {result.returncode}\n"
                                 f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}")
        return result

    def in_network(self, argv, timeout=60.0) -> subprocess.CompletedProcess:
        """Run a host program (the host's files, e.g. the test venv) in the namespace's network."""
        return subprocess.run(["nsenter", "-t", str(self.pid), "-n", "--", *map(str, argv)], capture_output=True,
                              text=True, timeout=timeout)

    def systemctl(self, *args, check=True, timeout=120.0) -> subprocess.CompletedProcess:
        return self.run(["systemctl", *args], check=check, timeout=timeout)

    def show(self, unit: str, prop: str) -> str:
        return self.systemctl("show", "-p", prop, "--value", unit, timeout=15).stdout.strip()

    def main_pid(self, unit: str) -> int:
        """MainPID of unit, as a PID inside the namespace (0 when none)."""
        return int(self.show(unit, "MainPID"))

    def kill(self, pid: int, sig: str) -> None:
        """Send signal sig ("ABRT", "STOP", ...) to a PID of the namespace."""
        self.run(["kill", "-s", sig.removeprefix("SIG"), str(pid)])

    def journal(self, unit: str | None = None) -> str:
        argv = ["journalctl", "--no-pager", "-o", "short-monotonic"]
        if unit:
            argv += ["-u", unit]
        return self.run(argv, check=False, timeout=30).stdout

    def path(self, inside: str) -> Path:
        """The host path of a file inside the namespace (via /proc/PID/root)."""
        return Path(f"/proc/{self.pid}/root") / inside.lstrip("/")

    def wait_for(self, predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
        """Poll predicate() until it returns a truthy value; its value, or NamespaceError."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise NamespaceError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(interval)


def _sweep_abandoned(min_age_s: float = 60.0) -> None:
    """Remove the empty cgroups and stage directories that a SIGKILLed test process left
    (its namespaces died with it: see _die_with_parent). A namespace that is alive or
    still booting has processes in its cgroup, or is younger than min_age_s."""
    for cgroup in CGROUP2_ROOT.glob(f"{LEFTOVER_PREFIX}*"):
        with contextlib.suppress(OSError):
            if not _cgroup_pids(cgroup) and time.time() - cgroup.stat().st_mtime > min_age_s:
                _kill_cgroup(cgroup)
                shutil.rmtree(Path(tempfile.gettempdir()) / cgroup.name, ignore_errors=True)


def _kill_cgroup(cgroup: Path, timeout: float = 10.0) -> None:
    """SIGKILL everything under cgroup, then remove it and its sub-cgroups."""
    if not cgroup.exists():
        return
    kill_file = cgroup / "cgroup.kill"
    deadline = time.monotonic() + timeout
    while _cgroup_pids(cgroup) and time.monotonic() < deadline:
        if kill_file.exists():
            kill_file.write_text("1")
        else:
            for pid in _cgroup_pids(cgroup):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    for sub in sorted((p for p in cgroup.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        with contextlib.suppress(OSError):
            sub.rmdir()
    with contextlib.suppress(OSError):
        cgroup.rmdir()


def _cgroup_pids(cgroup: Path) -> list[int]:
    pids = []
    for procs in cgroup.rglob("cgroup.procs"):  # the top-level file included
        with contextlib.suppress(OSError):
            pids += [int(line) for line in procs.read_text().split()]
    return pids


def namespace_processes(pid_namespace: str) -> list[str]:
    """Host processes still in PID namespace `pid_namespace` ("pid:[inode]", as
    readlink /proc/PID/ns/pid says): for leak checks after close()."""
    leftovers = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if proc.name.isdigit() and os.readlink(proc / "ns/pid") == pid_namespace:
                leftovers.append(f"{proc.name} {(proc / 'cmdline').read_bytes()[:120]!r}")
    return leftovers
