"""shmloader inside training frameworks that rebuild the user's loader.

`accelerate`: prepare_data_loader() and skip_first_batches() for Hugging Face
Accelerate; `transformers`: a Trainer mixin.  Each imports its framework only
when imported itself (docs/integrations.md).
"""
