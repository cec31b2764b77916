"""Test helpers shipped with the package, for our tests and for plugin authors': tiny models,
paged batches, and the platform conformance suite (`runtime.testing.conformance`)."""
