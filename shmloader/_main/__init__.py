"""The main-process side: the loader's iterators, their parts and the worker pool (see docs/design.md)."""
