"""
A run's state on disk: a DCP folder out_dir/ckpt-<iter>-<n>/ of sharded model + optimizer
tensors, and a small ckpt.pt naming it (config, loader position, RNG, iteration), replaced
atomically: a kill at any moment leaves ckpt.pt naming a complete checkpoint, which any world
size and layout resumes (DCP reshards). export_hf writes out_dir/hf at the end.
"""
import io
import json
import math
import os
import pickle
import random
import shutil
import warnings
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from nanopack import lora
from nanopack.hf import save_pretrained
from model import ModelConfig, Transformer
from nanopack.parallel import fail, print0

# DCP without a process group warns at every save and load that it assumes one process: we mean it
warnings.filterwarnings("ignore",
                        message="torch.distributed is disabled, unavailable or uninitialized")
# LoRA: the adapters, not the frozen base
TRAINED = StateDictOptions(ignore_frozen_params=True, strict=False)


def save_checkpoint(run, origin, model, optimizer, iter_num, loader_state, extra, evaluation=None):
    """A fresh DCP folder, then rank 0 replaces ckpt.pt and only then removes older folders.
    origin: what a resume starts from (tokenizer, data_dir, start, model_config); extra: the
    script's own state (restore returns it on resume). -> whether it was written (then
    run.saved_iter): non-finite weights or evaluation never are."""
    bad = [k for k, v in (evaluation or {}).items() if not math.isfinite(v)]
    if bad or not all_finite(model):
        what = 'the weights are' if not bad else ', '.join(bad) + ' is'
        print0(f"iter {iter_num}: {what} not finite: checkpoint "
               f"NOT written ({run.ckpt_path} stays as it was)")
        return False
    name = [None]
    # a fresh folder name, never ckpt.pt's: a resumed run may save the same iter
    if run.master:
        n = 0
        while os.path.exists(os.path.join(run.out_dir, f"ckpt-{iter_num:06d}-{n}")):
            n += 1
        name = [f"ckpt-{iter_num:06d}-{n}"]
    if dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    folder, tmp = os.path.join(run.out_dir, name[0]), run.ckpt_path + ".tmp"
    # FSDP2: each rank its own
    model_sd, optim_sd = get_state_dict(model, optimizer, options=TRAINED)
    try:
        dcp.save(dict(model=model_sd, optimizer=optim_sd), checkpoint_id=folder,
                 no_dist=not dist.is_initialized())
        # serialised in memory: a full disk is then an OSError, not torch's "unexpected pos"
        if run.master:
            small = io.BytesIO()
            data_dir = origin["data_dir"] and portable(origin["data_dir"], run.out_dir)
            torch.save(dict(weights=name[0], rng=rng_state(),
                            model_config=asdict(origin["model_config"]), iter_num=iter_num,
                            loader=loader_state, config=run.config, tokenizer=origin["tokenizer"],
                            data_dir=data_dir, start=origin["start"], guard=run.guard.counts(),
                            extra=extra, script=run.script),
                       small)
            with open(tmp, "wb") as f:
                f.write(small.getbuffer())
                f.flush()
                # a crash leaves no empty ckpt.pt
                os.fsync(f.fileno())
            os.replace(tmp, run.ckpt_path)
    except (OSError, RuntimeError, dcp.CheckpointException) as e:
        # nothing half written stays: ckpt.pt still names the last complete checkpoint
        if run.master:
            shutil.rmtree(folder, ignore_errors=True)
            os.path.exists(tmp) and os.remove(tmp)
        stop_writing(e, f"the checkpoint of iter {iter_num}", run)
    if run.master:
        # earlier checkpoints, and any a kill left half written
        for old in os.listdir(run.out_dir):
            if old.startswith("ckpt-") and old != name[0]:
                shutil.rmtree(os.path.join(run.out_dir, old), ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    run.saved_iter = iter_num
    return True


def stop_writing(e, what, run):
    """A write the disk refused (full, over quota, read-only): one line; any other error is a bug:
    its traceback."""
    errors = under(e)
    disk = [x.strerror or str(x) for x in errors if isinstance(x, OSError)]
    # torch.save's zip writer saw a short write
    if not disk and any("unexpected pos" in str(x) for x in errors):
        disk = ["No space left on device (a write stopped short)"]
    if not disk:
        raise e
    then = (f"{run.ckpt_path} still holds the last complete checkpoint; free space, then continue "
            f"with --init_from=resume --out_dir={run.out_dir}" if os.path.exists(run.ckpt_path) else
            "no checkpoint was written yet; free space, then run it again")
    fail(f"{disk[0]}: {what} could not be written in {run.out_dir}, nothing of it is kept; "
         f"{then}")


def under(e):
    """e and the errors under it, outermost first: each rank's failure in a CheckpointException,
    and __context__ (torch.save's RuntimeError can hold the OSError its stream raised)."""
    inner = [f[0] for f in getattr(e, "failures", {}).values()] + [e.__context__]
    return [e] + [x for i in inner if i is not None for x in under(i)]


def restore_checkpoint(ckpt, folder, model, optimizer=None):
    """The checkpoint's weights (and optimizer state and RNG) into a placed model, of any world
    size and layout."""
    if optimizer is None:
        state = dict(model=get_model_state_dict(model, options=TRAINED))
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=TRAINED)
        state = dict(model=model_sd, optimizer=optim_sd)
    path = os.path.join(folder, ckpt["weights"])
    try:
        dcp.load(state, storage_reader=dcp_reader(path), no_dist=not dist.is_initialized())
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError,
            dcp.CheckpointException) as e:
        # the real cause, not the CheckpointException around it
        cause = next(x for x in under(e) if not getattr(x, "failures", None))
        # torch's first sentence only: the advice after it is ours
        reason = str(cause).splitlines()[0].split(". ")[0]
        fail(f"{path}: the checkpoint's weights cannot be read ({reason}); the folder is "
             f"incomplete or damaged: restore the run folder from a copy, or start again "
             f"(--overwrite=True)")
    missing = set(set_model_state_dict(model, state["model"], options=TRAINED).missing_keys)
    # named as load_state_dict names them
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert missing <= frozen, f"{path} lacks {sorted(missing - frozen)[:3]}"
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=TRAINED)
        set_rng_state(ckpt["rng"])


