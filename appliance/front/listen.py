"""Where the front listens: the sockets systemd passed it (socket activation), else an address it binds itself.

Under `openarc.socket` / `openarc@NAME.socket` systemd owns the listening socket and hands it to every start of
the service (sd_listen_fds(3): LISTEN_PID, LISTEN_FDS, the sockets from fd 3 on). The socket outlives the
process, so while the service restarts new connections wait in the kernel's backlog instead of being refused.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess

from aiohttp import web

from appliance.config import Config, ConfigError

log = logging.getLogger("openarc.listen")

SD_LISTEN_FDS_START = 3
# The socket units' Backlog=. asyncio calls listen() again on an inherited socket, with aiohttp's 128 unless told
# otherwise, and the backlog that listen() sets is what holds connections while the process is gone.
BACKLOG = 4096


class ListenError(ConfigError):
    """A socket systemd passed that the front cannot serve on (the socket unit is part of the configuration)."""


def systemd_sockets() -> list[socket.socket]:
    """The listening sockets systemd passed to this very process, in order (none without socket activation).

    The variables are removed either way, as sd_listen_fds(1) does: the workers must not think they were passed
    anything, and the sockets themselves are made non-inheritable so no worker keeps the listener open."""
    pid, count = os.environ.pop("LISTEN_PID", ""), os.environ.pop("LISTEN_FDS", "")
    os.environ.pop("LISTEN_FDNAMES", None)
    if pid != str(os.getpid()) or not (count.isascii() and count.isdigit()):
        return []
    sockets = []
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + int(count)):
        os.set_inheritable(fd, False)
        sock = socket.socket(fileno=fd)
        if sock.type != socket.SOCK_STREAM or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise ListenError(f"fd {fd} from systemd is not a listening stream socket: the socket unit may only "
                              "have ListenStream= entries")
        sockets.append(sock)
    return sockets


async def start_sites(runner: web.AppRunner, host: str, port: int, also_bind: bool) -> list[web.BaseSite]:
    """Serve on systemd's sockets if it passed any, else on host:port; on both when also_bind (an address given
    on the command line: a container's own loopback, where its health check connects)."""
    passed = systemd_sockets()
    sites: list[web.BaseSite] = [web.SockSite(runner, sock, backlog=BACKLOG) for sock in passed]
    if passed and not also_bind and port not in (_port_of(sock) for sock in passed):
        log.warning("serving on the socket systemd passed (%s); the config's port %d is not bound",
                    ", ".join(site.name for site in sites), port)
    if not passed or also_bind:
        sites.append(web.TCPSite(runner, host, port, backlog=BACKLOG))
    for site in sites:
        try:
            await site.start()
        except OSError as exc:  # the address is taken or not ours: one line, not a traceback
            raise ListenError(f"cannot listen on {site.name}: {os.strerror(exc.errno) if exc.errno else exc}") from None
        log.info("listening on %s%s", site.name, " (socket activation)" if isinstance(site, web.SockSite) else "")
    return sites


def activated(sites: list[web.BaseSite]) -> list[web.BaseSite]:
    """The sites on sockets systemd passed."""
    return [site for site in sites if isinstance(site, web.SockSite)]


def _port_of(sock: socket.socket) -> int | None:
    return None if sock.family == socket.AF_UNIX else sock.getsockname()[1]


# --- openarc check-config: does an enabled socket unit listen where the config says? ------------------------

def socket_unit_warnings(config: Config) -> list[str]:
    """One line per socket unit, active or enabled, that listens on no port of the config: openarc.socket against
    server.port, openarc@NAME.socket against that model's `port:`. systemctl reads the units with their drop-ins;
    without a running systemd there is nothing to check."""
    expected = {"openarc.socket": ("server.port", config.server.port)}
    for i, model in enumerate(config.models):
        expected[f"openarc@{model.name}.socket"] = ((f"models[{i}].port", model.port) if model.port
                                                    else ("server.port", config.server.port))
    warnings = []
    for unit in _socket_units(list(expected)):
        if unit.get("LoadState") != ["loaded"] or not ({"active"} & set(unit["ActiveState"]) or
                                                      {"enabled"} & set(unit["UnitFileState"])):
            continue
        key, port = expected[unit["Id"][0]]
        addresses = [listen.rsplit(" (", 1)[0] for listen in unit.get("Listen", [])]
        if not any(address.rpartition(":")[2] == str(port) for address in addresses):
            warnings.append(f"{unit['Id'][0]} listens on {', '.join(addresses) or 'nothing'}, but {key} is {port}: "
                            f"set its ListenStream= in a drop-in (docs/operations.md: Socket activation)")
    return warnings


def _socket_units(names: list[str]) -> list[dict[str, list[str]]]:
    """`systemctl show` of the units, one {property: [values]} each; [] when systemctl cannot answer."""
    try:
        done = subprocess.run(["systemctl", "show", "--property=Id,LoadState,ActiveState,UnitFileState,Listen",
                               "--", *names], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if done.returncode != 0:
        return []
    units = []
    for block in done.stdout.strip().split("\n\n"):
        unit: dict[str, list[str]] = {"ActiveState": [], "UnitFileState": []}
        for line in block.splitlines():
            key, _, value = line.partition("=")
            unit.setdefault(key, []).append(value)
        if "Id" in unit:
            units.append(unit)
    return units
