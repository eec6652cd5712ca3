"""What systemd hands a service through its environment: the directories it made for the unit (CacheDirectory=,
StateDirectory=) and the credentials it loaded (LoadCredential=).

Read where a default path or a secret may come from the unit file: the OpenVINO cache and spool directories, the
demo models' cache, an API key's value.
"""

from __future__ import annotations

import os
import typing
from pathlib import Path


def credential(environ: typing.Mapping[str, str], name: str) -> str:
    """A systemd credential of this name (LoadCredential=NAME:FILE puts it in $CREDENTIALS_DIRECTORY), else ""."""
    directory = environ.get("CREDENTIALS_DIRECTORY")
    if not directory:
        return ""
    try:
        return (Path(directory) / name).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return ""


def systemd_directory(*variables: str) -> str | None:
    """The first path of the first of systemd's directory variables that is set ($CACHE_DIRECTORY from
    CacheDirectory=, $STATE_DIRECTORY from StateDirectory=; each may list several paths, ':'-separated), or None."""
    for variable in variables:
        first = os.environ.get(variable, "").split(":")[0]
        if first:
            return first
    return None
