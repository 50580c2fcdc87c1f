"""OpenAI-compatible HTTP server: app.py (endpoints, `openflash serve`), protocol.py (request / response models),
chat_template.py (messages -> prompt), metrics.py (Prometheus text)."""
