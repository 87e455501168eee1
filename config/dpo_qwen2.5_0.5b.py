# Qwen2.5-0.5B DPO on your own preference JSONL, one GPU, starting from the SFT run of config/sft_qwen2.5_0.5b.py:
#   python train_dpo.py config/dpo_qwen2.5_0.5b.py --data=prefs.jsonl
out_dir = "out/dpo-qwen2.5-0.5b"
init_from = "out/sft-qwen2.5-0.5b/hf"  # the Hugging Face folder an SFT run leaves (weights + tokenizer)
data = "prefs.jsonl"  # {"prompt", "chosen", "rejected"} per line; prepared into out_dir/data on the first run
max_len = 4096  # per sequence: a pair is at most 2 * max_len tokens
batch_size = 64  # preference pairs per optimizer step
microbatch_tokens = 16384  # one forward over whole pairs; must hold the longest pair
epochs = 1.0
learning_rate = 5e-7
min_lr = 5e-8
warmup_iters = 20
beta = 0.1
compile = "auto"  # on with CUDA; off on CPU
log_interval = 10
eval_interval = 200
