# Llama-3.1-8B-Instruct LoRA SFT on ONE GPU: the base frozen in bfloat16 (16 GB), rank-16 adapters on every
# attention and MLP projection (42M parameters, trained in float32 with AdamW: 0.7 GB), activations checkpointed.
# ~22 GB at 8k-token micro-batches (docs/lora.md): a 48 or 80 GB GPU; on 24 GB add --quantize_base=nf4 (QLoRA).
#   python train_sft.py config/sft_lora_llama3.1_8b.py --init_from=/models/Llama-3.1-8B-Instruct --data=chats.jsonl
out_dir = "out/sft-lora-llama3.1-8b"
init_from = "/models/Llama-3.1-8B-Instruct"
data = "chats.jsonl"
max_len = 8192
batch_size = 32
microbatch_tokens = 8192
activation_checkpointing = True
lora_rank = 16
lora_alpha = 32
epochs = 2.0
learning_rate = 2e-4  # LoRA trains a small update: ~10x the full fine-tuning rate (QLoRA paper, peft recipes)
min_lr = 2e-5
warmup_iters = 20
weight_decay = 0.0
log_interval = 10
eval_interval = 200
