"""`openarc launch`: from the served chat models to a running agent (or its files, with --config-only), and
`--restore`. The CLI finds the models (a config or a server's /v1/models); this decides and does the rest."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from appliance.launch import files
from appliance.launch.clients import CLIENTS, Homes, Setup, agent_environment, shell_command
from appliance.launch.served import ServedModel, Target, choose


def restore(client: str, environ: dict[str, str], home: Path) -> int:
    for line in files.restore(client, files.state_dir(environ, home)):
        print(line)
    return 0


def launch(client: str, served: list[ServedModel], where: str, base_url: str, key_env: str | None,
           model: str | None, config_only: bool, client_args: list[str], environ: dict[str, str],
           home: Path) -> int:
    """Set the agent up for one served model; run it unless config_only. Raises LaunchError for what the user
    must change (no such model, several to pick from, a file that does not parse)."""
    target = Target(base_url.rstrip("/"), choose(served, model, where), key_env)
    setup = CLIENTS[client](target, Homes.of(environ, home))
    print(f"{client}: {target.model.name} at {target.base_url}, window {target.model.window} tokens "
          f"({target.model.window_source})")
    for warning in setup.warnings:
        print(f"openarc launch: warning: {warning}", file=sys.stderr)
    if key_env and not environ.get(key_env):
        print(f"openarc launch: warning: {key_env} is not set here; the agent needs the server's key in it",
              file=sys.stderr)
    installed = shutil.which(setup.binary, path=environ.get("PATH"))
    if config_only and not installed:
        print_setup(setup)
        return 0
    for line in files.apply(setup, files.state_dir(environ, home)):
        print(line)
    command = shell_command(setup, tuple(client_args))
    if config_only or not installed:
        if not installed:
            print(f"{setup.binary} is not on PATH: install it ({setup.install}), then run:")
        else:
            print("run it with:")
        print(f"  {command}")
        print(f"undo with: openarc launch {client} --restore")
        return 0
    sys.stdout.flush()
    os.execvpe(installed, [setup.binary, *setup.command[1:], *client_args], agent_environment(setup, environ))
    return 0  # not reached


def print_setup(setup: Setup) -> None:
    """What --config-only would write and run, for a machine without the agent."""
    print(f"{setup.binary} is not on PATH (install: {setup.install}); nothing written. The setup:")
    for edit in setup.files:
        print(f"\n# {edit.path} (these keys; an existing file is merged)\n{files.render(edit)}")
    print(f"run:\n  {shell_command(setup)}")
