"""LoRA adapters, the torch-free part: the public `LoRARequest`, the engine's `LoRAConfig`, and
the checks of a PEFT folder against the base model (`peft_folder.py`), which the engine core
runs before any worker loads the weights. The weights themselves are read and applied on the
model side (`model/lora_layers.py`, `kernels/lora.py`), kept by the worker
(`worker/lora_manager.py`). See docs/lora.md.
"""
