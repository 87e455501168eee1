"""
One way to build a training run, so that each train_*.py holds only its own loop: setup() returns
a Run (the rules of the keys it reads: nanopack/keys.py); StepGuard skips non-finite updates and
has the ranks agree on a stop (parallel.StopSignal), which the scripts turn into a checkpoint.
"""
import glob
import math
import os
import re
import shutil
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanopack.checkpoint import (EXPORT_NEW, EXPORT_OLD, EXPORT_TMP, all_finite, finish_export, load_checkpoint,
                        restore_checkpoint)
from nanopack import context
from data.dataset import check_fits, check_kind, ignored_keys_note, load_data, prepare_data, turn_examples_note
from nanopack import lora
from nanopack.hf import fingerprint, from_pretrained, load_hf_weights, read_hf_config
from nanopack import hub
from model import ModelConfig, Transformer, attention_backend, config_from_preset
from packing import PackedLoader
from nanopack.parallel import (fail, lock_out_dir, precision, print0, setup_distributed, stop_signal,
                               teardown_distributed, wrap_model)
from nanopack.tokenizer import Tokenizer, get_tokenizer


@dataclass
class Run:
    """Everything a training script needs before its loop, built the same way for SFT, DPO and RL by setup()."""
    config: dict
    rank: int
    world_size: int
    device: torch.device
    dtype: str                 # 'bfloat16' | 'float32'
    autocast: object           # context manager for forward passes
    tok: Tokenizer
    data_dir: str
    train_data: dict
    val_data: dict
    start: dict                # what the initial weights are: dict(init_from=..., preset=..., weights=fingerprint)
    model: torch.nn.Module     # wrapped for DDP / FSDP2 when world_size > 1: call this one
    raw_model: Transformer     # the network itself: num_params, flops_per_token, generation
    optimizer: torch.optim.Optimizer
    loader: PackedLoader
    start_iter: int            # optimizer steps already taken (the checkpoint's, on resume)
    max_iters: int
    out_dir: str
    ckpt_path: str
    saved: dict                # the script's own extras from the checkpoint being resumed ({} otherwise)
    guard: "StepGuard"
    saved_iter: int = None     # the iteration ckpt.pt holds (None: none yet); save_checkpoint moves it
    adapters: dict = None      # LoRA settings (rank, alpha, dropout, targets, quantize); None: full fine-tuning
    cp: context.ContextParallel = None  # this rank's CP group (size 1: none) and data-parallel rank / size
    kind: str = None           # 'sft', 'dpo' or 'rl': the checkpoint records train_<kind>.py

    @property
    def master(self):
        return self.rank == 0

    def exit_stopped(self, iter_num):
        """Exit 128 + the signal (143 SIGTERM, 130 Ctrl-C) as a killed process would, which a scheduler reads as
        "stopped", once this iteration is saved; a stop that was not saved, or for a failure (a full disk): exit 1."""
        stop, resume = self.guard.stop, f"--init_from=resume --out_dir={self.out_dir}"
        why = stop.name or f"a {'failure' if self.guard.failed else 'signal'} on another rank"
        if self.saved_iter != iter_num:
            held = f"holds iter {self.saved_iter}" if self.saved_iter is not None else "was never written"
            print0(f"stopped after iter {iter_num} ({why}) without saving it: {self.ckpt_path} {held}; the iterations "
                   f"since are lost")
            teardown_distributed(1)
        if self.guard.failed:
            print0(f"stopped after iter {iter_num} by a failure: {why}; checkpoint {self.ckpt_path}; once that is "
                   f"fixed, continue with {resume}")
            teardown_distributed(1)
        took = f", {time.monotonic() - stop.at:.0f} s after the signal" if stop.at else ""  # the grace a stop needs
        print0(f"stopped by {why} after iter {iter_num}{took}: checkpoint {self.ckpt_path}; continue with {resume}")
        teardown_distributed(128 + (stop.signal or signal.SIGTERM))


