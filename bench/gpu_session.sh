#!/bin/bash
# The checks of a session lent a GPU, in order of value, each under its own limit, logs in $OUT (<= 8 files):
#   bash bench/gpu_session.sh 250      # seconds in all; the last step gets what is left
# gpu_data/chats.jsonl (made below; git-ignored): 200 chats of ~3,400 byte tokens, planned on the CPU machine with
#   python plan.py train_sft.py --init_from=scratch --preset=llama-3.2-1b --data=gpu_data/chats.jsonl ... (as below)
# bench/real_peak.py runs train_sft.py at the preset's vocabulary, as plan.py plans it, and prints CUDA's peaks.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
O=${OUT:-/tmp/gpu_out}; mkdir -p "$O"
end=$(( $(date +%s) + ${1:-250} ))
mkdir -p gpu_data && python3 -c "import json, random; random.seed(0); w = 'alpha beta gamma delta epsilon zeta eta theta \
iota kappa lambda mu nu xi omicron pi rho sigma tau'.split(); say = lambda: ' '.join(random.choice(w) for _ in range(330))
print('\n'.join(json.dumps({'messages': [{'role': r, 'content': say()} for r in ('user', 'assistant')]}) for _ in range(200)))
" > gpu_data/chats.jsonl
step() {  # step NAME LIMIT cmd...: cmd's output appended to $O/NAME.log; prints the step's exit code and time
  local name=$1 limit=$2 t0=$(date +%s); shift 2
  echo "=== $name: $* (limit ${limit}s)" | tee -a "$O/$name.log"
  timeout "$limit" "$@" >> "$O/$name.log" 2>&1
  echo "=== $name rc=$? in $(( $(date +%s) - t0 ))s" | tee -a "$O/$name.log"
}
step env 20 python3 -c "import inspect, torch, triton; from torch.nn.attention.varlen import varlen_attn as f
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), inspect.signature(f))"
step cuda_tests 70 python3 -m pytest -p no:cacheprovider -v -n 4 -rfEs tests/test_cuda_paths.py \
  tests/test_rope.py::test_fused_matches_reference_cuda tests/test_model.py::test_packed_equals_each_sequence_alone_cuda
step kernels 45 python3 bench/bench_kernels.py --iters 10
step plan_vs_real 80 python3 bench/real_peak.py --init_from=scratch --preset=llama-3.2-1b \
  --data=gpu_data/chats.jsonl --max_len=8192 --batch_size=16 --max_iters=2 --log_interval=1 --eval_interval=0 \
  --compile=False --overwrite=True --out_dir=/tmp/r1 --microbatch_tokens=16384
step train $(( end - $(date +%s) )) python3 bench/bench_train.py --mode sft --size 1b --configs packed,hf --steps 2 \
  --warmup 1
echo "=== done"
