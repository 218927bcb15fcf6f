"""Random PEFT LoRA adapters (non-zero B) for tests, made by PEFT itself on a transformers model."""

from __future__ import annotations

from pathlib import Path

import torch


def make_peft_adapter(model, path: Path, r: int, targets: list[str], seed: int, alpha: float | None = None,
                      rslora: bool = False, b_std: float = 0.02) -> Path:  # fmt: skip
    """Wrap ``model`` (a transformers model, left unchanged) in a PEFT LoRA of rank ``r`` on
    ``targets``, fill A and B with random values (B non-zero, unlike PEFT's default init,
    which makes the delta zero), and save the adapter to ``path``."""
    import peft

    cfg = peft.LoraConfig(r=r, lora_alpha=alpha if alpha is not None else 2 * r, target_modules=targets,
                          init_lora_weights=False, use_rslora=rslora, lora_dropout=0.0)  # fmt: skip
    peft_model = peft.get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * b_std)
    peft_model.save_pretrained(str(path))
    peft_model.unload()  # the base model's modules back as they were
    return path
