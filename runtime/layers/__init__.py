"""Reusable model layers: shardable, quantizable linears, norms, rotary embeddings, attention."""
