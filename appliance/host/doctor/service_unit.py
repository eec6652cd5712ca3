"""The systemd unit or Podman quadlet that runs openarc: installed, given the GPU (device access), not hardened in
a way that blocks it, with the kernel log readable for reset detection; and the user it runs as, which the render
node and model directory checks judge."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePosixPath

from appliance.host.doctor import Check, fail, ok, skip, warn
from appliance.host.doctor.box import Box, User

UNIT_DIRS = ("/etc/systemd/system", "/usr/local/lib/systemd/system", "/usr/lib/systemd/system", "/lib/systemd/system")
QUADLET_DIRS = ("/etc/containers/systemd", "/usr/share/containers/systemd")
DEFAULT_UNITS = ("openarc.service", "openarc.container")
INSTALL_FIX = "sudo units/install.sh (from the openarc source tree; docs/operations.md)"
KMSG_DROPIN = "units/openarc-kmsg.conf"


@dataclass
class Unit:
    name: str  # as asked: openarc.service, openarc@qwen.service, openarc.container
    path: str  # the unit file on the box
    dropins: list[str] = field(default_factory=list)
    settings: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # section -> key -> values in order

    @property
    def is_quadlet(self) -> bool:
        return self.path.endswith(".container")

    def values(self, section: str, key: str) -> list[str]:
        return self.settings.get(section, {}).get(key, [])

    def last(self, section: str, key: str, default: str = "") -> str:
        values = self.values(section, key)
        return values[-1] if values else default


def parse_unit(texts: list[str]) -> dict[str, dict[str, list[str]]]:
    """systemd's unit syntax over a file and its drop-ins in order: a key may repeat (lists grow), and an empty
    assignment (`Key=`) resets what came before."""
    settings: dict[str, dict[str, list[str]]] = {}
    for text in texts:
        section = ""
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line[0] in "#;":
                continue
            if line.startswith("[") and line.endswith("]"):
                section = line[1:-1]
                continue
            key, sep, value = line.partition("=")
            if not sep:
                continue
            values = settings.setdefault(section, {}).setdefault(key.strip(), [])
            if value.strip():
                values.append(value.strip())
            else:
                values.clear()
    return settings


def _file_name(name: str) -> str:
    """The file of a unit: a template instance openarc@qwen.service lives in openarc@.service."""
    stem, dot, suffix = name.rpartition(".")
    if "@" in stem:
        stem = stem.split("@", 1)[0] + "@"
    return f"{stem}{dot}{suffix}"


def find_unit(box: Box, name: str | None) -> Unit | None:
    """The named unit (default: openarc.service, else the openarc.container quadlet), with its drop-ins."""
    for wanted in ([name if "." in name else f"{name}.service"] if name else DEFAULT_UNITS):
        file_name = _file_name(wanted)
        dirs = QUADLET_DIRS if wanted.endswith(".container") else UNIT_DIRS
        for directory in dirs:
            text = box.read(f"{directory}/{file_name}")
            if text is None:
                continue
            dropin_dirs = [f"{d}/{n}.d" for d in dirs for n in dict.fromkeys((file_name, wanted))]
            dropins = sorted((f"{d}/{f}" for d in dropin_dirs for f in box.listdir(d) if f.endswith(".conf")),
                             key=lambda path: PurePosixPath(path).name)
            texts = [text, *(box.read(path) or "" for path in dropins)]
            return Unit(wanted, f"{directory}/{file_name}", dropins, parse_unit(texts))
    return None


def service_user(box: Box, unit: Unit | None) -> User:
    """The unit's User= with its Group= and SupplementaryGroups=; a quadlet's container keeps the groups of the
    user who runs it (GroupAdd=keep-groups), so it, like no unit at all, means the user running doctor."""
    if unit is None or unit.is_quadlet or not unit.last("Service", "User"):
        return box.current_user()
    groups = [*unit.values("Service", "Group"), *(g for v in unit.values("Service", "SupplementaryGroups")
                                                  for g in v.split())]
    return box.user_named(unit.last("Service", "User"), unit.name, tuple(groups))


def _service_checks(unit: Unit) -> list[Check]:
    found = []
    policy = unit.last("Service", "DevicePolicy", "auto")
    allowed = unit.values("Service", "DeviceAllow")
    gpu_allowed = any(value.split()[0] in ("char-drm", "/dev/dri/renderD128") or value.startswith("/dev/dri/render")
                      for value in allowed)
    if unit.last("Service", "PrivateDevices").lower() in ("yes", "true", "1", "on"):
        found.append(fail("unit device access", f"{unit.name} has PrivateDevices=yes: /dev/dri is hidden from it",
                          f"PrivateDevices=no and DeviceAllow=char-drm rw in {unit.path} (or a drop-in)"))
    elif policy in ("closed", "strict") and not gpu_allowed:
        why = (" (DeviceAllow=/dev/dri names a directory, which systemd ignores)"
               if any(value.split()[0] == "/dev/dri" for value in allowed) else "")
        found.append(fail("unit device access", f"{unit.name} has DevicePolicy={policy} without the DRM devices{why}",
                          "add `DeviceAllow=char-drm rw` under [Service] (`sudo systemctl edit "
                          f"{unit.name}`)"))
    else:
        found.append(ok("unit device access", f"DevicePolicy={policy}"
                        + (f", DeviceAllow={'; '.join(allowed)}" if allowed else "")))
    if unit.last("Service", "MemoryDenyWriteExecute").lower() in ("yes", "true", "1", "on"):
        found.append(fail("unit hardening", f"{unit.name} has MemoryDenyWriteExecute=yes: OpenVINO's JIT (CPU "
                          "plugin, GPU kernel compiler) cannot map code", "remove MemoryDenyWriteExecute= from the unit"))
    if unit.last("Service", "ProtectKernelLogs").lower() in ("yes", "true", "1", "on"):
        found.append(warn("unit kernel log", f"{unit.name} cannot read the kernel log (ProtectKernelLogs=yes): GPU "
                          "hangs and resets go uncounted and the SDPA mitigation cannot act",
                          f"install {KMSG_DROPIN} as /etc/systemd/system/{_file_name(unit.name)}.d/kmsg.conf, "
                          "then sudo systemctl daemon-reload"))
    else:
        found.append(ok("unit kernel log", "the kernel log is readable (GPU hangs and resets are seen)"))
    return found


def kernel_log_check(box: Box) -> Check:
    """Without a unit: whether this user can read the kernel log (kernel.dmesg_restrict asks for CAP_SYSLOG)."""
    _records, unreadable = box.kernel_log()
    if unreadable:
        return warn("kernel log", f"{unreadable}: GPU hangs and resets go uncounted and the SDPA mitigation cannot "
                                  "act", "run openarc under the shipped unit with units/openarc-kmsg.conf, or "
                                         "sudo sysctl kernel.dmesg_restrict=0")
    return ok("kernel log", "readable (GPU hangs and resets are seen)")


def _quadlet_checks(unit: Unit) -> list[Check]:
    devices = [value.lstrip("-") for value in unit.values("Container", "AddDevice")]
    found = []
    if any(device.startswith("/dev/dri") for device in devices):
        found.append(ok("unit device access", f"AddDevice={', '.join(devices)}"))
    else:
        found.append(fail("unit device access", f"{unit.name} passes no /dev/dri into the container",
                          f"add `AddDevice=-/dev/dri` under [Container] of {unit.path}"))
    groups = unit.values("Container", "GroupAdd")
    if groups:
        found.append(ok("unit render group", f"GroupAdd={', '.join(groups)}"))
    else:
        found.append(warn("unit render group", f"{unit.name} adds no group: the container's user cannot open the "
                          "render node", "add `GroupAdd=keep-groups` (rootless) or `GroupAdd=<render gid>` "
                          "(rootful: getent group render) under [Container]"))
    return found


def checks(box: Box, unit: Unit | None, asked: str | None, user: User) -> list[Check]:
    if unit is None:
        if asked:
            return [fail("unit", f"no unit or quadlet named {asked} is installed", INSTALL_FIX)]
        return [skip("unit", f"no openarc.service or openarc.container installed; checking as {user.name} "
                             f"({user.source})"), kernel_log_check(box)]
    dropins = f" with {', '.join(unit.dropins)}" if unit.dropins else ""
    found = [ok("unit", f"{unit.name} at {unit.path}{dropins}; runs as {user.name}")]
    return found + (_quadlet_checks(unit) if unit.is_quadlet else _service_checks(unit))