class StepGuard:
    """One all-reduce per step: a non-finite loss or gradient norm on any rank skips the update (max_bad_steps in a row
    stop the run), and the ranks agree on a stop. A step that trained nothing neither counts nor breaks a run. The
    counts are the run's: saved with each checkpoint (counts()), a resumed run goes on from them."""

    def __init__(self, max_bad_steps, ckpt_path, model, counts=None, stop=stop_signal):
        self.max_bad_steps, self.ckpt_path, self.model, self.stop = max_bad_steps, ckpt_path, model, stop
        counts = counts or {}  # a checkpoint of an older nanopack has none
        self.skipped_steps, self.bad_in_a_row = counts.get("skipped_steps", 0), counts.get("bad_in_a_row", 0)
        self.failed = False  # the stop the ranks agreed on is a failure on one of them (stop.request), not a signal

    def counts(self):
        return dict(skipped_steps=self.skipped_steps, bad_in_a_row=self.bad_in_a_row)

    def check(self, loss, grad_norm, iter_num):
        """-> (whether to update, whether to stop after this step)."""
        trained = any(p.grad is not None for p in self.model.parameters() if p.requires_grad)
        bad = ~torch.isfinite(loss.float()) | ~torch.isfinite(grad_norm.to(loss.device))  # no gradients: on the CPU
        stop = 0 if self.stop.name is None else 1 if self.stop.signal else 2  # 2: a failure, which wins
        flags = torch.cat([bad.view(1), torch.tensor([stop, trained], device=loss.device)]).float()
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad, stop, trained = flags.tolist()
        self.failed = stop == 2
        if trained:
            self.bad_in_a_row = self.bad_in_a_row + 1 if bad else 0
        self.skipped_steps += int(bad)
        if bad:
            print0(f"iter {iter_num}: the loss or gradient norm is NaN or infinite: update skipped, weights "
                   f"unchanged ({self.bad_in_a_row} in a row, at most max_bad_steps={self.max_bad_steps})")
        if self.bad_in_a_row >= self.max_bad_steps:
            raise SystemExit(f"stopping: {self.bad_in_a_row} steps in a row had a non-finite loss or gradient norm. "
                             f"The last checkpoint ({self.ckpt_path}, if one was written) holds finite weights. "
                             f"Lower learning_rate or check the data, then resume or start again.")
        return not bad, bool(stop)


def clip_grad_norm(model, max_norm):
    """Clip the trained parameters' gradients to max_norm (0: no clipping) -> their norm before clipping."""
    params = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor


def check_run(c, kind):
    """What keys.RULES cannot say, before any data is tokenized or model loaded: one
    `config error:` line each."""
    if c["device"] == "cuda" and not torch.cuda.is_available():
        fail("config error: device='cuda'; this machine has no CUDA GPU (torch.cuda.is_available() is False); use "
             "'auto' or 'cpu'")
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world % c.get("context_parallel", 1):
        cp, budget = c["context_parallel"], c["microbatch_tokens"]
        saved = c["init_from"] == "resume" and load_checkpoint(os.path.join(c["out_dir"], "ckpt.pt"))["config"]
        fail(f"config error: context_parallel={cp}" + (" (the value of the run being resumed)" if saved and saved.get(
             "context_parallel") == cp else "") + f"; it must divide the number of processes ({world}): each group of "
             f"that many ranks splits one micro-batch's tokens (1: no context parallelism)" + (
             f"; to resume it in {world} process{'es' * (world > 1)}, pass --context_parallel=1 and a "
             f"--microbatch_tokens that holds its longest sequence (--microbatch_tokens={cp * budget} does: "
             f"{cp} x {budget})" if saved else ""))
    try:
        lora.check_settings(c, world)
    except ValueError as e:
        fail(f"config error: {e}")
    if c["init_from"] not in ("scratch", "resume") and not os.path.isfile(os.path.join(c["init_from"], "config.json")):
        hint = {"dpo": "; DPO starts from a fine-tuned model: make the default one with `python train_sft.py`",
                "rl": "; RL starts from a fine-tuned model: make the default one with `python train_sft.py && "
                      "python train_dpo.py`"}.get(kind, "")
        pair = config_leaving(c["init_from"])
        if pair and kind != "sft":
            hint = f"; {kind.upper()} starts from a fine-tuned model: make this one with `{pair}`"
        if os.path.isdir(c["init_from"]) and hub.spelt_as_name(c["init_from"]):  # the path wins over the name
            fail(f"config error: init_from={c['init_from']!r} is a local folder, read before any hub name, and it "
                 f"holds no config.json: pass a Hugging Face model folder, or move that folder away to read the hub "
                 f"repo of that name")
        fail(f"config error: init_from={c['init_from']!r}; it is neither 'scratch', 'resume', a Hugging Face model "
             f"folder (with a config.json) nor a hub name (org/name[@revision]){hint}")
    if c["init_from"] != "resume":
        try:
            check_kind(c["data"], c["data_split"], c["val_data"], c["val_split"], kind, c.get("fields"))
        except SystemExit as e:
            fail(e.code)
    test = os.path.join(c["out_dir"], f".write_test_{os.getpid()}")
    try:  # can we write where the run will live? Better now than after an hour of training
        os.makedirs(c["out_dir"], exist_ok=True)
        with open(test, "w") as f:
            f.write("ok")
    except OSError as e:
        fail(f"config error: out_dir={c['out_dir']!r}; cannot write there ({e.strerror}); choose a writable folder, "
             f"or free space there")
    finally:  # created, then refused its bytes (a full disk): gone all the same
        if os.path.lexists(test):
            os.remove(test)
    if c["init_from"] != "resume" and not c["overwrite"] and os.path.exists(os.path.join(c["out_dir"], "ckpt.pt")):
        fail(f"config error: {c['out_dir']} already holds a run (ckpt.pt); continue it with --init_from=resume, or "
             f"start over there with --overwrite=True, or choose another out_dir")


