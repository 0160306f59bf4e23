"""Robustness tests: kills, worker deaths, leaks, churn, small or full /dev/shm, memory
limits and the C ring under sanitizers (docs/design.md, contract 5)."""
