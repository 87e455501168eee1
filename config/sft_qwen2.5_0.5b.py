# Qwen2.5-0.5B SFT on your own chat JSONL, one GPU:
#   python train_sft.py config/sft_qwen2.5_0.5b.py --init_from=/models/Qwen2.5-0.5B-Instruct --data=chats.jsonl
out_dir = "out/sft-qwen2.5-0.5b"
init_from = "/models/Qwen2.5-0.5B-Instruct"  # a local Hugging Face folder (weights + tokenizer.json)
data = "chats.jsonl"  # {"messages": [...]} per line; prepared into out_dir/data on the first run
max_len = 4096
batch_size = 64  # examples per optimizer step
microbatch_tokens = 16384  # one forward; the chunked LM head keeps the 152k-vocab logits out of memory
epochs = 2.0
learning_rate = 2e-5
min_lr = 2e-6
warmup_iters = 30
weight_decay = 0.0
compile = "auto"  # on with CUDA; off on CPU
log_interval = 10
eval_interval = 200
