"""`openarc`: serve, check-config, doctor, pull, demo-model, golden (record, check), health, keys, models / load /
unload against a running server, and launch (a coding agent set up for a served model)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from appliance.config import DEFAULT_CONFIG_PATH, Config, ConfigError, ModelConfig, demo_config, load_config
from appliance.config.devices import available_devices, missing_devices
from appliance.config.replicas import devices_of
from appliance.logs import setup_logging
from appliance.config.model_checks import model_problems, path_check, served_path_check
from appliance.config import window
from appliance.config.kinds import GENERATIVE_KINDS

log = logging.getLogger("openarc")


def resolve_config(path: str | None, model: str | None) -> Config:
    """--config PATH, else /etc/openarc/openarc.yaml if it exists, else the built-in demo."""
    if path is None and not DEFAULT_CONFIG_PATH.exists():
        config = demo_config()  # the paths are filled in by prepare_demo_model()
    else:
        config = load_config(path or DEFAULT_CONFIG_PATH)
    return config.only(model) if model else config


def prepare_demo_model(config: Config) -> None:
    """Build (first start) or find (cached) the demo models in a child process: the front never imports OpenVINO."""
    for model in config.models:
        if not model.path:
            done = subprocess.run([sys.executable, "-m", "appliance", "demo-model", "--kind", model.kind], check=True,
                                  stdout=subprocess.PIPE, text=True)
            model.path = done.stdout.strip().splitlines()[-1]
            log.info("demo model: %s", model.path)


def serve_config(args: argparse.Namespace) -> Config:
    """The config `serve` runs, read at start and again on SIGHUP."""
    config = resolve_config(args.config, args.model)
    if args.host:
        config.server.host = args.host
    if args.port:
        config.server.port = args.port
    prepare_demo_model(config)
    return config


def cmd_serve(args: argparse.Namespace) -> int:
    config = serve_config(args)
    setup_logging(config.server.log_level)
    for warning in config.shared_gpu_warnings():
        log.warning("%s", warning)
    # Named here, all at once; each such model then ends failed with this reason and the others serve.
    for problem in model_problems(config.models, [served_path_check]):
        log.error("%s: %s; this model will not load", config.source, problem)
    from appliance.front.server import Appliance
    appliance = Appliance(config, reload_config=lambda: serve_config(args))
    # An address given on the command line is bound even under socket activation (listen.start_sites).
    also_bind = bool(args.host or args.port)
    return asyncio.run(appliance.serve(config.server.host, config.server.port, also_bind))


def cmd_golden(args: argparse.Namespace) -> int:
    """record: each model's answers to its probes, written to golden.yaml beside the config; check: the same probes
    judged against that record, one line per model, exit 1 if one differs (appliance.golden)."""
    from appliance import __version__
    from appliance.golden import record as golden
    config = resolve_config(args.config, None)
    path = golden.golden_path(config.source)
    if path is None:
        print(f"openarc golden: the record is written beside the config: give one (--config FILE; "
              f"{DEFAULT_CONFIG_PATH} does not exist)", file=sys.stderr)
        return 2
    unknown = [name for name in args.models if name not in {m.name for m in config.models}]
    if unknown:
        print(f"openarc golden: {config.source}: no model named {', '.join(unknown)} "
              f"(have: {', '.join(m.name for m in config.models)})", file=sys.stderr)
        return 2
    try:
        records = golden.load(path)
    except golden.RecordError as exc:
        print(f"openarc golden: {exc}", file=sys.stderr)
        if args.action == "check":
            return 2
        print(f"openarc golden: {path}: recording replaces it", file=sys.stderr)
        records = {}  # recording again replaces a broken file (golden.save)
    names = args.models or [m.name for m in config.models]
    if args.action == "check" and not (names := [name for name in names if name in records]):
        print(f"openarc golden: {path}: no record of {', '.join(args.models) or 'any model'}; "
              "run `openarc golden record` first", file=sys.stderr)
        return 1
    setup_logging("warning")
    prepare_demo_model(config)
    from appliance.front.canary import probed
    from appliance.front.golden_run import observe_model
    failed, recorded = False, {}
    for name in names:
        kind = config.model(name).kind
        if not probed(kind):
            print(f"{name}: skipped: kind {kind} has no golden probes (the canary does not check it)")
            continue
        observed = asyncio.run(observe_model(config, name))
        if isinstance(observed, str):  # it did not load
            line, failed = f"load: {observed}", True
        elif args.action == "record":
            recorded[name] = golden.renewed(records, name, observed)
            line = (f"recorded {len(observed.answers)} answers, {observed.speed:.1f} {observed.speed_unit}, "
                    f"load {observed.load_seconds or 0:.2f} s")
        else:
            line, differs = golden_verdict(name, records[name], observed, config.server.canary_min_speed)
            failed = failed or differs
        print(f"{name}: {line}")
    if recorded:
        golden.save(path, recorded, __version__)
        print(f"openarc golden: wrote {path}")
    return 1 if failed else 0


def golden_verdict(name: str, want, observed, min_speed: float) -> tuple[str, bool]:
    """`openarc golden check`'s line for one model (OK, or what differs, with the speeds and loads beside the
    recorded ones), and whether it differs."""
    from appliance.golden.compare import compare
    difference = compare(name, want, observed, min_speed)
    verdict = f"DIFFERS: {difference}" if difference else "OK"
    return (f"{verdict} ({observed.speed:.1f} {observed.speed_unit}, recorded {want.speed:.1f}; "
            f"load {observed.load_seconds or 0:.2f} s, recorded {want.load_seconds or 0:.2f} s)"), difference is not None


def device_check(available: list[str]):
    """--strict: each device a model names is one OpenVINO lists on this machine."""
    def check(model: ModelConfig) -> tuple[str, str] | None:
        missing = [name for device in devices_of(model.device) for name in missing_devices(device, available)]
        return ("device", f"expected a device present here ({', '.join(available) or 'none'}); "
                          f"{', '.join(missing)} is not") if missing else None
    return check


def cmd_check_config(args: argparse.Namespace) -> int:
    checks = [path_check] + ([device_check(available_devices())] if args.strict else [])
    config = load_config(args.path, checks)
    config.key_secrets()  # an unset or empty key variable would turn authentication off: refused, named
    names = ", ".join(f"{m.name} ({m.device}{'' if m.kind == 'llm' else ', ' + m.kind})" for m in config.models)
    names = names or "no models"
    print(f"{args.path}: OK: {names}")
    for model in config.models:
        if model.kind in GENERATIVE_KINDS:
            line, problem = window.report(model)
            print(f"openarc: {line}")
            if problem:
                print(f"openarc: warning: {config.source}: {problem}", file=sys.stderr)
    for warning in config.shared_gpu_warnings():
        print(f"openarc: warning: {warning}", file=sys.stderr)
    from appliance.front.listen import socket_unit_warnings
    for warning in socket_unit_warnings(config):
        print(f"openarc: warning: {warning}", file=sys.stderr)
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from appliance.pull import PullError, pull
    try:
        return pull(args.repo_id, args.revision, Path(args.dir) if args.dir else None, args.name,
                    Path(args.add) if args.add else None)
    except PullError as exc:
        print(f"openarc pull: {exc}", file=sys.stderr)
        return 1


def cmd_demo_model(args: argparse.Namespace) -> int:
    """Build a demo model into DIR, or into the cache (reused while its build parameters match)."""
    from appliance.demo import catalog as demo_model
    shared = ("eos_after", "max_new_tokens", "logit_scale")  # the demo VLM walks the chat demo's phrases
    pair = ("layers", "draft_miss", "prompt_phrases")  # the chat demo's speculative-decoding pair
    # eos_after 0 is a value (never stop); an unset flag is None, an absent --prompt-phrases False
    given = [key for key in (*shared, *pair, "seed")
             if getattr(args, key) is not None and getattr(args, key) is not False]
    params = {key: getattr(args, key) for key in given}
    if set(given) & set(shared) and args.kind not in ("llm", "vlm"):
        print("openarc: --eos-after, --max-new-tokens and --logit-scale apply to --kind llm and vlm only", file=sys.stderr)
        return 2
    if set(given) & set(pair) and args.kind != "llm":
        print("openarc: --layers, --draft-miss and --prompt-phrases apply to --kind llm only", file=sys.stderr)
        return 2
    if args.kind not in demo_model.DEMO_KINDS:
        print(f"openarc: no demo model of kind {args.kind!r} (have: {', '.join(demo_model.DEMO_KINDS)})",
              file=sys.stderr)
        return 2
    if args.adapter is not None and args.kind not in ("llm", "image"):
        print("openarc: --adapter applies to --kind llm (a phrase family) and image only", file=sys.stderr)
        return 2
    if args.adapter and args.kind == "llm":  # the base comes from the cache (same parameters); the adapter to DIR or it
        try:
            if args.dir:
                base = demo_model.ensure_demo_model(demo_model.default_cache_dir(), "llm", **params)
                path = demo_model.build_demo_adapter(Path(args.dir), args.adapter, base)
            else:
                path = demo_model.ensure_demo_adapter(demo_model.default_cache_dir(), args.adapter, **params)
        except (ValueError, FileExistsError) as exc:
            print(f"openarc: {exc}", file=sys.stderr)
            return 2
    elif args.adapter is not None and args.kind == "llm":
        print("openarc: --adapter needs a phrase family for --kind llm (upper or title)", file=sys.stderr)
        return 2
    elif args.dir:
        path = demo_model.build_demo_model(Path(args.dir), args.kind, **params)
    else:
        path = demo_model.ensure_demo_model(demo_model.default_cache_dir(), args.kind, **params)
    if args.kind == "image" and args.adapter is not None:  # the image demo's adapter lives in its directory
        path = demo_model.image_adapter_path(path)
    print(path)
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 iff /ready answers 200: the container health check and a scriptable probe."""
    url = args.url.rstrip("/") + "/ready"
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as response:
            ok = response.status == 200
    except urllib.error.HTTPError as exc:
        ok = False
        print(f"{url}: {exc.code} {exc.read().decode(errors='replace')[:300]}", file=sys.stderr)
    except (urllib.error.URLError, OSError) as exc:
        print(f"{url}: {getattr(exc, 'reason', exc)}", file=sys.stderr)
        return 1
    return 0 if ok else 1


