"""The frontend's OpenAI-compatible HTTP API, /health and /metrics."""
