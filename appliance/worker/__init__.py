"""The worker process: one per model, started fresh by the front (`python -m appliance.worker`), the only side that
imports OpenVINO. `main` runs it; `engines/` holds one engine per worker kind; `detokenize` turns streamed tokens
into text. Nothing here imports aiohttp, and nothing in `appliance.front` imports this package."""
