"""The HTTP API, one module per route family; appliance.front.server assembles them into one aiohttp app."""
