"""Clients of the engine core processes: one replica's ZMQ client, the data-parallel client over all replicas, and the balancer between them."""
