"""The Redis side of a gateway: submit and follow runs, the reply router, the worker registry, cancels, keys, limits and stored state."""
