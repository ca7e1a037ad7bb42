"""LoRA, PEFT-shaped (a facade: imports and __all__ only; chapter 09, minite/layers/lora.py).

    from minite.lora import LoRAConfig, apply_lora, merge_lora, save_lora, load_lora
    apply_lora(model, LoRAConfig(r=8, alpha=16, target_modules=["qkv", "proj"]))
"""
from minite.layers.lora import (  # noqa: F401
    LoRAConfig,
    LoRAError,
    LoRALinear,
    apply_lora,
    load_lora,
    lora_layers,
    lora_state_dict,
    merge_lora,
    print_trainable_parameters,
    save_lora,
    unmerge_lora,
)

__all__ = ["LoRAConfig", "LoRALinear", "apply_lora", "merge_lora", "unmerge_lora", "lora_state_dict", "save_lora",
           "load_lora", "print_trainable_parameters", "lora_layers", "LoRAError"]