def config_leaving(folder):
    """The command that leaves folder (out/<run>/hf) when a config/ file writes out/<run>."""
    run = os.path.dirname(os.path.normpath(folder))
    configs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config")
    for path in sorted(glob.glob(os.path.join(configs, "*.py"))):
        name = os.path.basename(path)
        if re.search(rf'^out_dir = "{re.escape(run)}"', open(path).read(), re.M):
            return f"python train_{name.split('_')[0]}.py config/{name}"
    return None


def setup(config, kind, builtin_sizes=None):
    """kind: 'sft', 'dpo' or 'rl' (no token files and no loader: train_rl.py makes its batches itself)."""
    c = config
    stop_signal.install()  # until the end of setup a signal stops at once, with one line, removing half-written files
    check_run(c, kind)
    lock_out_dir(c["out_dir"])  # a second run into a live run's out_dir stops before it changes anything
    rank, world_size, device = setup_distributed(c["device"], c["dist_timeout"])
    hub.check_same_on_all_ranks(c.get("hub"))  # the names' commits, resolved by each process before the group existed
    cp = context.setup(c.get("context_parallel", 1), rank, world_size, c["dist_timeout"])
    torch.manual_seed(c["seed"])
    dtype, ptdtype, autocast = precision(device, c["dtype"], c["parallel"], world_size)
    resume = c["init_from"] == "resume"
    ckpt_path = os.path.join(c["out_dir"], "ckpt.pt")
    ckpt = load_checkpoint(ckpt_path) if resume else None
    if c["overwrite"] and not resume and rank == 0:  # start over: nothing of the previous run may pass for ours
        for old in [ckpt_path] + [os.path.join(c["out_dir"], f) for f in os.listdir(c["out_dir"]) if f.startswith(
                "ckpt-") or f in ("hf", "adapter", EXPORT_TMP, EXPORT_NEW, EXPORT_OLD)]:
            shutil.rmtree(old) if os.path.isdir(old) else os.path.exists(old) and os.remove(old)
    elif rank == 0 and (moved := finish_export(c["out_dir"])):
        print0(f"note: {', '.join(moved)}: moved into place, finishing an export that a kill cut short")

    if resume:  # a resumed run continues with the data, tokenizer and initial weights of the run it continues
        tok, start = choose_tokenizer(ckpt["tokenizer"], "resume", c.get("chat_template_kwargs")), ckpt["start"]
        data_dir = ckpt["data_dir"] and os.path.join(c["out_dir"], ckpt["data_dir"])  # relative: the run's data
        model_config = ModelConfig(**ckpt["model_config"])
        if c["lora_rank"] and start.get("weights") != base_weights(start["init_from"]):
            raise SystemExit(f"{start['init_from']} is not the base model this LoRA run started from (its weights "
                             f"changed); its checkpoint holds only the adapters: restore that folder to resume"
                             if "weights" in start else f"{ckpt_path} is from an older nanopack, which did not record "
                             f"its base's weights: finish the run with that version, or start it again")
    else:
        start = dict(init_from=c["init_from"], preset=c["preset"], weights=base_weights(c["init_from"]))
        tok = choose_tokenizer(c["tokenizer"], c["init_from"], c.get("chat_template_kwargs"))
        model_config = initial_config(start, tok)
        data_dir = None if kind == "rl" else prepare_data(c, c["out_dir"], tok, kind, model_config.max_seq_len,
                                                          builtin_sizes)
    train_data = val_data = loader = None
    group_size = 2 if kind == "dpo" else 1
    if kind != "rl":
        train_data, val_data = load_data(data_dir, tok)
        check_fits(model_config, tok, data_dir, dict(train=train_data, val=val_data), c["microbatch_tokens"],
                   group_size, c.get("prefix_sharing", False), cp.size)
    compiled = c["compile"] is True or (c["compile"] == "auto" and device.type == "cuda")
    if c["compile"] == "auto" and not compiled:
        print0("compile='auto': off on CPU, where compiling costs seconds at every start for a gain within noise "
               "(bench/RESULTS.md); --compile=True to use it anyway")
    adapters = dict(rank=c["lora_rank"], alpha=c["lora_alpha"] or 2 * c["lora_rank"], dropout=c["lora_dropout"],
                    targets=c["lora_targets"].split(","), quantize=c["quantize_base"]) if c["lora_rank"] else None
    model, raw_model = build_model(model_config, start, c["seed"], device, c["parallel"], world_size, ptdtype,
                                   compiled, c["activation_checkpointing"], from_checkpoint=resume, adapters=adapters)
    optimizer = make_optimizer(model, c["learning_rate"], c["weight_decay"], device_type=device.type)

    if kind != "rl":
        loader = PackedLoader(train_data, c["batch_size"], c["microbatch_tokens"] * cp.size, rank=cp.data_rank,
                              world_size=cp.data_size, seed=c["seed"], group_size=group_size,
                              prefix_sharing=c.get("prefix_sharing", False), context=cp)
        units = f"{len(loader.lengths)} train {'pairs' if kind == 'dpo' else 'examples'}" if "units" not in train_data \
            else f"{len(loader.lengths)} train conversations ({int(loader.sizes.sum())} turn examples)"
        for note in (turn_examples_note(data_dir, train_data, c.get("reasoning_turns", "conversation")),
                     ignored_keys_note(c, data_dir, model_config.max_seq_len)):
            if note:
                print0(note)
        if c["batch_size"] > len(loader.lengths):
            print0(f"note: batch_size={c['batch_size']} is more than the {units}: each step takes all of them")
    max_iters = c["max_iters"] or max(1, round(c["epochs"] * len(loader)))
    if 0 < max_iters <= c["warmup_iters"]:  # the learning rate never reaches learning_rate
        print0(f"note: warmup_iters={c['warmup_iters']} is at least the run's {max_iters} steps: "
               f"every step warms up, learning_rate is never reached; lower --warmup_iters")
    start_iter, saved, saved_iter = 0, {}, None
    if resume:
        restore_checkpoint(ckpt, c["out_dir"], model, optimizer)
        if loader:
            loader.load_state_dict(ckpt["loader"])
        start_iter, saved, saved_iter = ckpt["iter_num"], ckpt["extra"], ckpt["iter_num"]
    if start_iter >= max_iters:
        print0(f"note: the run is already at iter {start_iter}, max_iters={max_iters}: nothing to train "
               f"(raise max_iters)")
    trained = sum(p.numel() for p in raw_model.parameters() if p.requires_grad) if adapters else 0
    lora_note = f" (LoRA r={adapters['rank']}: {trained / 1e6:.2f}M train)" if adapters else ""
    data_note = f" | data: {data_dir}, {units}, {len(loader)} steps/epoch" if loader else ""
    cp_note = f", context parallel {cp.size} x data parallel {cp.data_size}" if cp.size > 1 else ""
    print0(f"model: {raw_model.num_params() / 1e6:.2f}M parameters{lora_note}{data_note} | world size {world_size} "
           f"({c['parallel']}{cp_note}) | device {device}, {dtype}, "
           f"attention {attention_backend(device, ptdtype)} | {max_iters} iterations")
    stop_signal.starting = False  # from here on a signal stops the run after its step, with a checkpoint
    return Run(config=c, rank=rank, world_size=world_size, device=device, dtype=dtype, autocast=autocast, tok=tok,
               data_dir=data_dir, train_data=train_data, val_data=val_data, start=start, model=model,
               raw_model=raw_model, optimizer=optimizer, loader=loader, start_iter=start_iter, max_iters=max_iters,
               out_dir=c["out_dir"], ckpt_path=ckpt_path, saved=saved, saved_iter=saved_iter,
               guard=StepGuard(c["max_bad_steps"], ckpt_path, model, ckpt and ckpt.get("guard")), adapters=adapters,
               cp=cp, kind=kind)


