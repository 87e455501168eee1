"""
A training script's start-up after start_run, one call each, in order: load_tokenizer;
initial_weights (what the run starts from and the model's shape); load_splits (the token data,
tokenized once, its lengths checked); load_model (scratch | HF folder | resume; LoRA; DDP/FSDP2;
compile); param_groups for the script's AdamW; restore on resume. A resumed run takes its tokenizer,
data and initial weights from its checkpoint.
"""
import os

import torch

from data.dataset import check_fits, ignored_keys_note, load_data, prepare_data, turn_examples_note
from model import ModelConfig, Transformer, config_from_preset
from nanopack import lora
from nanopack.checkpoint import all_finite, restore_checkpoint
from nanopack.hf import fingerprint, from_pretrained, load_hf_weights, read_hf_config
from nanopack.parallel import print0, wrap_model
from nanopack.tokenizer import Tokenizer, get_tokenizer


def load_tokenizer(config, resumed=None):
    """The resumed run's tokenizer; else the one asked for; else init_from's; else the byte-level
    one."""
    if resumed:
        return choose_tokenizer(resumed["tokenizer"], "resume", config.get("chat_template_kwargs"))
    return choose_tokenizer(config["tokenizer"], config["init_from"],
                            config.get("chat_template_kwargs"))


def choose_tokenizer(tokenizer, init_from, chat_template_kwargs=None):
    """The tokenizer asked for; else init_from's; else the byte-level one (a folder without
    tokenizer files is ours)."""
    hf_folder = init_from not in ("scratch", "resume")
    own = init_from if hf_folder and Tokenizer.has_files(init_from) else "byte"
    try:
        return get_tokenizer(tokenizer or own, chat_template_kwargs=chat_template_kwargs)
    except (ValueError, OSError) as e:
        # an unsupported tokenizer or template: the file and the key, one line
        raise SystemExit(f"tokenizer error: {e}") from None


def initial_weights(config, tok, resumed=None):
    """-> (start: what the initial weights are, dict(init_from, preset, weights=fingerprint), their
    ModelConfig), without loading them. A resumed run's are its checkpoint's."""
    if not resumed:
        start = dict(init_from=config["init_from"], preset=config["preset"],
                     weights=base_weights(config["init_from"]))
        return start, initial_config(start, tok)
    start = resumed["start"]
    if config["lora_rank"] and start.get("weights") != base_weights(start["init_from"]):
        path = os.path.join(config["out_dir"], "ckpt.pt")
        if "weights" not in start:
            raise SystemExit(f"{path} is from an older nanopack, which did not record its base's "
                             f"weights: finish the run with that version, or start it again")
        raise SystemExit(f"{start['init_from']} is not the base model this LoRA run started from "
                         f"(its weights changed); its checkpoint holds only the adapters: restore "
                         f"that folder to resume")
    return start, ModelConfig(**resumed["model_config"])


def base_weights(init_from):
    """The fingerprint of the model folder a run starts from (None for a preset: its seed is in the
    config)."""
    try:
        return None if init_from == "scratch" else fingerprint(init_from)
    except (ValueError, OSError) as e:
        raise SystemExit(f"model error: {e}") from None


def initial_config(start, tok):
    """The ModelConfig of the weights a run starts from, without loading them."""
    if start["init_from"] == "scratch":
        return config_from_preset(start["preset"], vocab_size=tok.vocab_size)
    try:
        return read_hf_config(start["init_from"])
    except (ValueError, OSError) as e:
        raise SystemExit(f"model error: {e}") from None


def load_splits(config, run, tok, model_config, data_kind, group_size=1, builtin_sizes=None):
    """-> (the folder of token files, train, val): records or the built-in task tokenized once into
    out_dir/data (a resumed run's own), every sequence checked against the model and the
    micro-batch. group_size: the sequences a unit holds (DPO's pairs: 2)."""
    c = config
    if run.resumed:
        # relative: the run's data
        saved_dir = run.resumed["data_dir"]
        data_dir = saved_dir and os.path.join(c["out_dir"], saved_dir)
    else:
        data_dir = prepare_data(c, c["out_dir"], tok, data_kind, model_config.max_seq_len,
                                builtin_sizes)
    train, val = load_data(data_dir, tok)
    check_fits(model_config, tok, data_dir, dict(train=train, val=val), c["microbatch_tokens"],
               group_size, c.get("prefix_sharing", False), run.cp.size)
    return data_dir, train, val


def data_summary(config, loader, train, data_dir, max_seq_len, units="examples"):
    """Notes on the data as the loader serves it -> the summary line's data part."""
    c = config
    n = len(loader.lengths)
    described = f"{n} train {units}" if "units" not in train else \
        f"{n} train conversations ({int(loader.sizes.sum())} turn examples)"
    for note in (turn_examples_note(data_dir, train, c.get("reasoning_turns", "conversation")),
                 ignored_keys_note(c, data_dir, max_seq_len)):
        if note:
            print0(note)
    if c["batch_size"] > n:
        print0(f"note: batch_size={c['batch_size']} is more than the {described}: each step "
               f"takes all of them")
    return f" | data: {data_dir}, {described}, {len(loader)} steps/epoch"


