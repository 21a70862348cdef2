"""qk's HTTP server: Anthropic Messages, OpenAI chat completions and llama.cpp's native endpoints
over one scheduler (``create_app``); ``python -m qk.serve`` runs it."""

from qk.server.app import create_app
from qk.server.generation import Loaded

__all__ = ["Loaded", "create_app"]
