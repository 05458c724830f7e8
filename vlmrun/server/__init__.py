"""OpenAI-compatible HTTP server (arrives with the server work)."""
