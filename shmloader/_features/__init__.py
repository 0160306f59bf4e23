"""The mechanisms behind the loader's options, which the loader composes; nothing of the main side (see docs/design.md)."""
