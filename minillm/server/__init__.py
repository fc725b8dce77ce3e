"""The OpenAI-compatible HTTP server (imported only by `minillm serve`)."""
