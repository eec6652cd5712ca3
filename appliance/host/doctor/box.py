"""The machine doctor looks at, as files under one root: `/` on a real box, or a recorded root in the tests
(`openarc doctor --root DIR`). Every reader here takes its paths from the root, so each check is a pure function of
the files under it: sysfs, procfs, /dev, /etc, the package database, the kernel log.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from appliance.host import device_memory
from appliance.host.kernel_log import KmsgRecord, KmsgWatcher

# A recorded root may hold what `openarc doctor` learned from OpenVINO's child process on the box it was recorded
# on (the child's JSON output), since a recorded root has no GPU to ask.
RECORDED_OPENVINO = "openvino-devices.json"


@dataclass(frozen=True)
class User:
    """Who the server runs as: the unit's User= (and its groups), else whoever runs doctor."""

    name: str
    uid: int | None  # None: a unit's user that does not exist (yet) on this box
    gids: frozenset[int]
    source: str  # where it came from: "the unit openarc.service", "the user running doctor"
    unit: str | None = None  # the unit whose User= it is


class Box:
    """Files of one machine under `root`."""

    def __init__(self, root: str | Path = "/"):
        self.root = Path(root)
        self.recorded = self.root.resolve() != Path("/")
        self._kmsg: list[KmsgRecord] | None = None

    def path(self, absolute: str | Path) -> Path:
        """Where `absolute` (a path on the box) lies under the root."""
        return self.root / str(absolute).lstrip("/")

    def read(self, absolute: str | Path) -> str | None:
        try:
            return self.path(absolute).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None

    # --- the kernel ---------------------------------------------------------------------------------------

    def kernel_release(self) -> str | None:
        """uname -r, from /proc/sys/kernel/osrelease."""
        text = self.read("/proc/sys/kernel/osrelease")
        return text.strip() if text else None

    def kernel_log(self) -> tuple[list[KmsgRecord], str | None]:
        """Every record in the kernel's ring buffer (from boot, while it still holds it), and why not, if it cannot
        be read (kernel.dmesg_restrict without CAP_SYSLOG). A recorded root holds it as a kmsg-format file."""
        if self._kmsg is None:
            watcher = KmsgWatcher(self.path("/dev/kmsg"), from_start=True)
            self._kmsg = [] if watcher.unavailable else watcher.poll_records()
            self._kmsg_unavailable = watcher.unavailable
            watcher.close()
        return self._kmsg, self._kmsg_unavailable

    # --- users and groups ---------------------------------------------------------------------------------

    def _colon_file(self, absolute: str) -> list[list[str]]:
        return [line.split(":") for line in (self.read(absolute) or "").splitlines()
                if line and not line.startswith("#") and line.count(":") >= 3]

    def group_names(self) -> dict[int, str]:
        return {int(row[2]): row[0] for row in self._colon_file("/etc/group") if row[2].isascii() and row[2].isdigit()}

    def group_gid(self, name: str) -> int | None:
        return next((gid for gid, group in self.group_names().items() if group == name), None)

    def user_named(self, name: str, unit: str, groups: tuple[str, ...] = ()) -> User:
        """A user of /etc/passwd with its primary group, the groups that list it, and `groups` (a unit's
        Group= and SupplementaryGroups=)."""
        entry = next((row for row in self._colon_file("/etc/passwd") if row[0] == name), None)
        named = {self.group_gid(group) for group in groups} - {None}
        source = f"the unit {unit}"
        if entry is None or not (entry[2].isascii() and entry[2].isdigit()):
            return User(name, None, frozenset(named), source, unit)
        members = {int(row[2]) for row in self._colon_file("/etc/group")
                   if row[2].isascii() and row[2].isdigit() and len(row) > 3 and name in row[3].split(",")}
        return User(name, int(entry[2]), frozenset({int(entry[3]), *members, *named}), source, unit)

    def current_user(self) -> User:
        """Whoever runs doctor: uid and groups from /proc/self/status (Uid:, Gid:, Groups:)."""
        fields = device_memory.parse_fdinfo(self.read("/proc/self/status") or "")
        uid = int(fields.get("Uid", "0").split()[0])
        gids = {int(fields.get("Gid", "0").split()[0]), *map(int, fields.get("Groups", "").split())}
        name = next((row[0] for row in self._colon_file("/etc/passwd") if row[2] == str(uid)), str(uid))
        return User(name, uid, frozenset(gids), "the user running doctor")

    def can_open(self, user: User, absolute: str | Path, want: int = 6) -> bool:
        """Whether `user` may open the file for `want` (4 read, 2 write, 1 search) by its permission bits; root
        always may. (ACLs granted to a desktop session's seat are not the service's: not counted.)"""
        if user.uid == 0:
            return True
        try:
            st = self.path(absolute).stat()
        except OSError:
            return False
        shift = 6 if st.st_uid == user.uid else 3 if st.st_gid in user.gids else 0
        return (st.st_mode >> shift) & want == want

    def owner_group(self, absolute: str | Path) -> str | None:
        try:
            gid = self.path(absolute).stat().st_gid
        except OSError:
            return None
        return self.group_names().get(gid, str(gid))

    def mode(self, absolute: str | Path) -> str | None:
        try:
            return stat.filemode(self.path(absolute).stat().st_mode)
        except OSError:
            return None

    # --- packages -----------------------------------------------------------------------------------------

    def packages(self) -> dict[str, str]:
        """Installed Debian/Ubuntu packages and their versions (/var/lib/dpkg/status); {} elsewhere."""
        installed = {}
        for stanza in (self.read("/var/lib/dpkg/status") or "").split("\n\n"):
            fields = dict(re.findall(r"^([A-Za-z-]+): (.*)$", stanza, re.MULTILINE))
            if fields.get("Status", "").endswith(" installed") and "Package" in fields:
                installed[fields["Package"]] = fields.get("Version", "")
        return installed

    def find_library(self, name: str) -> Path | None:
        """A shared library by file name in the usual library directories, as the path on the box."""
        for directory in LIBRARY_DIRS:
            candidate = self.path(directory) / name
            if candidate.exists():
                return Path(directory) / name
        return None

    def listdir(self, absolute: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(absolute)))
        except OSError:
            return []


LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/lib/x86_64-linux-gnu", "/lib64",
                "/usr/local/lib", "/opt/intel/oneapi/redist/lib")


def kernel_version(release: str | None) -> tuple[int, int] | None:
    """(major, minor) of a kernel release string such as "6.8.0-51-generic"."""
    match = re.match(r"(\d+)\.(\d+)", release or "", re.ASCII)
    return (int(match[1]), int(match[2])) if match else None