def cmd_doctor(args: argparse.Namespace) -> int:
    """Read-only checks of this box (or a recorded root) before the first request; exit 1 when one fails."""
    from appliance.host import doctor
    if not Path(args.root).is_dir():
        print(f"openarc doctor: --root {args.root}: not a directory", file=sys.stderr)
        return 2
    logging.getLogger("appliance.host").setLevel(logging.ERROR)  # the checks say it; no warnings twice
    checks = doctor.diagnose(args.root, args.config, args.unit)
    print(doctor.to_json(checks) if args.json else doctor.to_text(checks))
    return doctor.exit_status(checks)


def api_key(args: argparse.Namespace) -> str | None:
    """A key the server checks, from the same environment variable: the one its config's server.api_key_env
    names, else its first server.api_keys entry's (--config, else /etc/openarc/openarc.yaml when readable), else
    OPENARC_API_KEY."""
    env = "OPENARC_API_KEY"
    path = args.config or (DEFAULT_CONFIG_PATH if os.access(DEFAULT_CONFIG_PATH, os.R_OK) else None)
    keys = load_config(path).api_keys() if path else []
    return os.environ.get(keys[0].key_env if keys else env)


def call_server(args: argparse.Namespace, method: str, path: str) -> tuple[int, dict]:
    """One request to a running server; (status, JSON body), or (0, {"error": {"message": why}}) if it is not there."""
    key = api_key(args)
    request = urllib.request.Request(args.url.rstrip("/") + path, method=method, data=b"" if method == "POST" else None,
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        try:
            return exc.code, json.loads(text)
        except ValueError:
            return exc.code, {"error": {"message": text[:300]}}
    except (urllib.error.URLError, OSError) as exc:
        return 0, {"error": {"message": f"{args.url}: {getattr(exc, 'reason', exc)}"}}


def _error_exit(status: int, body: dict) -> int:
    error = body.get("error") or {}
    print(f"openarc: {f'{status}: ' if status else ''}{error.get('message', body)}"
          + (f" (hint: {error['hint']})" if error.get("hint") else ""), file=sys.stderr)
    return 1


def cmd_models(args: argparse.Namespace) -> int:
    """Every configured model with its state, load policy, memory and last use."""
    status, body = call_server(args, "GET", "/openarc/status")
    if status != 200:
        return _error_exit(status, body)
    rows = [("MODEL", "KIND", "STATE", "LOAD", "IDLE_UNLOAD_S", "MEMORY", "LAST_USED", "PID")]
    for m in body["models"]:
        memory = m.get("memory") or {}
        size = f"{memory['bytes'] / (1 << 30):.2f}GiB {memory['source']}" if memory.get("bytes") else "unknown"
        last = time.strftime("%H:%M:%S", time.localtime(m["last_used"])) if m.get("last_used") else "-"
        rows.append((m["name"], m["kind"], m["state"], m.get("load", "at_start"), f"{m.get('idle_unload_s', 0):g}",
                     size, last, str(m["pid"] or "-")))
    print_table(rows)
    residency = body.get("residency") or {}
    if residency.get("max_loaded") or residency.get("memory_budget"):
        budget = ", ".join(f"{d}: {s}" for d, s in residency["memory_budget"].items()) or "none"
        print(f"\nloaded {residency['loaded']} of max_loaded {residency['max_loaded'] or 'unlimited'}; "
              f"memory_budget: {budget}")
    return 0


def print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def cmd_keys(args: argparse.Namespace) -> int:
    """The config's API keys: names, classes, limits and models, and whether each variable is set here; never a
    key's value."""
    path = args.config or DEFAULT_CONFIG_PATH
    config = load_config(path)
    keys = config.api_keys()
    if not keys:
        print(f"{path}: no API keys: authentication is off (server.api_keys, server.api_key_env)")
        return 0
    rows = [("NAME", "PRIORITY", "MAX_CONCURRENT", "REQUESTS/MIN", "TOKENS/MIN", "MODELS", "KEY_ENV")]
    for key in keys:
        here = "set" if os.environ.get(key.key_env, "").strip() else "not set here"
        rows.append((key.name, key.priority, *(str(limit or "-") for limit in (
            key.max_concurrent, key.requests_per_minute, key.tokens_per_minute)),
            ",".join(key.models) if key.models else "all", f"{key.key_env} ({here})"))
    print_table(rows)
    return 0


def cmd_load_unload(args: argparse.Namespace) -> int:
    started = time.monotonic()
    status, body = call_server(args, "POST", f"/openarc/models/{urllib.parse.quote(args.name, safe='')}/{args.command}")
    if status != 200:
        return _error_exit(status, body)
    print(f"{body['model']}: {body['state']} ({time.monotonic() - started:.1f}s)")
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    """Set a coding agent up for one served chat model (appliance.launch), from a config or a running server."""
    from appliance.launch import command
    from appliance.launch.served import LaunchError, from_config, from_listing, server_root
    environ, home = dict(os.environ), Path.home()
    try:
        if args.restore:
            return command.restore(args.client, environ, home)
        if args.url is None and (args.config or os.access(DEFAULT_CONFIG_PATH, os.R_OK)):
            config = load_config(args.config or DEFAULT_CONFIG_PATH)
            keys = config.api_keys()
            served, where, base_url = from_config(config), config.source, server_root(config)
            key_env = keys[0].key_env if keys else None
        else:
            args.url = args.url or os.environ.get("OPENARC_URL", "http://127.0.0.1:8000")
            # the server's root: a client's base URL (ending /v1, as OpenAI SDKs are given it) names it too
            args.url = args.url.rstrip("/").removesuffix("/v1")
            status, body = call_server(args, "GET", "/v1/models")
            if status == 0:  # nothing answers there
                body["error"]["hint"] = ("start the server, or pass its config (--config FILE) or its address "
                                         "(--url URL)")
            if status != 200:
                return _error_exit(status, body)
            served, where, base_url = from_listing(body, args.url), args.url, args.url
            key_env = "OPENARC_API_KEY" if os.environ.get("OPENARC_API_KEY") else None
        return command.launch(args.client, served, where, base_url, key_env, args.model, args.config_only,
                              args.client_args, environ, home)
    except (LaunchError, OSError) as exc:  # OSError: a file or folder of the agent's the user cannot write
        print(f"openarc launch: {exc}", file=sys.stderr)
        return 2


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="openarc", description="OpenAI-compatible LLM appliance for Intel GPUs")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the models of a config (the built-in demo model without one)")
    serve.add_argument("--config", help=f"config file (default {DEFAULT_CONFIG_PATH}, if it exists)")
    serve.add_argument("--model", help="serve only this model, on its own port (what openarc@MODEL runs)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.set_defaults(func=cmd_serve)
    check = sub.add_parser("check-config", help="validate a config file and its models' directories; print every "
                                                 "error, one a line, and exit 2 on any")
    check.add_argument("path")
    check.add_argument("--strict", action="store_true",
                       help="also check that each model's device is present here (OpenVINO's device list)")
    check.set_defaults(func=cmd_check_config)
    pull = sub.add_parser("pull", help="download an OpenVINO model from the Hugging Face hub (HF_ENDPOINT, HF_TOKEN) "
                                       "and print its config entry, or add it to a config")
    pull.add_argument("repo_id", metavar="REPO_ID", help="e.g. OpenVINO/Qwen2.5-7B-Instruct-int4-ov")
    pull.add_argument("--revision", default="main", help="branch, tag or commit (default main)")
    pull.add_argument("--dir", help="where the model goes (default /var/lib/openarc/models/NAME)")
    pull.add_argument("--name", help="the model's name in the config (default: the repository's name, lower case)")
    pull.add_argument("--add", metavar="CONFIG", help="add the model's entry to this config file (validated, "
                                                      "written atomically)")
    pull.set_defaults(func=cmd_pull)
    demo = sub.add_parser("demo-model", help="build a tiny demo model into DIR")
    demo.add_argument("dir", nargs="?", help="where to build it (default: the cache, reused if present)")
    demo.add_argument("--kind", default="llm",
                      help="the worker kind it is a model for (default llm, the chat demo; a wrong one lists them)")
    demo.add_argument("--seed", type=int, help="the random weights (0): another seed, another model with other answers "
                                               "(what `openarc golden check` tells apart)")
    demo.add_argument("--eos-after", type=int, help="llm: generated tokens before the model stops by itself (48)")
    demo.add_argument("--max-new-tokens", type=int, help="llm: generation_config.json max_new_tokens (64)")
    demo.add_argument("--logit-scale", type=float, help="llm: how far the chosen token leads (64: sampling equals "
                                                        "greedy; 1: samples vary with temperature and seed)")
    demo.add_argument("--layers", type=int, help="llm: transformer layers (2); more make each step costlier, as a "
                                                 "main model beside a 1-layer draft")
    demo.add_argument("--draft-miss", type=int, help="llm: a draft that guesses every Nth token wrong (0: never)")
    demo.add_argument("--prompt-phrases", action="store_true",
                      help="llm: the model's answer text in a prompt encodes to its own tokens (prompt lookup)")
    demo.add_argument("--adapter", metavar="FAMILY", nargs="?", const="",
                      help="llm: build the demo model's LoRA adapter of this phrase family instead (upper: answers in "
                           "upper case; title: every word capitalised), for the demo model of the same flags; image "
                           "(no FAMILY): print the path of the demo's LoRA adapter (in the model's directory)")
    demo.set_defaults(func=cmd_demo_model)
    doctor = sub.add_parser("doctor", help="check this box before the first request: GPU nodes and permissions, "
                                           "compute runtime, OpenVINO's devices, each card, the config, the unit, "
                                           "disk; each failure with its fix; exit 1 when one fails")
    doctor.add_argument("--config", help="also check this config: every check-config problem, memory against "
                                         "VRAM, the model directories")
    doctor.add_argument("--json", action="store_true", help='print {"checks": [{"name", "status", "detail", "fix"}]}')
    doctor.add_argument("--unit", help="the systemd unit or quadlet that runs openarc (default: openarc.service, "
                                       "else openarc.container; its User= is the user checked)")
    doctor.add_argument("--root", default="/", help="the machine's files under this directory (a recorded root)")
    doctor.set_defaults(func=cmd_doctor)
    golden_cmd = sub.add_parser("golden", help="golden answers: record each model's answers to fixed probes beside "
                                               "the config (golden.yaml), or check the models against that record")
    actions = golden_cmd.add_subparsers(dest="action", required=True)
    for action, help_text in (("record", "write each model's answers, tokens/s and load time to golden.yaml"),
                              ("check", "compare each recorded model's answers now with the record; print what "
                                        "differs; exit 1 if anything does")):
        golden_action = actions.add_parser(action, help=help_text)
        golden_action.add_argument("models", nargs="*", metavar="MODEL", help="only these models (default: all)")
        golden_action.add_argument("--config", help=f"config file (default {DEFAULT_CONFIG_PATH}); the record is "
                                                    "golden.yaml beside it")
        golden_action.set_defaults(func=cmd_golden)
    keys = sub.add_parser("keys", help="list the config's API keys: names, priority classes, limits and models "
                                       "(never their values)")
    keys.add_argument("--config", help=f"config file (default {DEFAULT_CONFIG_PATH})")
    keys.set_defaults(func=cmd_keys)
    health = sub.add_parser("health", help="exit 0 iff the appliance answers /ready with 200")
    health.add_argument("--url", default=os.environ.get("OPENARC_URL", "http://127.0.0.1:8000"))
    health.add_argument("--timeout", type=float, default=5.0)
    health.set_defaults(func=cmd_health)
    for name, help_text in (("models", "list the configured models: state, load policy, memory, last use"),
                            ("load", "load a model now; returns when it is ready"),
                            ("unload", "drain a model, then stop its worker; it loads again on its next request")):
        command = sub.add_parser(name, help=help_text)
        if name != "models":
            command.add_argument("name", help="the model's name")
        command.add_argument("--url", default=os.environ.get("OPENARC_URL", "http://127.0.0.1:8000"))
        command.add_argument("--config", help="the server's config, for server.api_key_env (default "
                                              f"{DEFAULT_CONFIG_PATH} if readable; else OPENARC_API_KEY holds the key)")
        command.add_argument("--timeout", type=float, default=900.0)
        command.set_defaults(func=cmd_models if name == "models" else cmd_load_unload)
    launch = sub.add_parser("launch", help="set a coding agent up for a served chat model (its window, key, "
                                           "tools) and run it: claude, codex or opencode")
    launch.add_argument("client", choices=("claude", "codex", "opencode"))
    where = launch.add_mutually_exclusive_group()
    where.add_argument("--config", help=f"the server's config (default {DEFAULT_CONFIG_PATH} if readable)")
    where.add_argument("--url", help="ask a running server instead (its /v1/models; default $OPENARC_URL, else "
                                     "http://127.0.0.1:8000; the key from OPENARC_API_KEY)")
    launch.add_argument("--model", help="the served chat model (default: the only one)")
    launch.add_argument("--config-only", action="store_true",
                        help="write the agent's files and print the command; do not run it (without the agent "
                             "installed: print the files, write nothing)")
    launch.add_argument("--restore", action="store_true", help="take out what launch wrote for this agent")
    launch.add_argument("--timeout", type=float, default=30.0, help=argparse.SUPPRESS)
    launch.add_argument("client_args", nargs="*", metavar="-- CLIENT ARGS", help="passed to the agent")
    launch.set_defaults(func=cmd_launch)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    client_args: list[str] = []
    if argv[:1] == ["launch"] and "--" in argv:  # the agent's own arguments: argparse's subparsers mangle `--`
        argv, client_args = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = parser().parse_args(argv)
    if client_args:
        args.client_args = [*args.client_args, *client_args]
    try:
        return args.func(args)
    except ConfigError as exc:
        for line in exc.lines:
            print(f"openarc: config error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
