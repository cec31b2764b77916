"""The `runtime` console script."""
