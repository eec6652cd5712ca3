"""openarc: an OpenAI-compatible LLM appliance for Intel GPUs, one supervised worker per model."""

__version__ = "0.1.0"
