"""What reads or talks to the machine, for either process: Intel GPU telemetry (a process's GPU memory in
`device_memory`, the cards in `gpus`, what the readers share and process RSS in `telemetry`), the kernel log
(`kernel_log`, with the GPU hang/reset lines it looks for in `gpu_events`), the OOM killer and memory cgroups
(`oom`), the classification of errors and exits into faults (`faults`), and systemd's sd_notify (`notify`).
Nothing here imports OpenVINO or aiohttp."""
