"""`runtime bench` and `runtime tune`: throughput, latency, serving load and compute efficiency,
measured by the project's own tools against named peers on the same workload."""
