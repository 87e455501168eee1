#!/bin/bash
# v2: what a GPU user runs, measured in the minutes a GPU is lent, most valuable first, each command under a limit.
#   1 env     versions, the GPU, missing packages and what they leave out, NF4 on the GPU; the CUDA tests (RoPE fix too)
#   2 sft     `python train_sft.py`, the README's main job as a user runs it (compile='auto'): time, accuracy
#   3 compile a 1B SFT step compiled vs eager: graphs, recompiles (and why), compile s, tokens/s, MFU, peak
#   4 dpo     DPO at the 1B shape, the same pairs: packed + prefix sharing vs transformers padded vs TRL's DPOTrainer;
#             then train_dpo.py on step 2's model, reference cached and live
#   5 rl      generation at the 1B shape: the engine eager vs CUDA graphs vs before vs transformers (bench_generate.py);
#             train_rl.py at the 1B shape (eager): generation tokens/s and a step; then on step 4's model, compiled
#   6 lora    full vs LoRA vs QLoRA at the 1B shape (bench_lora.py); a QLoRA train_sft.py run, compiled
# Logs in $OUT (7 files): session.log (each command's exit code and time, the figures, what did not run), one per step.
# On the GPU, through the device tool, after `bash bench/gpu_wheels.sh` here (trl, datasets, torchao travel as wheels),
# in two calls: the limits add up to ~860 s (2026-11-28, H200: cold imports, compiles and a 1B checkpoint took 2-3x
# the limits first set), more than one call's 600 s; the second session's calls took 394 s and 237 s:
#   run(command="STEPS='1 2 3 4' bash bench/gpu_session.sh 480", carry=[".whl"], timeout_s=510)
#   run(command="STEPS='5 6' bash bench/gpu_session.sh 330", carry=[".whl"], timeout_s=350)  # steps 4-6 read /tmp runs
# (a fresh machine for the second call has no step 2/4 models: their runs start from scratch, as init() says)
# Without CUDA the same commands run at toy sizes: the rehearsal (tests/test_bench.py runs it; a few minutes):
#   OUT=/tmp/rehearsal bash bench/gpu_session.sh
# The exit status is 0 when every command ran and returned 0.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1  # nothing to fetch
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
O=${OUT:-/tmp/gpu_out}
R=${RUNS:-/tmp/gpu_session_runs}  # the runs' out_dirs (checkpoints: kept out of $OUT, whose files all come back)
STEPS=${STEPS:-1 2 3 4 5 6}
mkdir -p "$O" "$R"
LOG=$O/session.log
rm -f "$LOG" "$O"/[1-6]_*.log  # an earlier session's logs in the same folder
t_begin=$(date +%s)
CUDA=$($PY -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
if [ "$CUDA" = 1 ]; then
  budget=${1:-570} slack=1 SIZE=1b SHAPE=llama-3.2-1b TOKENS=8192
  SFT=() SHORT=(--max_iters=4)  # step 2 as the README runs it; the other script runs: a few steps each
  GEN=(--device cuda --preset llama-3.2-1b --rounds 2 --skip compiled)  # step 5's generation table, bf16
  wheels="none in .whl/"
  if ls .whl/*.whl >/dev/null 2>&1; then  # what the machine lacks (bench/gpu_wheels.sh)
    if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl >> "$LOG" 2>&1; then
      export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}; wheels="$(ls .whl/*.whl | wc -l) installed from .whl/"
    else
      wheels="install FAILED (pip's message above)"
    fi
  fi
else  # the rehearsal: toy sizes, limits x3 for a shared CPU, one thread (two spin ~10x slower under load)
  budget=${1:-600} slack=3 SIZE=tiny SHAPE=toy TOKENS=256
  SFT=(--max_iters=30 --eval_examples=20) SHORT=(--max_iters=2 --eval_examples=10)
  GEN=(--preset tiny --new_tokens 8 --k 2 --group_prompts 2 --rounds 1 --skip compiled,transformers)
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  wheels="none without CUDA: this machine's own packages"
fi
for s in $STEPS; do  # a typo would otherwise run nothing and say nothing of it
  [[ $s =~ ^[1-6]$ ]] || { echo "gpu_session.sh: STEPS='$STEPS': the steps are 1 to 6, e.g. STEPS='5 6'"; exit 2; }
done
[[ $budget =~ ^[0-9]+$ ]] || { echo "gpu_session.sh: budget '$budget': the seconds it may take, e.g. 570"; exit 2; }
end=$(( t_begin + budget ))
failed=() cut=() skipped=()
say() { echo "$*" | tee -a "$LOG"; }
say "=== gpu_session.sh v2 | $(date -u +%FT%TZ) | CUDA $CUDA | budget ${budget}s | steps $STEPS | runs in $R | load" \
    "$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null) | commit $(git rev-parse --short HEAD 2>/dev/null || echo '?') |" \
    "wheels: $wheels"

run() {  # run STEP LIMIT cmd...: cmd's output appended to $O/STEP.log, under LIMIT (x slack) or what is left
  local step=$1 limit=$(( $2 * slack )) t0=$(date +%s); shift 2
  local left=$(( end - t0 ))
  if [ "$left" -lt 15 ]; then
    say "=== $step NOT RUN, ${left}s of the budget left: $*"; skipped+=("$step: $*"); return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $step: $* (limit ${limit}s)" | tee -a "$O/$step.log" >> "$LOG"
  timeout -k 10 "$limit" "$@" >> "$O/$step.log" 2>&1
  local rc=$? took=$(( $(date +%s) - t0 ))
  if [ $rc = 124 ] || [ $rc = 137 ]; then
    say "=== $step rc=$rc in ${took}s: CUT at its limit, unfinished"; cut+=("$step: $*")
  else
    say "=== $step rc=$rc in ${took}s"; [ $rc = 0 ] || failed+=("$step: $*")
  fi
}
figures() {  # figures STEP REGEX: the lines of the step's log that hold its figures, into session.log
  grep -E "$2" "$O/$1.log" 2>/dev/null | tee -a "$LOG"
}
lim() { echo $(( $1 * slack )); }  # a limit passed to a script (bench_train's per-row --timeout)
init() { [ -d "$1" ] && echo "$1" || echo scratch; }  # a model an earlier step made, or scratch if it did not

step1() {
  run 1_env 40 $PY bench/gpu_env.py
  local xdist=(); [ "$CUDA" = 1 ] && $PY -c "import xdist" 2>/dev/null && xdist=(-n 4)
  run 1_env 90 $PY -m pytest -p no:cacheprovider -q -rfEs "${xdist[@]}" tests/test_cuda_paths.py \
    tests/test_rope.py::test_fused_matches_reference_cuda \
    tests/test_rope.py::test_fused_rope_only_where_the_kernel_runs \
    tests/test_model.py::test_packed_equals_each_sequence_alone_cuda
  figures 1_env "^python|^GPU|^nvidia|^attention|^torch varlen|MISSING|NF4|no CUDA|passed|failed|SKIPPED|^FAILED"
}
step2() {
  run 2_sft 90 env TORCH_LOGS=recompiles $PY train_sft.py --out_dir="$R/sft" --overwrite=True "${SFT[@]}"
  figures 2_sft "^model:|^compile|val accuracy|^done|Error|error:"
  grep -E "^iter [0-9]+/" "$O/2_sft.log" 2>/dev/null | sed -n '1,2p;$p' | tee -a "$LOG"  # the first steps compile
}
step3() {
  run 3_compile 90 $PY bench/bench_train.py --mode sft --size $SIZE --configs packed,packed+compile --steps 3 \
    --warmup 2 --timeout "$(lim 60)"
  figures 3_compile "^SFT|^matmul|^  |^\||^recompiled"
}
step4() {
  run 4_dpo 170 $PY bench/bench_train.py --mode dpo --data ultrafeedback --size $SIZE --configs packed+shared,hf,trl \
    --steps 2 --warmup 1 --batch_size 32 --timeout "$(lim 55)"
  figures 4_dpo "^DPO|^matmul|^  |^\||^recompiled"
  for ref in cached live; do
    run 4_dpo 40 env TORCH_LOGS=recompiles $PY train_dpo.py --init_from="$(init "$R/sft/hf")" --out_dir="$R/dpo_$ref" \
      --reference=$ref --overwrite=True --eval_interval=0 "${SHORT[@]}"
  done
  figures 4_dpo "^reference|^iter [0-9]+/|val |^done|Error|error:"
}
rl_speed() {  # rl_speed OUT_DIR K: generation tokens/s of each step train_rl.py logged, every sampling round
  $PY - "$1" "$2" <<'EOF' 2>&1 | tee -a "$LOG"
import json, os, sys
path, k = sys.argv[1] + "/metrics.jsonl", int(sys.argv[2])
for m in map(json.loads, open(path)) if os.path.exists(path) else print(f"rl: no {path}: no step was logged") or []:
    if "gen_ms" in m:
        n = m["groups_sampled"] * k * m["reply_tokens"]  # dynamic sampling: rounds x prompts x k
        print(f"rl {path} iter {m['iter']}: generation {n:,.0f} tokens in {m['gen_ms']:,.0f} ms = "
              f"{n / m['gen_ms'] * 1e3:,.0f} tok/s; train {m['train_ms']:,.0f} ms")
EOF
}
step5() {  # generation alone first: the engine eager and as CUDA graphs, the generator before it, transformers
  run 5_rl 60 $PY bench/bench_generate.py --batches "" "${GEN[@]}"
  # 32 prompts x 8 replies of up to 20 tokens a step (the defaults); random 1B weights never stop early, and
  # all score 0: kl_coef > 0 trains every group anyway (with none, a group whose rewards are all equal is left out)
  run 5_rl 130 $PY train_rl.py --init_from=scratch --preset=$SHAPE --out_dir="$R/rl_$SHAPE" --overwrite=True \
    --max_iters=2 --eval_examples=0 --compile=False --kl_coef=0.01
  rl_speed "$R/rl_$SHAPE" 8
  run 5_rl 45 env TORCH_LOGS=recompiles $PY train_rl.py --init_from="$(init "$R/dpo_cached/hf")" --out_dir="$R/rl" \
    --overwrite=True "${SHORT[@]}"
  rl_speed "$R/rl" 8
  figures 5_rl "^[0-9]+ prompts|^\| engine|^\| before|^\| transformers|^model:|^RL:|^iter [0-9]+/|held-out|Error|error:"
}
step6() {
  run 6_lora 45 $PY bench/bench_lora.py --shapes $SHAPE --tokens $TOKENS --steps 2
  run 6_lora 90 env TORCH_LOGS=recompiles $PY train_sft.py --init_from="$(init "$R/sft/hf")" --out_dir="$R/qlora" \
    --overwrite=True --lora_rank=16 --quantize_base=nf4 --eval_interval=0 "${SHORT[@]}"
  figures 6_lora "^[0-9]+ tokens|^\||^model:|^iter [0-9]+/|val |^done|Error|error:"
}

for s in $STEPS; do "step$s"; done
say "=== done in $(( $(date +%s) - t_begin ))s (budget ${budget}s): ${#failed[@]} failed, ${#cut[@]} cut at their" \
    "limit, ${#skipped[@]} not run"
for x in "${failed[@]}"; do say "FAILED: $x"; done
for x in "${cut[@]}"; do say "CUT, unfinished: $x"; done
for x in "${skipped[@]}"; do say "NOT RUN (out of time): $x"; done
[ $(( ${#failed[@]} + ${#cut[@]} + ${#skipped[@]} )) = 0 ]
