"""Unit tests: one part of shmloader at a time (a module, the C ring, a command, the docs),
built and checked alone or through the loader where the part is only reached that way."""
