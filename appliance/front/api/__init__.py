"""The HTTP API, one module per route family; appliance.front.app assembles them into one aiohttp app."""
