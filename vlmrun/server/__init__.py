"""OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of one `AsyncEngine`.

`create_app(engine, settings)` builds the app (`vlmrun.server.app`); `vlmrun serve` runs it
(`vlmrun.server.cli`); `ServerThread` runs it in a background thread (`vlmrun.server.launch`).
Modules: `protocol` (request parsing), `responses` (response bodies), `chat_handler` and
`completions_handler` (the generation endpoints) over `submission` (the steps they share), `media`
(image URL / local path policy and fetching), `transport` (body cap, disconnects, SSE), `metrics`
(Prometheus), `state` (per-app state), `errors` (OpenAI error shape).
"""
