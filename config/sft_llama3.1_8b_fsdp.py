# Llama-3.1-8B SFT on 8 GPUs with FSDP2 (sharded weights, gradients and optimizer state):
#   torchrun --nproc_per_node=8 train_sft.py config/sft_llama3.1_8b_fsdp.py --init_from=/models/Llama-3.1-8B-Instruct
# Multi-node: torchrun --nnodes=2 --node_rank=R --master_addr=HOST --nproc_per_node=8 train_sft.py ...
out_dir = "out/sft-llama3.1-8b"
init_from = "/models/Llama-3.1-8B-Instruct"
data = "chats.jsonl"
max_len = 8192
parallel = "fsdp"
batch_size = 128  # examples per step across all 8 GPUs
microbatch_tokens = 16384  # per GPU per forward
activation_checkpointing = True  # 8B activations at 16k tokens do not fit an 80 GB GPU otherwise
epochs = 2.0
learning_rate = 1e-5
min_lr = 1e-6
warmup_iters = 50
weight_decay = 0.0
compile = "auto"  # on with CUDA; off on CPU
log_interval = 10
eval_interval = 200