def build_model(model_config, start, seed, device, parallel, world_size, param_dtype, compile=False,
                activation_checkpointing=False, from_checkpoint=False, adapters=None):
    """-> (the model to call: wrapped for DDP / FSDP2, the network itself) with the initial weights of `start`;
    from_checkpoint: left for restore_checkpoint. Files are read after building on the meta device and sharding, so
    no rank ever holds the whole model. A LoRA checkpoint holds only the adapters: the base is read from `start`."""
    sharded = parallel == "fsdp" and world_size > 1
    from_checkpoint = from_checkpoint and not adapters
    from_files = from_checkpoint or (start["init_from"] != "scratch" and sharded)
    try:
        if from_files:
            with torch.device("meta"):
                raw_model = Transformer(model_config)
        elif start["init_from"] == "scratch":
            torch.manual_seed(seed)  # the same weights on every rank, and again when a live reference is rebuilt
            raw_model = Transformer(model_config)
        else:
            raw_model = from_pretrained(start["init_from"], dtype=torch.float32)
        if not from_files:
            refuse_non_finite(raw_model, start)
        if adapters:
            lora.add_adapters(raw_model, adapters["rank"], adapters["alpha"], adapters["dropout"], adapters["targets"])
            if adapters["quantize"]:
                lora.quantize_base(raw_model)
            if param_dtype != torch.float32 and not sharded:  # FSDP2 casts through its mixed-precision policy
                lora.cast_base(raw_model, param_dtype)
        if not (from_files and sharded):  # DDP broadcasts rank 0's weights when it wraps: they must exist by then
            raw_model.to_empty(device=device) if from_files else raw_model.to(device)
        raw_model.activation_checkpointing = activation_checkpointing
        if compile:  # per block, with the token count dynamic: micro-batches run at their real length
            for block in raw_model.layers:
                block.compile(dynamic=True)
        model = wrap_model(raw_model, parallel, world_size, param_dtype)
        if from_files and sharded:
            raw_model.to_empty(device=device)
        if adapters and from_files:
            lora.init_adapters(raw_model)
        if from_files and not from_checkpoint:
            load_hf_weights(raw_model, start["init_from"], lora.base_parameters(raw_model) if adapters else None)
            refuse_non_finite(raw_model, start)
    except (ValueError, OSError, KeyError) as e:  # a model folder we cannot read: what and where, in one line
        raise SystemExit(f"model error: {e}") from None
    return model, raw_model


