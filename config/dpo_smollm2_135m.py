# SmolLM2-135M DPO on a laptop CPU in minutes, from the SFT run of config/sft_smollm2_135m.py:
#   python train_dpo.py config/dpo_smollm2_135m.py
out_dir = "out/dpo-smollm2-135m"
init_from = "out/sft-smollm2-135m/hf"  # the Hugging Face folder an SFT run leaves (weights + tokenizer)
data = "builtin"  # the arithmetic preference pairs, with the model's tokenizer and chat template
batch_size = 8  # preference pairs per optimizer step
microbatch_tokens = 4096
max_iters = 50
learning_rate = 5e-7  # the Zephyr / Tulu DPO recipes: 5e-7 with beta 0.1
min_lr = 5e-8
warmup_iters = 5
beta = 0.1
compile = "auto"  # on with CUDA; off on CPU
log_interval = 10
eval_interval = 25
eval_examples = 50
