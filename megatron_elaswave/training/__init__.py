"""GPT pretraining on megatron-core's public API, with Megatron-LM's flags (``pretrain_gpt.py``)."""
