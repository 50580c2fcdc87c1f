"""OpenAI-compatible HTTP server: app.py (endpoints, `openflash serve`), jobs.py (a request's choices in flight:
outputs, stream deltas, forced tool-call continuation, usage), protocol.py (request / response models), chat.py
(chat requests -> conversations, replies -> messages), metrics.py (Prometheus, through prometheus_client)."""
