#!/bin/sh
# fetch-quadlet.sh DEST: put Debian 13's podman quadlet generator at
# DEST/usr/libexec/podman/quadlet, for tests/test_quadlet.py.
#
# Why: Debian 12's podman (4.3) has no quadlet; trixie's podman 5.4 has, and
# its quadlet binary is static Go needing only libc, so it runs on Debian 12.
# The host's apt state is never touched: a private sources list, state and
# cache directory under DEST/apt, signed by the Debian archive keyring.
# Idempotent: exits at once when DEST already holds a working quadlet.
set -eu

dest=${1:?usage: fetch-quadlet.sh DEST}
suite=${QUADLET_SUITE:-trixie}
quadlet="$dest/usr/libexec/podman/quadlet"

if [ -x "$quadlet" ] && "$quadlet" -version >/dev/null 2>&1; then
    exit 0
fi

# The mirror is whichever one the host's apt already uses for its Debian
# release (the entry whose suite has no -updates/-security suffix).
mirror=${DEBIAN_MIRROR:-$(apt-get indextargets --no-release-info \
    --format '$(REPO_URI) $(RELEASE) $(TARGET_OF)' \
    | awk '$3 == "deb" && $2 !~ /-/ { print $1; exit }')}
[ -n "$mirror" ] || { echo "fetch-quadlet: no Debian mirror in host apt config" >&2; exit 1; }

apt_dir="$dest/apt"
mkdir -p "$apt_dir/state/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/debs"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror $suite main" \
    >"$apt_dir/sources.list"

private_apt() {
    apt-get -q \
        -o Dir::Etc::sourcelist="$apt_dir/sources.list" \
        -o Dir::Etc::sourceparts=- \
        -o Dir::State="$apt_dir/state" \
        -o Dir::Cache="$apt_dir/cache" \
        -o Dir::State::status=/dev/null \
        -o APT::Get::List-Cleanup=0 \
        -o APT::Sandbox::User=root \
        "$@"
}

private_apt update >"$apt_dir/update.log" 2>&1 || { cat "$apt_dir/update.log" >&2; exit 1; }
# apt-get download writes into the current directory.
(cd "$apt_dir/debs" && private_apt download podman >/dev/null)
dpkg-deb -x "$apt_dir"/debs/podman_*.deb "$dest"
"$quadlet" -version
