"""The worker side: what runs in a worker process, and the records both sides exchange; nothing of the main side (see docs/design.md)."""
