"""
nanoGPT-style configuration: a training script keeps its config as plain globals at the top, then calls
`config = configure(globals(), kind=...)`, which applies every config/*.py file named on the command line, then every
--key=value. Only keys the script defines can be set, each with the type of its default (an int where a float is
expected; a default of None or 'auto' takes any type).

finetune: values for the keys argv does not set, when the run starts from a pretrained model (a folder with its own
tokenizer), said once: toy learning rates destroy a real model. init_from='resume': the run's saved config, with
keys given again printed as overrides; FIXED_ON_RESUME keys cannot change. Then (kind given) every value a user can
get wrong is checked before any data is tokenized or model loaded (check_config).
Every mistake is one `config error:` line naming the key (and file or argument), the value and what is accepted.
"""

import ast
import importlib.util
import math
import os
import sys
import time

import torch

import lora
from data.prepare import OVERLONG, data_files, peek_kind
from model import PRESETS
from parallel import is_master
from tokenizer import Tokenizer

FIXED_ON_RESUME = ("data", "data_split", "val_data", "preset", "tokenizer", "batch_size", "seed", "max_len", "overlong",
                   "val_fraction", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "quantize_base",
                   "chat_template_kwargs", "reasoning_turns")


class ConfigError(ValueError):
    pass


def _check(config, key, value, where):
    if key not in config:
        close = [k for k in config if k.split("_")[0] == key.split("_")[0]][:5]
        hint = f" (similar: {', '.join(close)})" if close else ""
        raise ConfigError(f"{where}: unknown config key {key!r}{hint}; the keys are the globals at the top of the "
                          f"script")
    default = config[key]
    if default in (None, "auto"):
        return value  # None and 'auto' defaults take values of other types too; the script checks them
    same_kind = isinstance(value, bool) == isinstance(default, bool)  # True is an int to Python, not a batch size
    if same_kind and isinstance(value, type(default)):
        return value
    if same_kind and isinstance(default, float) and isinstance(value, int):
        return float(value)
    raise ConfigError(f"{where}: {key}={value!r} is of type {type(value).__name__}, "
                      f"but {key} must be of type {type(default).__name__} (default {default!r})")


def _parse(text):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word is a string: --init_from=resume


def configure(config, argv=None, finetune=None, kind=None, choices=None):
    """Update the dict `config` (a script's globals()) in place from argv, and from the saved config of the run
    being resumed; returns the plain config values, checked when kind ('sft', 'dpo') is given, with the script's
    own {key: allowed values} in choices. A mistake ends the program with its one-line message."""
    given = set()  # keys set by argv: a config file or --key=value
    try:
        values = apply_overrides(config, sys.argv[1:] if argv is None else argv, given)
        if values.get("init_from") == "resume":
            values = restore_saved(config, values, given)
        elif finetune and pretrained(values.get("init_from", "")):
            chosen = {k: v for k, v in finetune.items() if k not in given}
            for key, value in chosen.items():
                values[key] = config[key] = value
            if chosen and is_master():
                print(f"fine-tuning a pretrained model: {', '.join(f'{k}={v}' for k, v in chosen.items())} "
                      f"(defaults for real models; set them to change)", flush=True)
        if kind is not None:
            check_config(values, kind, choices or {})
        unused = sorted(given & {"lora_alpha", "lora_dropout", "lora_targets"}) if not values.get("lora_rank") else []
        if unused:  # a LoRA setting without adapters would be silently ignored
            raise ConfigError(f"{unused[0]}={values[unused[0]]!r} is set but lora_rank=0 (full fine-tuning, no "
                              f"adapters); set lora_rank (e.g. 8) to train adapters, or drop {unused[0]}")
    except ConfigError as e:
        one_line(f"config error: {e}")
    except SystemExit as e:
        one_line(e.code)
    return values


def one_line(message):
    """Exit with the message printed once: by rank 0, while the other ranks wait for torchrun to stop them (were they
    to exit first, torchrun could stop rank 0 before it prints)."""
    if not is_master():
        time.sleep(30)
    raise SystemExit(message) from None


