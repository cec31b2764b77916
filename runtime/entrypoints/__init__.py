"""The HTTP server: OpenAI- and Anthropic-compatible routes on an `AsyncLLM`."""
