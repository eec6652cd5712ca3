#!/bin/sh
# Installs the systemd units, the openarc user and render group, the models
# directory and (if none exists) an example /etc/openarc/openarc.yaml with the
# demo model. Run as root after `make install` (which creates /opt/openarc/venv).
# Safe to run again: it never overwrites an existing config or model.
set -eu

units_dir=$(cd "$(dirname "$0")" && pwd)
venv=${OPENARC_VENV:-/opt/openarc/venv}
config=/etc/openarc/openarc.yaml
demo_model=/var/lib/openarc/models/demo

install -D -m 0644 "$units_dir/openarc.service" /etc/systemd/system/openarc.service
install -D -m 0644 "$units_dir/openarc@.service" /etc/systemd/system/openarc@.service
install -D -m 0644 "$units_dir/openarc.socket" /etc/systemd/system/openarc.socket
install -D -m 0644 "$units_dir/openarc@.socket" /etc/systemd/system/openarc@.socket
install -D -m 0644 "$units_dir/openarc.sysusers.conf" /etc/sysusers.d/openarc.conf
install -D -m 0644 "$units_dir/openarc.tmpfiles.conf" /etc/tmpfiles.d/openarc.conf

systemd-sysusers /etc/sysusers.d/openarc.conf
systemd-tmpfiles --create /etc/tmpfiles.d/openarc.conf

if [ ! -e "$config" ]; then
    install -D -m 0644 "$units_dir/openarc.example.yaml" "$config"
    echo "installed example config $config"
    if [ ! -e "$demo_model" ] && [ -x "$venv/bin/openarc" ]; then
        "$venv/bin/openarc" demo-model "$demo_model"
        chmod -R u=rwX,go=rX "$demo_model"  # the service runs as openarc, not root
        echo "built demo model $demo_model"
    fi
fi

# Only a running systemd can reload; in a container build or chroot there is none.
if [ "$(cat /proc/1/comm 2>/dev/null)" = systemd ]; then
    systemctl daemon-reload
fi
echo "installed: systemctl start openarc  (all models)  or  systemctl start openarc@demo"
echo "  kept listening across restarts: systemctl enable --now openarc.socket  (docs/operations.md: Socket activation)"
