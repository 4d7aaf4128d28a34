"""Routing: the replica-routing simulator, the model router, routing by KV headroom."""
