"""What reads or talks to the machine, for either process: Intel GPU telemetry and the kernel log (`telemetry`),
the OOM killer and memory cgroups (`oom`), the classification of errors and exits into faults (`faults`), and
systemd's sd_notify (`notify`). Nothing here imports OpenVINO or aiohttp."""
