"""Equivalence tests: the same scenario through torch's DataLoader and shmloader's, the
outputs compared bit for bit (docs/design.md, contract 1)."""
