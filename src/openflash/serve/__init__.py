"""OpenAI-compatible HTTP server: app.py (endpoints, `openflash serve`), protocol.py (request / response models),
chat.py (chat requests -> conversations, replies -> messages), metrics.py (Prometheus text)."""
