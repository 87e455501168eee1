# SmolLM2-135M-Instruct LoRA SFT on a laptop CPU (rank 8 on every projection: 2.4M of 135M parameters train).
# QLoRA, the base in 4 bits (slower on a CPU, smaller): add --quantize_base=nf4 (pip install torchao).
#   python train_sft.py config/sft_lora_smollm2_135m.py --init_from=/models/SmolLM2-135M-Instruct
out_dir = "out/sft-lora-smollm2-135m"
init_from = "/models/SmolLM2-135M-Instruct"
data = "builtin"
batch_size = 8
microbatch_tokens = 2048
max_iters = 100
lora_rank = 8
learning_rate = 2e-4
min_lr = 2e-5
warmup_iters = 10
weight_decay = 0.0
log_interval = 10
eval_interval = 50
eval_examples = 50
