"""The ring and its memory: bytes and ordering, no policy (see docs/design.md)."""
