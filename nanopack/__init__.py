"""The machinery below the recipes: ranks and devices, checkpoints, hub names, tokenizers and chat
templates, LoRA, fused kernels, generation, rewards, the reference model, configuration, and the
fake step behind plan.py. Read it when a run fails; the algorithm lives in the top-level scripts,
model.py, packing.py and losses.py."""
