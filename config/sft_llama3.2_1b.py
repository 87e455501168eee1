# Llama-3.2-1B SFT on your own chat JSONL, one GPU:
#   python train_sft.py config/sft_llama3.2_1b.py --init_from=/models/Llama-3.2-1B-Instruct --data=chats.jsonl
out_dir = "out/sft-llama3.2-1b"
init_from = "/models/Llama-3.2-1B-Instruct"
data = "chats.jsonl"
max_len = 8192
batch_size = 64
microbatch_tokens = 16384
epochs = 2.0
learning_rate = 1e-5
min_lr = 1e-6
warmup_iters = 30
weight_decay = 0.0
compile = "auto"  # on with CUDA; off on CPU
log_interval = 10
eval_interval = 200
