"""
LoRA and QLoRA: low-rank adapters on a Transformer's block linears, the base frozen (QLoRA: stored
in 4-bit NF4).

A LoRALinear *is* the nn.Linear it replaces (its weight and bias under the same names: Hugging Face
I/O and FSDP2 see the base unchanged), plus lora_A (r, in) and lora_B (out, r):
    y = x W^T + b + scale * dropout(x) A^T B^T,   scale = alpha / r,
    B = 0 at the start (step 0 is the base)
Switched off (adapters_disabled) it is the base exactly: DPO's reference without a second model or
a cache.
"""
import contextlib
import importlib.util
import json
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanopack.parallel import print0

# Hugging Face names
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Linear):
    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)  # an NF4 weight is dequantised inside F.linear
        if not self.enabled:
            return y
        return y + F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B) * self.scale


def check_settings(c, world_size=1):
    """The LoRA keys of a config, checked before any work: ValueError('key=value; what is
    accepted')."""
    def bad(key, accepted):
        raise ValueError(f"{key}={c[key]!r}; {accepted}")

    alpha = c["lora_alpha"]
    if alpha is not None and not (type(alpha) in (int, float) and 0 < alpha < math.inf):
        bad("lora_alpha", "it must be a number greater than 0 (None: 2 x lora_rank)")
    unknown = [t for t in c["lora_targets"].split(",") if t not in TARGETS]
    if unknown or not c["lora_targets"]:
        bad("lora_targets",
            f"no layer is called {', '.join(map(repr, unknown))}; a block's linear layers are "
                            f"{','.join(TARGETS)} (comma-separated, no spaces)")
    quantize = c["quantize_base"]
    if quantize not in ("", "nf4"):
        bad("quantize_base", "choose '' (the base in dtype) or 'nf4' (QLoRA)")
    if quantize and not c["lora_rank"]:
        bad("quantize_base",
            "a 4-bit base cannot be trained: it needs adapters, set lora_rank (e.g. 16)")
    if quantize and world_size > 1:
        bad("quantize_base",
            "QLoRA runs in one process (a model that fits one GPU); use LoRA without it on several")
    if quantize and importlib.util.find_spec("torchao") is None:
        bad("quantize_base", "'nf4' needs torchao: pip install torchao")
    defaults = dict(lora_alpha=None, lora_dropout=0.0, lora_targets=",".join(TARGETS))
    unused = [k for k, v in defaults.items() if c[k] != v] if not c["lora_rank"] else []
    if unused:  # a LoRA setting without adapters would be silently ignored
        bad(unused[0],
            "it is set but lora_rank=0 (full fine-tuning, no adapters); set lora_rank (e.g. 8) to "
            "train "
                       f"adapters, or drop {unused[0]}")


def add_adapters(model, rank, alpha, dropout=0.0, targets=TARGETS):
    """Freeze the model, give each target linear of every block adapters (on the meta device:
    init_adapters later)."""
    linears = [(n, m) for n, m in model.layers.named_modules(prefix="layers")
               if n.rsplit(".", 1)[-1] in targets]
    name, m = min(linears, key=lambda x: min(x[1].in_features, x[1].out_features))
    # past that, a rank adds parameters and no capacity
    if rank > min(m.in_features, m.out_features):
        raise ValueError(f"lora_rank={rank} is more than the smallest dimension of the adapted "
                         f"layers ({name}: {m.in_features} -> {m.out_features}); choose at most "
                         f"{min(m.in_features, m.out_features)}")
    model.requires_grad_(False)
    for _, linear in linears:
        # the module itself becomes a LoRALinear (as fully_shard turns modules into FSDP modules):
        # the base keeps its Parameter objects, hooks and place in the model, and this works on the
        # meta device
        linear.__class__ = LoRALinear
        w = linear.weight
        like_w = dict(device=w.device, dtype=w.dtype)
        linear.lora_A = nn.Parameter(torch.empty(rank, linear.in_features, **like_w))
        linear.lora_B = nn.Parameter(torch.empty(linear.out_features, rank, **like_w))
        linear.scale, linear.enabled, linear.dropout = alpha / rank, True, nn.Dropout(dropout)
    if not model.embed_tokens.weight.is_meta:
        init_adapters(model)
    return model


@torch.no_grad()
def init_adapters(model, seed=0):
    """A kaiming-uniform (nn.Linear's and peft's default), B zero; drawn whole from a seeded
    generator, so FSDP2 shards get the values one process holding it all would."""
    gen = torch.Generator().manual_seed(seed)
    for module in adapted(model):
        a = torch.empty(tuple(module.lora_A.shape))
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
        _copy_rows(module.lora_A, a)
        _copy_rows(module.lora_B, torch.zeros(tuple(module.lora_B.shape)))