def lora_settings(config):
    """The adapters a run trains (rank, alpha, dropout, targets, quantize); None: full
    fine-tuning."""
    c = config
    if not c["lora_rank"]:
        return None
    return dict(rank=c["lora_rank"], alpha=c["lora_alpha"] or 2 * c["lora_rank"],
                dropout=c["lora_dropout"], targets=c["lora_targets"].split(","),
                quantize=c["quantize_base"])


def load_model(config, run, model_config, start):
    """-> (the model to call: wrapped for DDP / FSDP2, the network itself) with the initial weights
    of `start`; a resumed run's trained weights are left for restore."""
    c = config
    compiled = c["compile"] is True or (c["compile"] == "auto" and run.device.type == "cuda")
    if c["compile"] == "auto" and not compiled:
        print0("compile='auto': off on CPU, where compiling costs seconds at every start for a "
               "gain within noise (bench/RESULTS.md); --compile=True to use it anyway")
    return build_model(model_config, start, c["seed"], run.device, c["parallel"], run.world_size,
                       run.ptdtype, compiled, c["activation_checkpointing"],
                       from_checkpoint=run.resumed is not None, adapters=lora_settings(c))


def build_model(model_config, start, seed, device, parallel, world_size, param_dtype, compile=False,
                activation_checkpointing=False, from_checkpoint=False, adapters=None):
    """-> (the model to call: wrapped for DDP / FSDP2, the network itself) with the initial weights
    of `start`; from_checkpoint: left for restore_checkpoint. Files are read after building on the
    meta device and sharding, so no rank ever holds the whole model. A LoRA checkpoint holds only
    the adapters: the base is read from `start`."""
    sharded = parallel == "fsdp" and world_size > 1
    from_checkpoint = from_checkpoint and not adapters
    from_files = from_checkpoint or (start["init_from"] != "scratch" and sharded)
    try:
        raw_model = new_network(model_config, start, seed, from_files)
        if adapters:
            add_adapters(raw_model, adapters, param_dtype, sharded)
        # DDP broadcasts rank 0's weights when it wraps: they must exist by then
        if not (from_files and sharded):
            raw_model.to_empty(device=device) if from_files else raw_model.to(device)
        raw_model.activation_checkpointing = activation_checkpointing
        if compile:
            # per block, with the token count dynamic: micro-batches run at their real length
            for block in raw_model.layers:
                block.compile(dynamic=True)
        model = wrap_model(raw_model, parallel, world_size, param_dtype)
        if from_files and sharded:
            raw_model.to_empty(device=device)
        if adapters and from_files:
            lora.init_adapters(raw_model)
        if from_files and not from_checkpoint:
            base = lora.base_parameters(raw_model) if adapters else None
            load_hf_weights(raw_model, start["init_from"], base)
            refuse_non_finite(raw_model, start)
    except (ValueError, OSError, KeyError) as e:
        # a model folder we cannot read: what and where, in one line
        raise SystemExit(f"model error: {e}") from None
    return model, raw_model


def new_network(model_config, start, seed, from_files):
    """The Transformer: on the meta device when its weights come from files after sharding; else
    from the preset's seed or the HF folder."""
    if from_files:
        with torch.device("meta"):
            return Transformer(model_config)
    if start["init_from"] == "scratch":
        # the same weights on every rank, and again when a live reference is rebuilt
        torch.manual_seed(seed)
        raw_model = Transformer(model_config)
    else:
        raw_model = from_pretrained(start["init_from"], dtype=torch.float32)
    refuse_non_finite(raw_model, start)
    return raw_model


def add_adapters(raw_model, adapters, param_dtype, sharded):
    lora.add_adapters(raw_model, adapters["rank"], adapters["alpha"], adapters["dropout"],
                      adapters["targets"])
    if adapters["quantize"]:
        lora.quantize_base(raw_model)
    # FSDP2 casts through its mixed-precision policy
    if param_dtype != torch.float32 and not sharded:
        lora.cast_base(raw_model, param_dtype)


def refuse_non_finite(model, start):
    if not all_finite(model, frozen_too=True):
        raise SystemExit(f"model error: {start['init_from']} holds NaN or infinite weights; "
                         f"nothing to train from")


def param_groups(model, weight_decay):
    """The parameters that train, for AdamW: matrices decay, norms' gains and biases do not."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [dict(params=decay, weight_decay=weight_decay), dict(params=no_decay, weight_decay=0.0)]


def restore(run, model, optimizer, loader=None):
    """A resumed run's weights, optimizer state, RNG and loader position -> (the iteration it is at,
    the script's own state saved with it: {} for a fresh run)."""
    if not run.resumed:
        return 0, {}
    restore_checkpoint(run.resumed, run.out_dir, model, optimizer)
    if loader is not None:
        loader.load_state_dict(run.resumed["loader"])
    return run.resumed["iter_num"], run.resumed["extra"]
