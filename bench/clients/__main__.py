"""`python -m bench.clients [--latest]`: the real clients against a demo server, and their compatibility table.

Each client of bench.clients.catalog, at its pinned release (or the registry's newest with --latest), installed
into the cache (`--cache`, default $OPENARC_CLIENTS_DIR or /opt/openarc/clients), runs headless through the
recording proxy: a text turn, a tool round trip, and what its text turn says about output limits. The table
(client, version, release date, what passed) is printed and written to <out>/clients.md, everything to
clients.json. A client whose install fails (say, one that downloads from outside the package registries) is
listed as not run, with the reason. `--install-only` fills the cache and stops (`make install-clients`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from bench.clients import verdicts
from bench.clients.catalog import ALL, CORE, Client, Turn
from bench.clients.install import DEFAULT_CACHE, InstallError, install, latest_version, release_date
from bench.clients.reading import asked_limit
from bench.clients.runs import TEXT_PROMPT, ClientRun, run_client, tool_round_trip
from bench.clients.server import ALIASES, build_model, models
from bench.launcher import OwnAppliance
from bench.report import RESULTS, load_average, now

COLUMNS = ("client", "version", "released", "text turn", "tool round trip", "output limit", "also")


@dataclass
class Row:
    client: str
    version: str
    released: str = ""
    cells: dict[str, str] = field(default_factory=dict)
    not_run: str = ""

    def markdown(self) -> str:
        if self.not_run:
            values = [self.client, self.version, self.released, f"not run: {self.not_run}", "", "", ""]
        else:
            values = [self.client, self.version, self.released,
                      *(self.cells.get(column, "") for column in COLUMNS[3:])]
        return "| " + " | ".join(v.replace("|", "/").replace("\n", " ") for v in values) + " |"


def cell(problem: str | None) -> str:
    return "pass" if problem is None else f"FAIL: {problem}"


def limit_cell(run: ClientRun) -> str:
    """What the client asks for as an output limit, and whether the answer still ended by itself."""
    last = verdicts.shown(run)
    if last is None:
        return ""
    limit = asked_limit(last)
    if limit is None:
        return "none sent; " + cell(verdicts.long_answer(run))
    return f"sends {limit}; " + cell(verdicts.completed(run))


def evaluate(client: Client, upstream: str, version: str, cache: Path, scratch: Path, out: Path) -> Row:
    """Install and run one client; its runs' reports (exit, requests, output) go to <out>/clients/."""
    row = Row(client.name, version, release_date(client.package, version))
    try:
        installed = install(client.package, cache, version)
    except InstallError as exc:
        row.not_run = str(exc).splitlines()[0][:200]
        return row
    slug = "".join(c if c.isalnum() else "-" for c in client.name).strip("-")
    root = scratch / slug  # one home and work directory for all its runs, as one user's (see the tests' `run`)
    text = run_client(installed, client, upstream, Turn(TEXT_PROMPT, client.model), root)
    row.cells["text turn"] = cell(verdicts.answered(text) or verdicts.completed(text))
    row.cells["output limit"] = limit_cell(text)
    runs = {"text": text}
    if client.tool is None:
        row.cells["tool round trip"] = f"n/a: {client.note}"
    else:
        runs["tool"] = tool_round_trip(installed, client, upstream, client.model, root)
        row.cells["tool round trip"] = cell(verdicts.round_trip(runs["tool"]))
    if client.also_as:
        runs["also"] = run_client(installed, client, upstream, Turn(TEXT_PROMPT, client.also_as), root)
        row.cells["also"] = f"as {client.also_as}: " + cell(verdicts.answered(runs["also"]))
    (out / "clients").mkdir(parents=True, exist_ok=True)
    for kind, run in runs.items():
        (out / "clients" / f"{slug}-{kind}.txt").write_text(run.report())
    return row


async def start_server(directory: Path) -> OwnAppliance:
    server = OwnAppliance(Path(), directory, models=models(build_model(directory / "demo")),
                          server={"model_aliases": ALIASES})
    async with aiohttp.ClientSession() as session:
        await server.start(session)
    return server


def table(rows: list[Row]) -> str:
    return "\n".join([f"| {' | '.join(COLUMNS)} |", "|" + "---|" * len(COLUMNS),
                      *(row.markdown() for row in rows)]) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.clients", description=__doc__.splitlines()[0])
    parser.add_argument("--latest", action="store_true", help="the registries' newest releases, not the pinned ones")
    parser.add_argument("--only", nargs="+", choices=sorted(ALL), help="these clients only")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the clients are installed")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where clients.{md,json} go")
    parser.add_argument("--install-only", action="store_true",
                        help="install the pinned releases (of --only, else Claude Code, Codex and opencode) and stop")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.install_only:
        for name in args.only or CORE:
            installed = install(ALL[name].package, args.cache)
            print(f"{name} {installed.version}: {installed.executable}")
        return 0
    chosen = [ALL[name] for name in args.only or ALL]
    rows = []
    with tempfile.TemporaryDirectory(prefix="openarc-clients-") as scratch:
        server = asyncio.run(start_server(Path(scratch)))
        try:
            for client in chosen:
                version = latest_version(client.package) if args.latest else client.package.pinned
                rows.append(evaluate(client, server.base, version, args.cache, Path(scratch), args.out))
                print(rows[-1].markdown(), file=sys.stderr, flush=True)
        finally:
            server.stop()
    report = table(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "clients.md").write_text(report)
    meta = {"date": now(), "latest": args.latest, "load_average": load_average()}
    (args.out / "clients.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2))
    print(report, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