def _copy_rows(param, full):  # an FSDP2 (Shard(0)) DTensor takes this rank's rows
    if hasattr(param, "to_local"):
        from torch.distributed.tensor import distribute_tensor
        full = distribute_tensor(full, param.device_mesh, param.placements,
                                 src_data_rank=None).to_local()
        param = param.to_local()
    param.copy_(full)


def adapted(model):
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


def adapter_parameters(model):
    """(name, parameter) of the adapters: all that trains, and all a PEFT folder holds."""
    return [(n, p) for n, p in model.named_parameters() if n.endswith(("lora_A", "lora_B"))]


def base_parameters(model):
    """(name, parameter) of everything but the adapters: what a Hugging Face folder fills."""
    return [(n, p) for n, p in model.named_parameters() if not n.endswith(("lora_A", "lora_B"))]


@contextlib.contextmanager
def adapters_disabled(model):
    modules = adapted(model)
    for m in modules:
        m.enabled = False
    try:
        yield
    finally:
        for m in modules:
            m.enabled = True


def quantize_base(model, block_size=64, scaler_block_size=256):
    """QLoRA: each adapted layer's frozen weight becomes a torchao NF4 tensor (4-bit codes, one
    scale per block_size values, the scales themselves quantised per scaler_block_size), dequantised
    per matmul."""
    try:
        from torchao.quantization import to_nf4
    except ImportError:
        raise ImportError("quantize_base='nf4' needs torchao: pip install torchao") from None
    tile = block_size * scaler_block_size  # torchao's blocks must tile the weight
    kept = [name for name, m in model.named_modules() if isinstance(m, LoRALinear)
            and m.weight.numel() % tile]
    if len(kept) == len(adapted(model)):
        raise ValueError(f"quantize_base='nf4': none of the {len(kept)} adapted weights is a "
                         f"multiple of {tile} values (NF4 blocks), so nothing would be 4-bit and "
                         "QLoRA would be plain LoRA; drop quantize_base for this model")
    for m in adapted(model):
        if m.weight.numel() % tile == 0:
            m.weight = nn.Parameter(to_nf4(m.weight.detach(), block_size, scaler_block_size),
                                    requires_grad=False)
    if kept:
        print0(f"quantize_base: {len(kept)} weight(s) stay in {model.embed_tokens.weight.dtype}, "
               f"their size is not a multiple of {tile} (NF4 blocks), e.g. {kept[0]}")
    return kept


@torch.no_grad()
def cast_base(model, dtype):
    """The frozen matrices in the compute dtype (bf16: half of float32's memory; nothing of them
    trains, so no float32 master copy is needed), the embedding table (it sets the residual stream's
    dtype) and NF4 ones excepted."""
    for name, p in model.named_parameters():
        if (not p.requires_grad and p.dim() == 2 and name != "embed_tokens.weight"
                and not hasattr(p, "quantized_data")):
            p.data = p.data.to(dtype)


def dense(w):
    return w.get_original_weight() if hasattr(w, "get_original_weight") else w  # NF4 -> its dtype


@torch.no_grad()
def merged_state_dict(model):
    """model.state_dict() with each adapted weight W + scale * B A, no adapter entries (FSDP2: each
    rank its rows)."""
    state = model.state_dict()
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            w = dense(state[f"{name}.weight"])
            state[f"{name}.weight"] = w + m.scale * (m.lora_B @ m.lora_A).to(w.dtype)
            del state[f"{name}.lora_A"], state[f"{name}.lora_B"]
    return state


def save_adapter(model, path, base_model_name_or_path, rank, alpha, dropout, targets):
    """A PEFT folder that peft.PeftModel.from_pretrained(base, path) loads; every rank calls it,
    rank 0 writes."""
    from safetensors.torch import save
    import torch.distributed as dist
    tensors = {}
    for name, p in adapter_parameters(model):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        tensors[f"base_model.model.model.{name}.weight"] = full.detach().cpu().contiguous()
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    os.makedirs(path, exist_ok=True)
    # here: a full disk is an OSError
    with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
        f.write(save(tensors, metadata={"format": "pt"}))
    config = dict(peft_type="LORA", task_type="CAUSAL_LM", r=rank, lora_alpha=alpha,
                  lora_dropout=dropout,
                  target_modules=sorted(targets), bias="none", fan_in_fan_out=False,
                  use_rslora=False,
                  use_dora=False, init_lora_weights=True, inference_mode=True,
                  base_model_name_or_path=base_model_name_or_path)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
