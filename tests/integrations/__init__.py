"""Integration tests (marker `integrations`): real training frameworks and `torchrun`, each
compared with the framework's own loader."""