def check_config(c, kind, choices):
    """Every value a user can get wrong, checked before any data is tokenized or model loaded: one
    `config error:` line each, naming the key, the value and what is accepted."""
    def bad(key, accepted):
        raise SystemExit(f"config error: {key}={c[key]!r}; {accepted}")

    choices = dict(device=("auto", "cpu", "cuda"), dtype=("auto", "bfloat16", "float32"), compile=("auto", True, False),
                   parallel=("ddp", "fsdp"), overlong=OVERLONG, loss_weighting=("token", "sequence"), **choices)
    for key, allowed in choices.items():
        if key in c and c[key] not in allowed:
            why = "; float16 needs loss scaling that nanopack does not do: bfloat16 has float32's range" * (
                c[key] in ("float16", "fp16", "half"))
            bad(key, f"choose one of {', '.join(allowed)}{why}")
    at_least = dict(lora_rank=0, batch_size=1, microbatch_tokens=1, log_interval=1, max_len=1, max_bad_steps=1,
                    dist_timeout=1, max_iters=0, eval_interval=0, eval_examples=0, warmup_iters=0, weight_decay=0.0,
                    grad_clip=0.0, min_lr=0.0, label_smoothing=0.0, sft_weight=0.0, k=2, prompts_per_step=1,
                    max_new_tokens=1, updates_per_batch=1, kl_coef=0.0)
    for key, low in at_least.items():
        if key in c and c[key] < low:
            bad(key, f"it must be at least {low}")
    for key in ("learning_rate", "epochs", "beta", "temperature", "clip_eps"):
        if key in c and not 0 < c[key] < math.inf:
            bad(key, "it must be a finite number greater than 0")
    if c["min_lr"] > c["learning_rate"]:
        bad("min_lr", f"it must not exceed learning_rate={c['learning_rate']} (the schedule decays to it)")
    if kind == "rl" and (c["max_iters"] < 1 or not 0 < c["top_p"] <= 1):
        bad(*("max_iters", "it must be at least 1") if c["max_iters"] < 1 else ("top_p", "it must be in (0, 1]"))
    for key, high in (("seed", 2**32), ("val_fraction", 1.0), ("lora_dropout", 1.0)):
        if key in c and not 0 <= c[key] < high:
            bad(key, f"it must be in [0, {'2**32' if key == 'seed' else 1})")
    if kind == "dpo" and (c["label_smoothing"] >= 0.5 or (c["label_smoothing"] and c["loss_type"] in ("ipo", "hinge"))):
        bad("label_smoothing", "it must be below 0.5, and 0 for ipo and hinge")
    check_lora(c, bad)
    if c["device"] == "cuda" and not torch.cuda.is_available():
        bad("device", "this machine has no CUDA GPU (torch.cuda.is_available() is False); use 'auto' or 'cpu'")
    if c["init_from"] == "scratch" and c["preset"] not in PRESETS:
        bad("preset", f"choose one of {', '.join(PRESETS)}")
    if c["init_from"] not in ("scratch", "resume") and not os.path.isfile(os.path.join(c["init_from"], "config.json")):
        hint = {"dpo": "; DPO starts from a fine-tuned model: make the default one with `python train_sft.py`",
                "rl": "; RL starts from a fine-tuned model: make the default one with `python train_sft.py && "
                      "python train_dpo.py`"}.get(kind, "")
        bad("init_from", f"it is neither 'scratch', 'resume' nor a Hugging Face model folder (with a config.json)"
                         f"{hint}")
    if c["tokenizer"] not in ("", "byte") and not Tokenizer.has_files(c["tokenizer"]):
        bad("tokenizer", "use 'byte' or a folder with tokenizer.json or tokenizer.model")
    records = c["data"] != "builtin" and not os.path.isfile(os.path.join(c["data"], "meta.json"))
    if records and kind != "rl" and c["init_from"] != "resume":  # rl: train_rl.py reads its prompts itself
        try:  # records (JSONL, Parquet, a folder of shards, a glob): the first one says SFT or DPO, nothing tokenized
            found, where = peek_kind(c["data"], c["data_split"])
            c["val_data"] and data_files(c["val_data"])
        except (ValueError, OSError) as e:
            raise SystemExit(f"data error: {e}") from None
        if found != kind:
            need = "chosen/rejected pairs" if kind == "dpo" else "messages"
            raise SystemExit(f"data error: {where} is {found.upper()} data but train_{kind}.py trains {kind.upper()} "
                             f"({need}); use train_{found}.py for it")
    elif not records and kind != "rl" and (c["data_split"] or c["val_data"]):
        bad("data_split" if c["data_split"] else "val_data", "it picks raw records; this data is 'builtin' or "
            "already prepared")
    try:  # can we write where the run will live? Better now than after an hour of training
        os.makedirs(c["out_dir"], exist_ok=True)
        with open(os.path.join(c["out_dir"], f".write_test_{os.getpid()}"), "w") as f:
            f.write("ok")
        os.remove(f.name)
    except OSError as e:
        bad("out_dir", f"cannot write there ({e.strerror}); choose a writable folder")
    if c["init_from"] != "resume" and not c["overwrite"] and os.path.exists(os.path.join(c["out_dir"], "ckpt.pt")):
        raise SystemExit(f"config error: {c['out_dir']} already holds a run (ckpt.pt); continue it with "
                         f"--init_from=resume, or start over there with --overwrite=True, or choose another out_dir")


