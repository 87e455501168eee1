"""
Padding-free supervised fine-tuning, read top to bottom: config, setup, loop, log, save.

    python train_sft.py                                        # toy model, built-in arithmetic chats, CPU ok
    python train_sft.py config/sft_qwen2.5_0.5b.py --data=my.jsonl
    torchrun --nproc_per_node=8 train_sft.py config/sft_llama3.1_8b_fsdp.py

Every optimizer step takes `batch_size` examples (global, whatever the world size), packs each rank's share
into micro-batches of at most `microbatch_tokens` tokens, and divides the summed token loss by the step's
global number of target tokens: any micro-batch size and any number of GPUs give the same step.
"""

import os
import time
from dataclasses import asdict

import numpy as np
import torch

import common
from common import print0
from configurator import configure
from model import ModelConfig, Transformer, config_from_preset
from packing import PackedLoader, make_batch, pack

# -----------------------------------------------------------------------------
# config: every global below can be set by a config/*.py file or --key=value
out_dir = "out/sft"
init_from = "scratch"  # 'scratch' (a `model` preset), a Hugging Face model folder, or 'resume' (out_dir/ckpt.pt)
model = "toy"  # preset name for init_from='scratch'
tokenizer = ""  # 'byte', or a folder with tokenizer files; default: init_from's folder, else 'byte'
data = "builtin"  # 'builtin' (arithmetic chats), a .jsonl file, or a folder written by data/prepare.py
max_len = 4096  # JSONL only: longest example kept; longer ones follow `overlong`
overlong = "error"  # JSONL only: 'error', 'truncate' or 'skip' (counted and printed)
batch_size = 32  # examples per optimizer step, all ranks together
microbatch_tokens = 4096  # token budget of one forward pass on one rank
max_iters = 1100  # optimizer steps; 0 = `epochs` passes over the data
epochs = 1.0
learning_rate = 5e-3  # the toy model from scratch; fine-tuning a real model wants ~1e-5 (see config/)
min_lr = 5e-4
warmup_iters = 20
weight_decay = 0.1
grad_clip = 1.0
loss_weighting = "token"  # 'token': every target token counts the same; 'sequence': every example does
seed = 1337
device = "auto"  # 'auto', 'cpu', 'cuda'
dtype = "auto"  # 'auto' = bfloat16 on CUDA, float32 on CPU
compile = False
activation_checkpointing = False
parallel = "ddp"  # 'ddp' or 'fsdp' (used when launched with torchrun on more than one process)
log_interval = 10
eval_interval = 550  # evaluate (val loss, exact-match accuracy on the built-in task) and checkpoint; 0 = at the end only
eval_examples = 200  # built-in task: held-out prompts answered greedily for accuracy
wandb_log = False
wandb_project = "nanopack"
wandb_run_name = "sft"
config = configure(globals())
# -----------------------------------------------------------------------------

rank, world_size, device = common.setup_distributed(device)
master = rank == 0
torch.manual_seed(seed)
dtype, ptdtype, autocast = common.precision(device, dtype, parallel, world_size)
resume = init_from == "resume"
ckpt_path = os.path.join(out_dir, "ckpt.pt")
ckpt = common.load_checkpoint(ckpt_path) if resume else None
if resume:  # a resumed run continues with the data, tokenizer and model of the run it continues
    tokenizer, data_dir = ckpt["tokenizer"], ckpt["data_dir"]
os.makedirs(out_dir, exist_ok=True)

# ---- tokenizer and data
hf_folder = init_from not in ("scratch", "resume")
if hf_folder and not os.path.isdir(init_from):
    raise SystemExit(f"init_from={init_from!r} is neither 'scratch', 'resume' nor an existing Hugging Face model folder")
tok = common.choose_tokenizer(tokenizer, init_from)
if not resume:
    data_dir = common.prepare_data(data, out_dir, tok, "sft", max_len, overlong, seed)
train_data, val_data = common.load_data(data_dir, tok, "sft")

# ---- model
if resume:
    model_config = ModelConfig(**{k: v for k, v in ckpt["model_config"].items() if k != "padded_vocab_size"})
    net = Transformer(model_config)
