"""The compiled-model cache, bounded (appliance.host.compile_cache): the pruning policy as a pure function over
generated caches (hypothesis), the pruner on a real directory full of stale blobs, `openarc doctor`'s report of it,
and a real server that prunes its cache to the bound after loading and tells a load from the cache from a compile."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import yaml
from hypothesis import given, settings, strategies as st

from appliance.config import parse_config
from appliance.host import compile_cache
from appliance.host.compile_cache import Entry
from appliance.host.doctor import box, disk
from conftest import model_entry, wait_until
from test_metrics import samples, value

RUNTIME = compile_cache.runtime_name("2026.4.1", "25.35.35096.9")
OLD_RUNTIME = compile_cache.runtime_name("2025.3.0", "25.18.33578.6")
MiB = 1 << 20


# --- the policy, a pure function ---------------------------------------------------------------------------------

entries_strategy = st.lists(st.builds(
    lambda runtime, model, size, used: Entry(Path(f"/c/{runtime}/{model}/{used}"), runtime, model, size, used),
    st.sampled_from([RUNTIME, OLD_RUNTIME, ""]), st.sampled_from(["a", "b", "c", "gone", ""]),
    st.integers(0, 100), st.integers(0, 20).map(float)), max_size=12,
    unique_by=lambda entry: (entry.runtime, entry.model, entry.last_used))
CONFIGURED = {"a", "b", "c"}


@settings(max_examples=400, deadline=None)
@given(entries_strategy, st.integers(0, 600), st.sets(st.sampled_from(["a", "b", "c"])))
def test_plan_prunes_to_the_bound_stale_first_least_recently_used_first_never_a_loaded_model(entries, bound, loaded):
    chosen = compile_cache.plan(entries, bound, RUNTIME, CONFIGURED, loaded)
    kept = [entry for entry in entries if entry not in chosen]
    total = sum(entry.size for entry in entries)
    left = sum(entry.size for entry in kept)

    def stale(entry):
        return entry.stale(RUNTIME, CONFIGURED)
    # nothing while it fits; beyond, it fits after, unless only the loaded models' live blobs are left
    if total <= bound:
        assert chosen == []
    assert left <= bound or all(not stale(e) and e.model in loaded for e in kept)
    # no more than needed: without the last one chosen it would not have fitted
    if chosen:
        assert left + chosen[-1].size > bound
    # a loaded model's live blobs are never chosen
    assert not any(not stale(e) and e.model in loaded for e in chosen)
    # stale before live, and within each, least recently used first
    for gone in chosen:
        for stays in kept:
            if stays.size and not (not stale(stays) and stays.model in loaded):
                assert (not stale(gone), gone.last_used) <= (not stale(stays), stays.last_used), (gone, stays)


def test_stale_means_another_runtime_or_a_model_no_longer_configured():
    assert not Entry(Path("x"), RUNTIME, "a", 1, 0).stale(RUNTIME, CONFIGURED)
    assert Entry(Path("x"), OLD_RUNTIME, "a", 1, 0).stale(RUNTIME, CONFIGURED)
    assert Entry(Path("x"), RUNTIME, "gone", 1, 0).stale(RUNTIME, CONFIGURED)
    assert Entry(Path("x"), "", "", 1, 0).stale(RUNTIME, CONFIGURED)  # the flat layout of before


def test_a_model_whose_name_is_no_path_is_still_its_own_directory(tmp_path):
    """A configured name with a slash or a space lives under a path-safe directory, and is not taken for stale."""
    spec = {"name": "team/qwen 7b", "properties": {"CACHE_DIR": str(tmp_path)}, "draft_model": None}
    directory = compile_cache.place(spec, RUNTIME)
    assert directory == tmp_path / RUNTIME / "team_qwen_7b" and spec["properties"]["CACHE_DIR"] == str(directory)
    blob(directory, "1.blob", 10, time.time())
    (entry,) = compile_cache.scan(tmp_path)
    assert not entry.stale(RUNTIME, ["team/qwen 7b"])
    assert compile_cache.plan([entry], 0, RUNTIME, ["team/qwen 7b"], loaded=["team/qwen 7b"]) == []


def test_load_source_tells_a_cache_hit_from_a_compile():
    blob = {"/c/1.blob": (100, 5)}
    assert compile_cache.load_source(blob, blob) == "cache"
    assert compile_cache.load_source({}, blob) == "compiled"  # wrote its first blob
    assert compile_cache.load_source(blob, {**blob, "/c/2.blob": (7, 6)}) == "compiled"  # another one
    assert compile_cache.load_source(blob, {"/c/1.blob": (120, 9)}) == "compiled"  # rewrote it (a new runtime)
    assert compile_cache.load_source({}, {}) == "compiled"  # no cache at all


def test_cache_max_size_is_a_size_or_a_share_of_the_disk_and_a_bad_one_names_its_key():
    def bound(value):
        return parse_config({"server": {"cache_max_size": value}}, "x.yaml").server.cache_bound
    assert bound("10%") == (0.1, None) and bound("40GiB") == (None, 40 << 30) and bound(4096) == (None, 4096)
    assert parse_config({}, "x.yaml").server.cache_bound == (0.1, None)  # the default
    for bad in ("0%", "150%", "lots", "-1", "nan%"):
        try:
            bound(bad)
        except Exception as exc:
            assert "x.yaml: server.cache_max_size: expected a size such as 40GiB or a share" in str(exc), exc
        else:
            raise AssertionError(f"{bad!r} accepted")


# --- a real cache directory ---------------------------------------------------------------------------------------

def blob(directory: Path, name: str, size: int, used: float) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_bytes(b"\0" * size)
    os.utime(path, (used, used))
    return path


def fill_stale(cache: Path, now: float, scale: int = 1) -> dict[str, Path]:
    """A cache as a box has it after an update and a config change: blobs of the old runtime, of a model gone from
    the config, and of the flat layout of before; plus a demo model's directory that is not the cache's. `scale`
    multiplies their sizes (3, 2 and 1 MiB)."""
    return {"old runtime": blob(cache / OLD_RUNTIME / "demo", "1.blob", 3 * scale * MiB, now - 50).parent,
            "model gone": blob(cache / RUNTIME / "gone", "2.blob", 2 * scale * MiB, now - 40).parent,
            "flat": blob(cache, "3.blob", 1 * scale * MiB, now - 30),
            "not the cache's": blob(cache / "models" / "demo-1234", "openvino_model.bin", 4 * MiB, now - 60).parent}


def test_prune_on_a_directory_full_of_stale_blobs_keeps_it_within_its_bound(tmp_path):
    cache, now = tmp_path / "ov", time.time()
    stale = fill_stale(cache, now)
    live_old = blob(cache / RUNTIME / "a", "4.blob", 2 * MiB, now - 20).parent
    live_new = blob(cache / RUNTIME / "b", "5.blob", 2 * MiB, now - 10).parent
    compile_cache.mark_used(live_old)  # used just now: the last-used marker beats the blob's mtime
    bound = 3 * MiB
    deleted = compile_cache.prune(cache, bound, RUNTIME, ["a", "b"], loaded=["a"])
    assert [entry.path for entry in deleted] == [stale["old runtime"], stale["model gone"], stale["flat"], live_new]
    left = compile_cache.scan(cache)
    assert [entry.path for entry in left] == [live_old] and sum(entry.size for entry in left) <= bound
    assert not (cache / OLD_RUNTIME).exists()  # an old runtime's emptied directory goes too
    assert (stale["not the cache's"] / "openvino_model.bin").exists()  # never the cache's to prune


def test_doctor_reports_the_caches_size_bound_and_stale_share(tmp_path):
    cache, now = tmp_path / "ov", time.time()
    fill_stale(cache, now)
    runtime = compile_cache.current_runtime()
    blob(cache / runtime / "demo", "6.blob", 2 * MiB, now)
    config = parse_config({"server": {"cache_dir": str(cache), "cache_max_size": "4MiB"},
                           "models": [{"name": "demo", "path": str(tmp_path), "device": "CPU"}]}, "x.yaml")
    check = disk.cache_check(box.Box("/"), config)
    assert check.status == "warn", check
    assert check.detail.startswith(f"{cache}: 8.0 MiB of its 4.0 MiB bound (server.cache_max_size: 4MiB); "
                                   "6.0 MiB (75%) stale"), check.detail
    compile_cache.prune(cache, 4 * MiB, runtime, ["demo"])  # the two oldest stale entries fit it in its bound
    check = disk.cache_check(box.Box("/"), config)
    assert check.status == "ok", check
    assert check.detail.startswith(f"{cache}: 3.0 MiB of its 4.0 MiB bound (server.cache_max_size: 4MiB); "
                                   "1.0 MiB (33%) stale"), check.detail


# --- a real server ----------------------------------------------------------------------------------------------

def test_server_prunes_its_cache_after_loading_and_the_load_metric_tells_cache_from_compile(
        appliance_factory, demo_model, tmp_path):
    """A server over a cache full of stale blobs, bounded below them: once its model is loaded (compiled, its blob
    written) the stale ones are gone and the cache is within its bound; the next server on the same cache loads the
    model from it, and openarc_model_load_seconds says which load was which. The stateful pipeline: on the CPU,
    GenAI 2026.4's continuous-batching pipeline writes its blob anew on every load (a compile each time, which the
    metric then says), its stateful one reads it back."""
    cache, now = tmp_path / "ov", time.time()
    # the bound holds the demo's blob (3.0 MiB with GenAI 2026.4) and not it with any stale entry: every stale one
    # goes, for a blob of 1 to 5 MiB
    stale = fill_stale(cache, now, scale=4)
    config = {"server": {"cache_dir": str(cache), "cache_max_size": "5MiB"},
              "models": [model_entry("demo", demo_model, pipeline="stateful")]}
    first = appliance_factory(config)
    runtime_dir = cache / compile_cache.current_runtime()

    def pruned():
        entries = compile_cache.scan(cache)
        return entries if [entry.path for entry in entries] == [runtime_dir / "demo"] else None
    (entry,) = wait_until(pruned, 30, "the stale blobs pruned")
    assert 0 < entry.size <= 5 * MiB and list((runtime_dir / "demo").glob("*.blob"))
    assert not any(path.exists() for what, path in stale.items() if what != "not the cache's")
    scrape = samples(first.metrics())
    assert value(scrape, "openarc_model_load_seconds_count", model="demo", source="compiled") == 1
    assert value(scrape, "openarc_model_load_seconds_count", model="demo", source="cache") == 0
    assert "compiled-model cache over its bound of 5.0 MiB: deleted" in first.logs()
    first.stop()

    second = appliance_factory(config)
    scrape = samples(second.metrics())
    assert value(scrape, "openarc_model_load_seconds_count", model="demo", source="cache") == 1
    assert value(scrape, "openarc_model_load_seconds_count", model="demo", source="compiled") == 0


def test_a_reload_that_lowers_cache_max_size_prunes_at_once(appliance_factory, demo_model, tmp_path):
    """server.cache_max_size lowered by a reload (SIGHUP) bounds the cache then, not at the next model's load: the
    stale blobs that fitted the old bound are gone with no load in between. (Before, the pruner looked only when
    the set of loaded models changed, so a reload of the bound alone did nothing.)"""
    cache = tmp_path / "ov"
    stale = fill_stale(cache, time.time(), scale=4)
    config = {"server": {"cache_dir": str(cache), "cache_max_size": "1GiB"},
              "models": [model_entry("demo", demo_model, pipeline="stateful")]}
    app = appliance_factory(config)
    wait_until(lambda: list((cache / compile_cache.current_runtime() / "demo").glob("*.blob")), 30, "its blob")
    assert all(path.exists() for path in stale.values())  # within 1 GiB: nothing to prune
    pid = app.model_status("demo")["pid"]
    config["server"]["cache_max_size"] = "5MiB"
    app.config_path.write_text(yaml.safe_dump(config))
    app.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: not any(path.exists() for what, path in stale.items() if what != "not the cache's"), 30,
               "the stale blobs pruned to the new bound")
    assert (stale["not the cache's"] / "openvino_model.bin").exists()
    assert app.model_status("demo")["pid"] == pid  # no load came between: the reload itself pruned


def test_prune_never_deletes_or_counts_what_a_symlink_in_the_cache_points_at(tmp_path):
    # A cache directory may hold links (an operator's, or a runtime directory moved to another disk and linked
    # back): what they point at is not the cache's. Pruning to a bound of 0 deletes every entry it may, and nothing
    # outside the cache directory.
    cache, outside = tmp_path / "cache", tmp_path / "outside"
    (outside / "victim").mkdir(parents=True)
    (outside / "victim" / "precious").write_bytes(b"x" * 4096)
    (outside / "loose.blob").write_bytes(b"y" * 4096)
    cache.mkdir()
    (cache / OLD_RUNTIME).symlink_to(outside)                                  # a runtime directory that is a link
    (cache / RUNTIME).mkdir()
    (cache / RUNTIME / "gone").symlink_to(outside / "victim")                  # a model directory that is a link
    (cache / RUNTIME / "a").mkdir()
    (cache / RUNTIME / "a" / "inside").symlink_to(outside / "victim")          # a link inside an entry
    (cache / "old.blob").symlink_to(outside / "loose.blob")                    # a flat-layout file that is a link
    assert all(entry.size == 0 for entry in compile_cache.scan(cache))         # a link's target is not counted
    compile_cache.prune(cache, 0, RUNTIME, CONFIGURED, ())
    assert (outside / "victim" / "precious").read_bytes() == b"x" * 4096
    assert (outside / "loose.blob").read_bytes() == b"y" * 4096


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=600), st.text(max_size=600))
def test_any_runtime_versions_make_one_directory_a_load_can_use(tmp_path_factory, openvino, runtime):
    # the versions come from package metadata and dpkg's status file: empty, odd characters, or very long
    name = compile_cache.runtime_name(openvino, runtime)
    assert compile_cache.RUNTIME_DIR.fullmatch(name) and len(name.encode()) <= 255
    spec = {"name": "demo", "properties": {"CACHE_DIR": str(tmp_path_factory.mktemp("ov"))}}
    assert compile_cache.place(spec, name).is_dir()


def test_the_cache_bookkeeping_of_a_load_never_fails_it(tmp_path):
    # A load reads its cache directory before and after compiling and marks it used; the pruner (another process's
    # thread) may delete the directory meanwhile, or the cache may be no directory at all: the load goes on.
    directory = compile_cache.place({"name": "demo", "properties": {"CACHE_DIR": str(tmp_path / "ov")}}, RUNTIME)
    blob(directory, "1.blob", 10, time.time())
    assert compile_cache.snapshot(directory)
    shutil.rmtree(directory)  # pruned under the load
    assert compile_cache.snapshot(directory) == {}
    compile_cache.mark_used(directory)
    (tmp_path / "a-file").write_text("not a directory")
    spec = {"name": "demo", "properties": {"CACHE_DIR": str(tmp_path / "a-file")}}
    assert compile_cache.place(spec, RUNTIME) is None
    assert spec["properties"]["CACHE_DIR"] == str(tmp_path / "a-file")  # OpenVINO is left to say what it makes of it