def refuse_non_finite(model, start):
    if not all_finite(model, frozen_too=True):
        raise SystemExit(f"model error: {start['init_from']} holds NaN or infinite weights; nothing to train from")


def base_weights(init_from):
    """The fingerprint of the model folder a run starts from (None for a preset: its seed is in the config)."""
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


def choose_tokenizer(tokenizer, init_from, chat_template_kwargs=None):
    """The tokenizer asked for; else init_from's; else the byte-level one (a folder without tokenizer files is ours)."""
    hf_folder = init_from not in ("scratch", "resume")
    try:
        return get_tokenizer(tokenizer or (init_from if hf_folder and Tokenizer.has_files(init_from) else "byte"),
                             chat_template_kwargs=chat_template_kwargs)
    except (ValueError, OSError) as e:  # an unsupported tokenizer or template: the file and the key, one line
        raise SystemExit(f"tokenizer error: {e}") from None


def make_optimizer(model, learning_rate, weight_decay, betas=(0.9, 0.95), device_type="cpu"):
    """AdamW over the parameters that train; matrices decay, norms' gains and biases do not."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [dict(params=decay, weight_decay=weight_decay), dict(params=no_decay, weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda")


def set_lr(optimizer, lr):
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def lr_at(it, max_iters, learning_rate, min_lr, warmup_iters):
    """Linear warmup to learning_rate, then cosine decay to min_lr at max_iters."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / warmup_iters
    progress = min(1.0, (it - warmup_iters) / max(1, max_iters - warmup_iters))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (learning_rate - min_lr)
