"""
The machinery keys, declared once: every training script takes them
(`configure(globals(), machinery=keys)`): a config/*.py file or --key=value sets them, and --help
lists them after the script's own keys.
The rule: a key is machinery when it says how a run executes, not what it trains, in every script.
RULES: the choices or the interval of each key the set-up reads (configurator.check_rule).
"""
from data.prepare import BAD_RECORDS, OVERLONG
from model import PRESETS

# where and how the run executes
preset = "toy"  # the model shape for init_from='scratch', from model.PRESETS
device = "auto"  # 'auto', 'cpu', 'cuda'
dtype = "auto"  # 'auto' = bfloat16 on CUDA, float32 on CPU
compile = "auto"  # True, False, or 'auto': on with CUDA, off on CPU (slower there)
activation_checkpointing = False
parallel = "ddp"  # 'ddp' or 'fsdp' (used when launched with torchrun on more than one process)
# ranks splitting each training micro-batch's tokens: a sequence up to this x microbatch_tokens
# long (RL's generation runs without)
context_parallel = 1
seed = 1337
dist_timeout = 300  # seconds a collective waits for the other ranks (a stalled rank) before failing
# LoRA (0 = full fine-tuning): adapters of rank lora_rank on the block's linear layers, the
# base frozen; exported both merged (out_dir/hf) and as a PEFT folder (out_dir/adapter).
# QLoRA: quantize_base='nf4' keeps the base in 4 bits.
lora_rank = 0
lora_alpha = None  # the adapters' output is scaled by lora_alpha / lora_rank; None = 2 x lora_rank
lora_dropout = 0.0  # on the adapters' input, while training
# Hugging Face names, comma-separated
lora_targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
quantize_base = ""  # '' or 'nf4' (pip install torchao; one process)
# how records are read
tokenizer = ""  # 'byte', or a folder with tokenizer files; default: init_from's, else 'byte'
chat_template_kwargs = {}  # variables for the chat template, e.g. {'enable_thinking': False}
data_split = None  # records: the split of a folder holding several (e.g. 'train_prefs')
val_split = None  # records: the split of a val_data folder holding several (e.g. 'test_prefs')
fields = None  # records: their field names -> ours, e.g. 'conversation:messages', comma-separated
# a record that fails to parse, render or (RL) be scored: 'error' (all counted, then stop), 'skip'
bad_records = "error"
# the run's safety and its log
max_bad_steps = 3  # a non-finite loss or gradient norm skips a step; this many in a row stop
overwrite = False  # a fresh run into an out_dir holding a run (ckpt.pt) is an error unless True
wandb_log = False
wandb_project = "nanopack"

RULES = dict(
    device=("auto", "cpu", "cuda"), dtype=("auto", "bfloat16", "float32"),
    compile=("auto", True, False), parallel=("ddp", "fsdp"), preset=tuple(PRESETS),
    overlong=OVERLONG, loss_weighting=("token", "sequence"),
    batch_size="[1, inf)", microbatch_tokens="[1, inf)", max_len="[1, inf)", max_iters="[0, inf)",
    epochs="(0, inf)", learning_rate="(0, inf)", min_lr="[0, learning_rate]",
    warmup_iters="[0, inf)", weight_decay="[0, inf)", grad_clip="[0, inf)", lora_rank="[0, inf)",
    lora_dropout="[0, 1)", seed="[0, 2**32)", val_fraction="[0, 1)", log_interval="[1, inf)",
    eval_interval="[0, inf)", eval_examples="[0, inf)", max_bad_steps="[1, inf)",
    dist_timeout="[1, inf)", context_parallel="[1, inf)", bad_records=BAD_RECORDS)
