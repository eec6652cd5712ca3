"""Where the front listens: the sockets systemd passed it (socket activation), else an address it binds itself.

Under `openarc.socket` / `openarc@NAME.socket` systemd owns the listening socket and hands it to every start of
the service (sd_listen_fds(3): LISTEN_PID, LISTEN_FDS, the sockets from fd 3 on). The socket outlives the
process, so while the service restarts new connections wait in the kernel's backlog instead of being refused.
"""

from __future__ import annotations

import logging
import os
import socket

from aiohttp import web

from appliance.config import ConfigError

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
    if pid != str(os.getpid()) or not count.isdigit():
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


def address(sock: socket.socket) -> str:
    name = sock.getsockname()
    if sock.family == socket.AF_UNIX:
        return name if isinstance(name, str) else name.decode(errors="replace")
    host, port = name[:2]
    return f"[{host}]:{port}" if sock.family == socket.AF_INET6 else f"{host}:{port}"


async def start_sites(runner: web.AppRunner, host: str, port: int, also_bind: bool) -> list[web.BaseSite]:
    """Serve on systemd's sockets if it passed any, else on host:port; on both when also_bind (an address given
    on the command line: a container's own loopback, where its health check connects)."""
    passed = systemd_sockets()
    sites: list[web.BaseSite] = [web.SockSite(runner, sock, backlog=BACKLOG) for sock in passed]
    if passed and not also_bind and port not in (_port_of(sock) for sock in passed):
        log.warning("the socket unit's %s is what serves; the config's port %d is not bound",
                    ", ".join(address(sock) for sock in passed), port)
    if not passed or also_bind:
        sites.append(web.TCPSite(runner, host, port, backlog=BACKLOG))
    for site in sites:
        await site.start()
        log.info("listening on %s%s", site.name, " (socket activation)" if isinstance(site, web.SockSite) else "")
    return sites


def activated(sites: list[web.BaseSite]) -> list[web.BaseSite]:
    """The sites on sockets systemd passed."""
    return [site for site in sites if isinstance(site, web.SockSite)]


def _port_of(sock: socket.socket) -> int | None:
    return None if sock.family == socket.AF_UNIX else sock.getsockname()[1]