def dcp_reader(path):
    """A reader of the DCP folder path, its index (.metadata) read first: DCP itself would log two
    tracebacks for a missing or damaged one, then fail."""
    metadata = os.path.join(path, ".metadata")
    if not os.path.isfile(metadata):
        raise FileNotFoundError(f"no file {metadata}")
    reader = dcp.FileSystemReader(path)
    try:
        reader.read_metadata()
    # whatever unpickling garbage raises: not an index DCP wrote
    except Exception as e:
        raise ValueError(f"its .metadata is damaged: {type(e).__name__}") from None
    return reader


def load_checkpoint(path):
    """ckpt.pt, the small part of a checkpoint; one line if it is empty, cut short or not ours."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        ours = isinstance(ckpt, dict) and "weights" in ckpt
        problem = None if ours else "no 'weights' entry naming a DCP folder"
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as e:
        problem = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'empty'}"
    if problem:
        fail(f"{path} cannot be read ({problem}): it is damaged, cut short or not ours; "
             f"restore it from a copy, or start again (--overwrite=True)")
    return ckpt


def checkpoint_model(ckpt_path, device="cpu"):
    """(Transformer with the checkpoint's weights, the checkpoint's small part): for sample.py and
    tests."""
    ckpt = load_checkpoint(ckpt_path)
    if ckpt.get("config", {}).get("lora_rank"):
        export = os.path.join(os.path.dirname(ckpt_path), 'hf')
        raise SystemExit(f"{ckpt_path} holds LoRA adapters only, not a whole model: use the run's "
                         f"merged export {export} (or resume the run to finish it)")
    with torch.device("meta"):
        model = Transformer(ModelConfig(**ckpt["model_config"]))
    model.to_empty(device=device)
    restore_checkpoint(ckpt, os.path.dirname(ckpt_path), model)
    return model, ckpt


def all_finite(model, frozen_too=False):
    """Whether every trained parameter (frozen_too: every one) is finite, on every rank (FSDP2:
    each its shards)."""
    params = [p for p in model.parameters() if p.requires_grad or frozen_too]
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    ok = torch.stack([torch.isfinite(p).all() for p in local]).all().float()
    if dist.is_initialized():
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def portable(path, out_dir):
    """Relative to the run's folder when inside it, so a copied or moved run resumes with its own
    data."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(out_dir))
    return rel if not rel.startswith("..") else os.path.abspath(path)


def rng_state():
    np_state = np.random.get_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return dict(python=random.getstate(),
                numpy=(np_state[0], np_state[1].tolist(), *np_state[2:]),
                torch=torch.get_rng_state(), cuda=cuda)


