"""The OffloadingConnector: a host-memory and a disk level for evicted prefix-cache blocks."""