elif hf_folder:
    net = Transformer.from_pretrained(init_from, dtype=torch.float32)
else:
    net = Transformer(config_from_preset(model, vocab_size=tok.vocab_size))
model_config = net.config
if tok.vocab_size > model_config.vocab_size:
    raise SystemExit(f"the tokenizer has {tok.vocab_size} tokens but the model only {model_config.vocab_size} embeddings")
net.to(device)
net.activation_checkpointing = activation_checkpointing
if compile:
    # Per block: the chunked loss's loop stays eager, each block is one graph. Training shapes are fixed
    # (micro-batches padded to microbatch_tokens); the number of sequences (cu_seqlens, max_seqlen) varies,
    # and generation in evaluation has other shapes: automatic dynamic shapes recompile once for those.
    for block in net.layers:
        block.compile()
raw_model = net
net = common.wrap_model(net, parallel, world_size, ptdtype)
optimizer = common.make_optimizer(net, learning_rate, weight_decay, device_type=device.type)

# compile wants a fixed shape: every micro-batch is padded to microbatch_tokens (the tail is a dummy segment)
loader = PackedLoader(train_data, batch_size, microbatch_tokens, rank=rank, world_size=world_size, seed=seed,
                      pad_to=microbatch_tokens if compile else None)
if max_iters == 0:
    max_iters = max(1, round(epochs * len(loader)))
iter_num = 0
if resume:
    common.restore_checkpoint(ckpt, net, optimizer)
    loader.load_state_dict(ckpt["loader"])
    iter_num = ckpt["iter_num"]
    del ckpt

n_params = raw_model.num_params()
print0(f"model: {n_params / 1e6:.2f}M parameters | data: {data_dir}, {len(train_data['offsets']) - 1} train examples, "
       f"{len(loader)} steps/epoch | world size {world_size} ({parallel}) | device {device}, {dtype} | "
       f"{max_iters} iterations")
logger = common.MetricsLogger(out_dir, wandb_log, wandb_project, wandb_run_name, config, resume=resume)


def microbatch_loss(mb, normaliser):
    """This micro-batch's share of the step loss: its summed token loss / the step's global normaliser.
    Times world_size because DDP and FSDP average gradients over ranks, and we want their sum."""
    weights = None
    if loss_weighting == "sequence":  # each example counts once: its tokens share weight 1
        targets = (mb.labels != -100).float()
        per_seq = torch.zeros(mb.num_sequences + 1, device=targets.device).index_add_(0, mb.seq_ids, targets)
        weights = 1.0 / per_seq.clamp(min=1.0)[mb.seq_ids]
    with autocast:
        loss_sum, _ = net(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen, labels=mb.labels,
                          loss_weights=weights)
    return loss_sum, loss_sum * world_size / normaliser


