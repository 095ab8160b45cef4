"""Engines behind small protocols; each module is the only one that imports its library.

- ``trainer_deepspeed``: DeepSpeed ZeRO-1/2 on a pre-built trainer group (``ZeroTrainer``).
- ``reshard``: ZeRO partition reshard when the trainer count changes (pure plan + point-to-point exchange).
- ``rollout_torch``: batched sampling with a KV cache through transformers (CPU or GPU).
- ``rollout_vllm``: vLLM with sleep mode (GPU only, import-guarded, unverified here).
"""
