"""The GPU's device nodes: a render node under /dev/dri for each card, and whether the server's user may open it
(read and write, by the node's owner, group and mode: udev gives them to group `render`, mode 0660)."""

from __future__ import annotations

from appliance.host.doctor import Check, fail, ok
from appliance.host.doctor.box import Box, User
from appliance.host.doctor.cards import CardFacts


def render_nodes(box: Box) -> list[str]:
    return [f"/dev/dri/{name}" for name in box.listdir("/dev/dri") if name.startswith("renderD")]


def _no_nodes(cards: list[CardFacts]) -> Check:
    unbound = [card for card in cards if card.driver is None]
    if unbound:
        card = unbound[0]
        return fail("render nodes", f"no /dev/dri/renderD* node: {card.name} ({card.bdf}) has no kernel driver bound",
                    f"see the `card {card.bdf} driver` check (kernel too old, or `sudo modprobe "
                    f"{'xe' if card.family == 'BMG' else 'i915'}`)")
    return fail("render nodes", "no /dev/dri/renderD* node: this machine shows no GPU to user space",
                "install an Intel Arc GPU and its kernel driver (i915 for A-series, xe for B-series on Linux 6.12+); "
                "in a container, pass the device (--device /dev/dri, quadlet AddDevice=/dev/dri)")


def access_fix(user: User, group: str) -> str:
    """How `user` gets the node's group: a unit line for a service, usermod for a login user."""
    if user.unit:
        return f"add `SupplementaryGroups={group}` under [Service] of {user.unit} (`sudo systemctl edit {user.unit}`)"
    return f"sudo usermod -aG {group} {user.name}, then log out and in again (or `newgrp {group}`)"


def checks(box: Box, user: User, cards: list[CardFacts]) -> list[Check]:
    nodes = render_nodes(box)
    if not nodes:
        return [_no_nodes(cards)]
    found = [ok("render nodes", f"{', '.join(nodes)}")]
    for node in nodes:
        group = box.owner_group(node) or "render"
        name = f"access {node}"
        if box.can_open(user, node):
            found.append(ok(name, f"{user.name} ({user.source}) can open it ({box.mode(node)} group {group})"))
        elif user.uid is None:
            found.append(fail(name, f"the service user {user.name!r} does not exist on this box",
                              "sudo systemd-sysusers (installs units/openarc.sysusers.conf), or create the user"))
        else:
            found.append(fail(name, f"{user.name} ({user.source}) cannot open it: {box.mode(node)} group {group}, "
                                    f"and {user.name} is not in group {group}", access_fix(user, group)))
    return found