@torch.no_grad()
def evaluate():
    """Val loss per target token over the whole val split, and exact-match accuracy on the built-in task.
    Every rank runs the same number of forwards (FSDP's all-gathers are collectives)."""
    net.eval()
    lengths = np.diff(np.asarray(val_data["offsets"]))
    bins = pack(lengths, microbatch_tokens)
    per_rank = -(-len(bins) // world_size)
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    n_targets = 0
    for i in range(per_rank):
        j = rank + i * world_size
        mb = make_batch(val_data, bins[j] if j < len(bins) else [0], pad_to=microbatch_tokens if compile else None)
        if j >= len(bins):
            mb.labels.fill_(-100)  # a filler forward so that this rank keeps step with the others
        n_targets += mb.num_target_tokens if j < len(bins) else 0
        mb = mb.to(device)
        with autocast:
            s, _ = net(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen, labels=mb.labels)
        loss_sum += s
    total_loss, total_targets = common.all_reduce_sum([loss_sum.item(), n_targets], device)
    out = {"val_loss": total_loss / max(total_targets, 1)}
    if data == "builtin" and eval_examples > 0:
        out["val_accuracy"] = common.builtin_accuracy(raw_model, tok, eval_examples, device, autocast,
                                                      sync_ranks=parallel == "fsdp" and world_size > 1)
    net.train()
    return out


def save(loader_state):
    common.save_checkpoint(ckpt_path, net, optimizer, dict(
        model_config=asdict(model_config), iter_num=iter_num, loader=loader_state, config=config,
        tokenizer=tok.name, data_dir=data_dir))


# ---- the loop
timer = common.Timer(device)
meter = common.Throughput(raw_model, device, world_size)  # tokens, padding, FLOPs since the last log line
loss_acc = torch.zeros((), device=device, dtype=torch.float64)  # summed token loss since the last log line
nonfinite = torch.zeros((), device=device, dtype=torch.bool)  # set on device, read only when logging: no sync per step
targets_window = 0
eval_seconds = 0.0  # evaluation inside a log window is not training time
start_iter, last_log_iter, t_start = iter_num, iter_num, time.perf_counter()
loader_state = loader.state_dict()
while iter_num < max_iters:
    lr = common.lr_at(iter_num, max_iters, learning_rate, min_lr, warmup_iters)
    for group in optimizer.param_groups:
        group["lr"] = lr
    t0 = time.perf_counter()
    step = next(loader)
    normaliser = step.num_examples if loss_weighting == "sequence" else step.num_target_tokens
    mbs = [mb.to(device) for mb in step.microbatches]
    meter.count(step.microbatches, data_time=time.perf_counter() - t0)
    for i, mb in enumerate(mbs):
        with common.no_grad_sync(net, parallel, last_microbatch=i == len(mbs) - 1):
            loss_sum, loss = microbatch_loss(mb, normaliser)
            loss.backward()
        loss_acc += loss_sum.detach()
    targets_window += step.num_target_tokens
    grad_norm = torch.nn.utils.clip_grad_norm_(net.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    nonfinite |= ~torch.isfinite(loss_acc)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    iter_num += 1
    loader_state = step.state

    last = iter_num == max_iters
    if iter_num % log_interval == 0 or last:
        elapsed = timer.lap() - eval_seconds
        eval_seconds = 0.0
        n_steps, last_log_iter = iter_num - last_log_iter, iter_num
        perf, (loss_total, bad) = meter.read(elapsed, n_steps, [loss_acc.item(), float(nonfinite.item())])
        if bad:
            raise SystemExit(f"iter {iter_num}: the loss is NaN or infinite; stopping. The last good checkpoint "
                             f"({ckpt_path}, if one was written) is untouched. Lower learning_rate or check the data.")
        eta = (time.perf_counter() - t_start) / (iter_num - start_iter) * (max_iters - iter_num)
        metrics = dict(iter=iter_num, loss=loss_total / targets_window, lr=lr,
                       grad_norm=common.grad_norm_value(grad_norm), **perf)
        print0(f"iter {iter_num}/{max_iters} | loss {metrics['loss']:.4f} | lr {lr:.2e} | grad norm {metrics['grad_norm']:.2f} | "
               f"{meter.line(metrics)} | eta {common.format_eta(eta)}")
        logger.log(metrics)
        loss_acc.zero_()
        targets_window = 0
    if (eval_interval and iter_num % eval_interval == 0) or last:
        t_eval = time.perf_counter()
        results = evaluate()
        acc = f" | val accuracy {100 * results['val_accuracy']:.1f}%" if "val_accuracy" in results else ""
        print0(f"iter {iter_num}: val loss {results['val_loss']:.4f}{acc}")
        logger.log(dict(iter=iter_num, **results))
        save(loader_state)
        eval_seconds += time.perf_counter() - t_eval

# ---- finish: a Hugging Face folder next to the checkpoint
hf_dir = os.path.join(out_dir, "hf")
common.export_hf(net, model_config, hf_dir, tokenizer_from=None if tok.name == "byte" else tok.name)
if master:
    print0(f"done: checkpoint {ckpt_path}, Hugging Face folder {hf_dir}"
           + (" (byte-level tokenizer: sample.py uses it by default)" if tok.name == "byte" else ""))
logger.finish()
common.teardown_distributed()