def set_rng_state(state):
    random.setstate(state["python"])
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np.array(np_state[1], dtype=np.uint32), *np_state[2:]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                   "special_tokens_map.json", "chat_template.jinja", "generation_config.json")
# config.json keys generation tools read
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
# an export being written; whole, waiting to move in; the one it replaces
EXPORT_TMP, EXPORT_NEW, EXPORT_OLD = "export.tmp", "export.new", "export.old"


def export_hf(run, model, raw_model, tok, start, adapters=None):
    """The trained weights as out_dir/hf with the tokenizer files and token ids of `start`'s folder
    (every rank calls this; rank 0 writes); adapters: LoRA's settings, also written as a PEFT
    folder. Written whole into out_dir/export.tmp, then moved in by finish_export: a failed or
    killed export leaves the previous one or this one, never a part of one nor the adapter of one
    beside the hf of another."""
    hf_dir, adapter_dir = os.path.join(run.out_dir, "hf"), os.path.join(run.out_dir, "adapter")
    if not all_finite(model):
        raise SystemExit(f"the weights are not all finite: no Hugging Face folder written; "
                         f"{run.ckpt_path} holds the last finite checkpoint")
    staging = os.path.join(run.out_dir, EXPORT_TMP)
    if run.master:
        # one a kill cut short: moved in (or removed, half written) before it is replaced
        finish_export(run.out_dir)
    try:
        if adapters:
            # LoRA: the merged weights (W + scale B A) in out_dir/hf, the adapters alone as PEFT's
            save_pretrained(raw_model, os.path.join(staging, "hf"),
                            state=lora.merged_state_dict(raw_model))
            # a hub name, as PEFT takes it
            hub_name = (run.config.get("hub") or {}).get("init_from", "").partition("@")[0]
            base = hub_name or start["init_from"]
            lora.save_adapter(raw_model, os.path.join(staging, "adapter"), base,
                              **{k: v for k, v in adapters.items() if k != "quantize"})
        else:
            # FSDP2: gathered to rank 0's CPU
            save_pretrained(raw_model, os.path.join(staging, "hf"))
        if run.master:
            add_tokenizer(tok, start, os.path.join(staging, "hf"))
            # whole: from here on it is the export
            os.replace(staging, os.path.join(run.out_dir, EXPORT_NEW))
    except OSError as e:
        if run.master:
            shutil.rmtree(staging, ignore_errors=True)
        stop_writing(e, "the Hugging Face export (a previous one stays as it was)", run)
    if run.master:
        finish_export(run.out_dir)
    adapter = f", PEFT adapter {adapter_dir}" if adapters else ""
    byte_level = " (byte-level tokenizer: sample.py uses it by default)" * (tok.name == "byte")
    print0(f"done: checkpoint {run.ckpt_path}, Hugging Face folder {hf_dir}{adapter}{byte_level}")


def finish_export(out_dir):
    """Move the whole export in out_dir/export.new into place: every previous folder aside into
    export.old first, then every new one in, then export.old removed (and export.tmp, half
    written). Run again after a kill at any moment, it finishes the move -> the folders it moved
    in."""
    new, old = os.path.join(out_dir, EXPORT_NEW), os.path.join(out_dir, EXPORT_OLD)
    moved = []
    if os.path.isdir(new):
        names = sorted(os.listdir(new))
        os.makedirs(old, exist_ok=True)
        # all aside before any moves in: a kill between leaves a folder missing, never a mix
        for name in names:
            current, aside = os.path.join(out_dir, name), os.path.join(old, name)
            if os.path.exists(current) and not os.path.exists(aside):
                os.replace(current, aside)
        for name in names:
            os.replace(os.path.join(new, name), os.path.join(out_dir, name))
            moved.append(os.path.join(out_dir, name))
        os.rmdir(new)
    for leftover in (old, os.path.join(out_dir, EXPORT_TMP)):
        shutil.rmtree(leftover, ignore_errors=True)
    return moved


def add_tokenizer(tok, start, hf_dir):
    """The tokenizer files and special token ids of the folder the run started from (or of its
    tokenizer's)."""
    folders = [f for f in {start["init_from"], tok.name} if os.path.isdir(f)]
    for name in TOKENIZER_FILES:
        for folder in folders:
            if os.path.exists(os.path.join(folder, name)):
                shutil.copy(os.path.join(folder, name), hf_dir)
    ids = dict(bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=None)
    source = os.path.join(start["init_from"], "config.json")
    # the source's own ids win: generation must stop where it stopped
    if os.path.exists(source):
        with open(source) as f:
            ids.update({k: v for k, v in json.load(f).items() if k in TOKEN_ID_KEYS})
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf_config = json.load(f)
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump({**hf_config, **ids}, f, indent=2)
