"""The engine: requests, scheduler, engine loop, detokenizer."""
