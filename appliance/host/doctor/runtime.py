"""The GPU compute runtime OpenVINO's GPU plugin runs on: Intel's OpenCL ICD (an /etc/OpenCL/vendors/*.icd naming
libigdrcl.so, plus the ICD loader libOpenCL.so.1) and Level Zero (libze_loader.so.1 and the GPU driver
libze_intel_gpu.so.1); and versions known to break, each entry with its public source."""

from __future__ import annotations

from dataclasses import dataclass

from appliance.host.doctor import Check, fail, ok, warn
from appliance.host.doctor.box import Box

# Packages that carry Intel's compute runtime on Debian/Ubuntu (intel/compute-runtime releases and distro names).
RUNTIME_PACKAGES = ("intel-opencl-icd", "libze-intel-gpu1", "intel-level-zero-gpu")
INSTALL_FIX = ("sudo apt install intel-opencl-icd libze-intel-gpu1 libze1 ocl-icd-libopencl1 (Ubuntu 24.04+/Debian 13; "
               "older releases: Intel's packages from https://github.com/intel/compute-runtime/releases), then "
               "check with `clinfo -l`")


@dataclass(frozen=True)
class KnownBad:
    """A runtime version users hit trouble with: packages whose version starts with `version`."""

    packages: tuple[str, ...]
    version: str
    trouble: str
    fix: str
    source: str


KNOWN_BAD = (
    KnownBad(RUNTIME_PACKAGES, "26.18", "OpenVINO Model Server crashes on an Arc iGPU after the upgrade from "
             "compute-runtime 26.01 (a regression, GSD-12905)", "pin the previous runtime (26.01) until a fixed release: "
             "sudo apt install intel-opencl-icd=<26.01 version> libze-intel-gpu1=<26.01 version>",
             "intel/compute-runtime#937"),
    KnownBad(RUNTIME_PACKAGES, "25.18.33578", "OpenCL lists no platform on Arc A-series cards (clinfo: \"Number of "
             "platforms 0\"), so OpenVINO sees no GPU", "upgrade the compute runtime, or pin 25.13.33276.16",
             "intel/compute-runtime#831"),
    KnownBad(RUNTIME_PACKAGES, "26.27.39122.12", "SIGSEGV during inference on Battlemage (Arc Pro B50); rolling back "
             "to 26.22 fixed it", "upgrade past 26.27.39122.12, or pin 26.22", "intel/compute-runtime#971"),
)


def known_bad(packages: dict[str, str]) -> list[tuple[str, str, KnownBad]]:
    """(package, version, entry) for each installed package a table entry names."""
    return [(name, version, entry) for entry in KNOWN_BAD for name, version in packages.items()
            if name in entry.packages and version.startswith(entry.version)]


def installed_version(packages: dict[str, str]) -> str | None:
    """The compute runtime's version: that of the first of RUNTIME_PACKAGES installed (None: none is, e.g. a runtime
    installed outside the package manager)."""
    return next((packages[name] for name in RUNTIME_PACKAGES if name in packages), None)


def _opencl_icd(box: Box) -> tuple[str | None, str | None]:
    """(icd file naming Intel's runtime, its library if found on the box)."""
    for name in box.listdir("/etc/OpenCL/vendors"):
        library = (box.read(f"/etc/OpenCL/vendors/{name}") or "").strip()
        if "igdrcl" in library:
            if library.startswith("/"):
                return name, library if box.path(library).exists() else None
            found = box.find_library(library) or box.find_library(f"intel-opencl/{library}")
            return name, str(found) if found else None
    return None, None


def checks(box: Box) -> list[Check]:
    packages = box.packages()
    icd, icd_library = _opencl_icd(box)
    loader = box.find_library("libOpenCL.so.1")
    ze_loader, ze_gpu = box.find_library("libze_loader.so.1"), box.find_library("libze_intel_gpu.so.1")
    versions = ", ".join(f"{name} {packages[name]}" for name in RUNTIME_PACKAGES if name in packages)
    found = []
    if icd and icd_library and loader:
        found.append(ok("compute runtime: OpenCL", f"/etc/OpenCL/vendors/{icd} -> {icd_library}"
                                                   + (f" ({versions})" if versions else "")))
    else:
        missing = ("Intel's OpenCL ICD (/etc/OpenCL/vendors/intel.icd)" if not icd else
                   f"the library {icd} names" if not icd_library else "the ICD loader libOpenCL.so.1")
        found.append(fail("compute runtime: OpenCL", f"missing {missing}: OpenVINO's GPU plugin cannot see the GPU",
                          INSTALL_FIX))
    if ze_loader and ze_gpu:
        found.append(ok("compute runtime: Level Zero", f"{ze_loader}, {ze_gpu}"))
    else:
        found.append(warn("compute runtime: Level Zero", "Level Zero is not installed (OpenVINO's GPU plugin uses "
                          "OpenCL; Level Zero is needed by its newer paths and by oneAPI tools)",
                          "sudo apt install libze-intel-gpu1 libze1"))
    bad = known_bad(packages)
    for name, version, entry in bad:
        found.append(warn(f"known issue: {name} {version}", f"{entry.trouble} ({entry.source})", entry.fix))
    if not bad:
        found.append(ok("known-bad versions", f"none of the {len(KNOWN_BAD)} listed runtime versions is installed"))
    return found
