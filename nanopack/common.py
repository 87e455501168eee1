"""
RULES: the choices or the interval of each machinery key the start-up reads
(configurator.check_rule), shared by the training scripts. The start-up itself is nanopack/run.py
(start_run, StepGuard) and nanopack/startup.py (tokenizer, data, model, restore).
"""
from data.prepare import BAD_RECORDS, OVERLONG
from model import PRESETS

RULES = dict(
    device=("auto", "cpu", "cuda"), dtype=("auto", "bfloat16", "float32"), compile=("auto", True, False),
    parallel=("ddp", "fsdp"), preset=tuple(PRESETS), overlong=OVERLONG, loss_weighting=("token", "sequence"),
    batch_size="[1, inf)", microbatch_tokens="[1, inf)", max_len="[1, inf)", max_iters="[0, inf)", epochs="(0, inf)",
    learning_rate="(0, inf)", min_lr="[0, learning_rate]", warmup_iters="[0, inf)", weight_decay="[0, inf)",
    grad_clip="[0, inf)", lora_rank="[0, inf)", lora_dropout="[0, 1)", seed="[0, 2**32)", val_fraction="[0, 1)",
    log_interval="[1, inf)", eval_interval="[0, inf)", eval_examples="[0, inf)", max_bad_steps="[1, inf)",
    dist_timeout="[1, inf)", context_parallel="[1, inf)", bad_records=BAD_RECORDS)
