# Llama-3.1-8B DPO with LoRA on ONE GPU, from the merged export of config/sft_lora_llama3.1_8b.py (or any
# instruct model). The reference is the same network with its adapters switched off: no second model, no cache.
#   python train_dpo.py config/dpo_lora_llama3.1_8b.py --data=prefs.jsonl
out_dir = "out/dpo-lora-llama3.1-8b"
init_from = "out/sft-lora-llama3.1-8b/hf"
data = "prefs.jsonl"
max_len = 4096
batch_size = 32
microbatch_tokens = 8192  # whole pairs: chosen + rejected, each up to max_len
activation_checkpointing = True
lora_rank = 16
lora_alpha = 32
reference = "adapters_off"
epochs = 1.0
learning_rate = 5e-6  # LoRA DPO: ~10x the full-model rate of 5e-7, beta 0.1
min_lr = 5e-7
warmup_iters = 10
beta = 0.1
log_interval = 10
eval_interval = 100
