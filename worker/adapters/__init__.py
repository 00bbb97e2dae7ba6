"""The engines a worker runs, one adapter class per kind of work (base.py), dispatched on by type."""
