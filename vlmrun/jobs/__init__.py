"""Batch jobs: captioning many images (CLI, streaming pipeline, Ray Data)."""
