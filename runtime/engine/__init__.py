"""The engine: the core step loop, input processing and output processing."""
