"""The front process: the aiohttp app (`server`, `api/`), the supervisors of the worker processes, request routing,
lifecycle states and metrics. It never imports OpenVINO or `appliance.worker` (tests/test_layout.py checks it):
a pipeline that crashes cannot take the front with it."""
