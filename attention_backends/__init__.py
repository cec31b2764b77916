"""Attention implementations over the paged KV cache; `base` holds the interface."""
