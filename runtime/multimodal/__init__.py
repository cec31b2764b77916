"""Multimodal inputs: loading media, the model's processor and placeholder expansion (the API
process), and the items each request carries to the engine."""