def check_lora(c, bad):
    """LoRA / QLoRA keys (lora_rank 0: full fine-tuning, the other keys unused)."""
    alpha = c["lora_alpha"]
    number = isinstance(alpha, (int, float)) and not isinstance(alpha, bool)
    if alpha is not None and not (number and 0 < alpha < math.inf):
        bad("lora_alpha", "it must be a number greater than 0 (None: 2 x lora_rank)")
    unknown = [t for t in c["lora_targets"].split(",") if t not in lora.TARGETS]
    if unknown or not c["lora_targets"]:
        bad("lora_targets", f"no layer is called {', '.join(map(repr, unknown))}; a block's linear layers are "
                            f"{','.join(lora.TARGETS)} (comma-separated, no spaces)")
    if c["quantize_base"] not in ("", "nf4"):
        bad("quantize_base", "choose '' (the base in dtype) or 'nf4' (QLoRA)")
    if c["quantize_base"] and not c["lora_rank"]:
        bad("quantize_base", "a 4-bit base cannot be trained: it needs adapters, set lora_rank (e.g. 16)")
    if c["quantize_base"] and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        bad("quantize_base", "QLoRA runs in one process (a model that fits one GPU); use LoRA without it on several")
    if c["quantize_base"] and importlib.util.find_spec("torchao") is None:
        bad("quantize_base", "'nf4' needs torchao: pip install torchao")
    if c.get("reference") == "adapters_off" and not c["lora_rank"]:
        bad("reference", "'adapters_off' is the base model under the adapters: it needs lora_rank > 0")


def pretrained(init_from):
    """A model folder with its own tokenizer files: a real checkpoint, not an export of our byte-level toy runs."""
    return any(os.path.exists(os.path.join(init_from, f)) for f in ("tokenizer.json", "tokenizer.model"))


def restore_saved(config, values, given):
    path = os.path.join(values["out_dir"], "ckpt.pt")
    if not os.path.exists(path):
        raise ConfigError(f"init_from='resume' but {path} does not exist; run without init_from='resume' first, "
                          f"or point out_dir at the run to continue")
    saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["config"]  # mmap: reads only this
    for key, old in saved.items():
        if key not in values or key in ("init_from", "out_dir"):  # where the run is now, and that it resumes
            continue
        new = values[key]
        if key not in given or new == old:
            values[key] = config[key] = old
        elif key in FIXED_ON_RESUME:
            raise ConfigError(f"{key}={new!r} differs from the run being resumed ({key}={old!r}), and {key} cannot "
                              f"change on resume; drop --{key}, or start a new run in another out_dir")
        elif is_master():
            print(f"resume: overriding {key} {old!r} -> {new!r}", flush=True)
    return values


def apply_overrides(config, argv, given=None):
    given = set() if given is None else given
    keys = {k: v for k, v in config.items()
            if not k.startswith("_") and isinstance(v, (int, float, bool, str, dict, type(None)))}
    for arg in argv:
        if arg.startswith("--"):
            if "=" not in arg:
                raise ConfigError(f"argument {arg!r}: write --key=value")
            key, text = arg[2:].split("=", 1)
            value = _check(keys, key, _parse(text), f"argument {arg!r}")
            keys[key] = config[key] = value
            given.add(key)
        else:  # a config file: plain Python assignments
            try:
                with open(arg) as f:
                    source = f.read()
            except OSError as e:
                raise ConfigError(f"config file {arg!r} cannot be read: {e.strerror}") from None
            scope = {}
            exec(compile(source, arg, "exec"), {}, scope)
            for key, value in scope.items():
                if key.startswith("_") or callable(value) or type(value).__name__ == "module":
                    continue
                value = _check(keys, key, value, f"config file {arg}")
                keys[key] = config[key] = value
                given.add(key)
    return keys
