# Llama-3.2-1B DPO on your own preference JSONL, one GPU, starting from the SFT run of config/sft_llama3.2_1b.py:
#   python train_dpo.py config/dpo_llama3.2_1b.py --data=prefs.jsonl
out_dir = "out/dpo-llama3.2-1b"
init_from = "out/sft-llama3.2-1b/hf"
data = "prefs.jsonl"
max_len = 4096
batch_size = 64
microbatch_tokens = 16384
epochs = 1.0
learning_rate = 5e-7
min_lr = 5e-8
warmup_iters = 20
beta = 0.1
compile = "auto"  # on with CUDA; off on CPU
log_interval = 10
eval_interval = 200
