# Llama-3.1-8B DPO on 8 GPUs with FSDP2, starting from the SFT run of config/sft_llama3.1_8b_fsdp.py:
#   torchrun --nproc_per_node=8 train_dpo.py config/dpo_llama3.1_8b_fsdp.py --data=prefs.jsonl
# The reference log-probs are computed once (all 8 GPUs, forward only) and kept in out_dir/reference/:
# no second 8B model in memory while training.
out_dir = "out/dpo-llama3.1-8b"
init_from = "out/sft-llama3.1-8b/hf"
data = "prefs.jsonl"
max_len = 8192  # per sequence: a pair is at most 16384 tokens, one micro-batch
parallel = "fsdp"
batch_size = 128  # preference pairs per step across all 8 GPUs
microbatch_tokens = 16384  # per GPU per forward
activation_checkpointing = True
epochs = 1.0
learning_rate = 5e-7
min_lr = 5e-8
warmup_iters = 20
beta = 0.1
compile = "auto"  # on with CUDA; off on CPU
log_interval = 10
eval_interval = 200
