"""The Megatron trainer.

Import-light on purpose: megatron-core and transformers load only when a submodule is imported.

- :mod:`hpcrl.train.cpu_compat`: megatron-core's CUDA-only calls adapted for gloo on CPU (on GPUs only the TE-less MoE router fix).
- :mod:`hpcrl.train.parallel`: ``torch.distributed`` / model-parallel start-up, DDP + optimizer, ``train_step``.
- :mod:`hpcrl.train.bridge`: HF Qwen2 / Qwen3 / Llama / Qwen3-MoE / GLM-4.5 <-> megatron-core ``GPTModel``
  (config, weights); :mod:`hpcrl.train.deepseek_moe`: the GLM-4.5 / DeepSeek-V3 router and its expert bias.
- :mod:`hpcrl.train.logprobs`: per-token log-probs and entropy over the tensor-parallel vocab.
- :mod:`hpcrl.train.algorithms`: advantages and policy losses.
"""
