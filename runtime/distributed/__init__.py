"""Parallelism: how ranks are laid out, their process groups, pipeline stages, and the
data-parallel load balancer."""
