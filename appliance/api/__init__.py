"""The HTTP API, one module per route family; appliance.server assembles them into one aiohttp app."""
