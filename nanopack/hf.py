"""
Hugging Face checkpoints in and out: config.json <-> ModelConfig; safetensors read row by row from
memory-mapped files (an FSDP2 rank reads only its own rows), written tensor by tensor (FSDP2 rows
gathered to rank 0); a fingerprint.
"""
import hashlib
import json
import math
import os

import torch
import torch.distributed as dist

from model import ModelConfig, Transformer

_HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "mistral": "MistralForCausalLM", "smollm3": "SmolLM3ForCausalLM"}
VOCAB_ROWS = ("embed_tokens.weight", "lm_head.weight")  # their rows past vocab_size are our padding


def config_from_hf(hf, source="config.json"):
    """A Hugging Face config dict -> ModelConfig; a key missing, mistyped or not supported is a
    ValueError."""
    def unsupported(key, why):
        raise ValueError(f"{source}: {key}={hf.get(key)!r} is not supported: {why}")

    def get(key, kind=int, default=None, required=False, within=None):
        """hf[key] (or hf[within][key]), a positive number (an int also where a float is expected)
        or a bool."""
        v = (hf if within is None else hf[within]).get(key)
        name = key if within is None else f"{within}.{key}"
        if v is None:
            if required:
                raise ValueError(f"{source}: required key {name!r} is missing — the file is "
                                 "incomplete; re-download the model or add the key")
            return default
        numeric = (int, float) if kind is float else int
        number = isinstance(v, numeric) and not isinstance(v, bool) and v > 0
        if not (isinstance(v, bool) if kind is bool else number):
            what = "true or false" if kind is bool else f"a positive {kind.__name__}"
            raise ValueError(f"{source}: {name}={v!r} must be {what} — fix the value in the file")
        return v

    arch = hf.get("model_type")
    if not isinstance(arch, str) or arch not in _HF_ARCH:
        unsupported("model_type", f"nanopack loads {sorted(_HF_ARCH)}")
    if hf.get("hidden_act", "silu") != "silu":
        unsupported("hidden_act", "the MLP is SwiGLU (silu)")
    if hf.get("mlp_bias"):
        unsupported("mlp_bias", "the MLP has no biases")
    if arch != "qwen2" and hf.get("attention_bias"):  # Llama, Qwen3, SmolLM3: on o_proj as well
        unsupported("attention_bias",
                    "only Qwen2-style q/k/v biases are implemented (no o_proj bias)")
    theta, scaling = rope_from_hf(hf, get, unsupported)
    max_len = get("max_position_embeddings", default=2048)
    if arch != "mistral" and hf.get("use_sliding_window") and hf.get("sliding_window") is not None:
        unsupported("use_sliding_window",
                    "per-layer sliding windows (Qwen2/Qwen3 max_window_layers, SmolLM3 "
                    "NoPE layers) are not implemented")
    window = get("sliding_window") if arch == "mistral" else None
    if window is not None and window >= max_len:
        window = None  # a window no sequence can exceed changes nothing
    n_head = get("num_attention_heads", required=True)
    n_layer = get("num_hidden_layers", required=True)
    nope = ()
    if arch == "smollm3":  # no_rope_layers[i] is 1 where layer i uses RoPE, 0 where it skips it
        # what transformers derives the list from when absent
        interval = get("no_rope_layer_interval", default=4)
        flags = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n_layer)]
        if (not isinstance(flags, list) or len(flags) < n_layer
                or any(f not in (0, 1) for f in flags)):
            unsupported("no_rope_layers",
                        f"expected a list of {n_layer} (num_hidden_layers) 0s and 1s")
        nope = tuple(i for i in range(n_layer) if flags[i] == 0)
    try:
        return ModelConfig(
            vocab_size=get("vocab_size", required=True), n_layer=n_layer,
            n_head=n_head, n_kv_head=get("num_key_value_heads", default=n_head),
            d_model=get("hidden_size", required=True),
            ffn_hidden=get("intermediate_size", required=True),
            head_dim=get("head_dim"), rope_theta=float(theta), rope_scaling=scaling,
            max_seq_len=max_len,
            norm_eps=get("rms_norm_eps", float, 1e-5), qkv_bias=(arch == "qwen2"),
            qk_norm=(arch == "qwen3"),
            nope_layers=nope, tie_embeddings=get("tie_word_embeddings", bool, False),
            sliding_window=window,
            arch=arch)
    except AssertionError as e:  # ModelConfig's own checks (head counts, even head_dim)
        raise ValueError(f"{source}: {e} — the values do not describe a valid model") from None


def rope_from_hf(hf, get, unsupported):
    """config_from_hf's RoPE keys -> (rope_theta, ModelConfig.rope_scaling); get and unsupported:
    its readers."""
    # newer transformers write rope_parameters (with rope_theta inside), older rope_theta +
    # rope_scaling
    rope_key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = hf.get(rope_key) or {}
    if not isinstance(rope, dict):
        unsupported(rope_key, 'expected an object such as {"rope_type": "linear", "factor": 2.0}')
    theta = get("rope_theta", float, within=rope_key) if rope else None
    theta = theta or get("rope_theta", float, 10000.0)
    kind = rope.get("rope_type", rope.get("type", "default"))
    # the keys model.rope_tables reads
    needs = {"default": (), "linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                        "original_max_position_embeddings")}
    if kind not in needs:
        unsupported(rope_key, f"rope_type {kind!r} (supported: default, linear, llama3)")
    for key in needs[kind]:
        get(key, float, required=True, within=rope_key)
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        unsupported("partial_rotary_factor", "RoPE rotates the whole head")
    scaling = None
    if kind != "default":
        scaling = {**{k: v for k, v in rope.items() if k not in ("type", "rope_theta")},
                   "rope_type": kind}
    return theta, scaling


def config_to_hf(cfg, dtype):
    hf = dict(architectures=[_HF_ARCH[cfg.arch]], model_type=cfg.arch, vocab_size=cfg.vocab_size,
              hidden_size=cfg.d_model, intermediate_size=cfg.ffn_hidden,
              num_hidden_layers=cfg.n_layer,
              num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
              head_dim=cfg.head_dim,
              hidden_act="silu", max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
              rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling,
              tie_word_embeddings=cfg.tie_embeddings,
              torch_dtype=str(dtype).removeprefix("torch."))
    if cfg.arch in ("llama", "qwen3", "smollm3"):
        hf.update(attention_bias=False, mlp_bias=False)
    if cfg.arch == "mistral":
        hf.update(sliding_window=cfg.sliding_window)
    if cfg.arch in ("qwen2", "qwen3", "smollm3"):
        hf.update(use_sliding_window=False, sliding_window=None)
    if cfg.arch == "smollm3":
        hf.update(no_rope_layers=[int(i not in cfg.nope_layers) for i in range(cfg.n_layer)])
    return hf


def _gather_rows(t, write):
    """An FSDP2 DTensor (dim 0 in torch.chunk pieces) whole on mesh rank 0's CPU, received rank by
    rank through one shard-sized buffer; the other ranks send their rows and get None. A plain
    tensor: as it is."""
    if not hasattr(t, "to_local"):
        return t
    local, mesh = t.to_local(), t.device_mesh
    group, n, world_size = mesh.get_group(), t.shape[0], mesh.size()
    chunk = -(-n // world_size)
    if not write:
        if local.shape[0]:
            dist.send(local.contiguous(), dist.get_global_rank(group, 0), group=group)
        return None
    out = torch.empty(t.shape, dtype=t.dtype)
    out[:local.shape[0]] = local
    buf = torch.empty((min(chunk, n), *t.shape[1:]), dtype=t.dtype, device=local.device)
    for r in range(1, world_size):
        start = min(n, r * chunk)
        rows = min(n, start + chunk) - start
        if rows:
            dist.recv(buf[:rows], dist.get_global_rank(group, r), group=group)
            out[start:start + rows] = buf[:rows]
    return out


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _write_safetensors_header(f, entries):
    """safetensors: an 8-byte little-endian header length, a JSON header of name -> dtype, shape and
    byte range (space-padded to a multiple of 8), then the bytes back to back. entries: (name,
    shape, torch dtype, nbytes)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, dtype, nbytes in entries:
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    f.write(len(text).to_bytes(8, "little") + text)


def _hf_key(name):
    return name if name.startswith("lm_head.") else "model." + name


def read_hf_config(path):
    """A Hugging Face folder's ModelConfig, from its config.json alone."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"{cfg_path} not found: point to a Hugging Face model folder "
                                f"(config.json + model.safetensors)")
    return config_from_hf(_read_json_object(cfg_path), cfg_path)


def _read_json_object(path):
    """json.load that names the file: json's own errors give a line and column but no file."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except ValueError as e:  # JSONDecodeError ("... line 3 column 5"), or bytes that are not UTF-8
        raise ValueError(f"{path}: not valid JSON ({e}) — fix the file or re-download "
                         "the model") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: holds a JSON {type(obj).__name__}, not an object — fix the file "
                         "or re-download the model")
    return obj


class SafetensorsFolder:
    """A folder's model.safetensors (or the shards its index lists), memory-mapped: read() copies
    only those rows."""

    def __init__(self, path):
        from safetensors import SafetensorError, safe_open
        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            weight_map = _read_json_object(index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(f, str)
                                                           for f in weight_map.values()):
                raise ValueError(f"{index}: no \"weight_map\" object of tensor name -> shard file "
                                 "— re-download or re-export the model")
            names = sorted(set(weight_map.values()))
        elif os.path.exists(os.path.join(path, "model.safetensors")):
            names = ["model.safetensors"]
        else:
            raise FileNotFoundError(f"{path}: no model.safetensors or "
                                    "model.safetensors.index.json; point to a Hugging Face model "
                                    "folder (pytorch_model.bin is not read: unsafe pickle)")
        self.files = {}  # tensor name -> the open file that holds it
        for name in names:
            file = os.path.join(path, name)
            if not os.path.exists(file):
                raise FileNotFoundError(f"{file} not found, but {index} lists it — the download is "
                                        "incomplete; re-download the model")
            try:
                handle = safe_open(file, framework="pt")
            except SafetensorError as e:
                # e.g. "incomplete metadata, file not fully covered": names no file
                raise ValueError(f"{file}: incomplete or corrupt safetensors file ({e}) — "
                                 "re-download or re-export the model") from None
            self.files.update({key: handle for key in handle.keys()})

    def keys(self):
        return self.files.keys()

    def shape(self, key):
        return tuple(self.files[key].get_slice(key).get_shape())

    # rows start:stop (a 1-D tensor's elements), a new CPU tensor
    def read(self, key, start=0, stop=None):
        return self.files[key].get_slice(key)[start:stop]


def fingerprint(path, rows=16):
    """A cheap hash of a folder's weights: config.json, and each tensor's name, shape, dtype and
    `rows` of its rows spread evenly (a 1-D tensor whole), whatever the sharding. One edited row is
    caught only where sampled."""
    files = SafetensorsFolder(path)
    with open(os.path.join(path, "config.json"), "rb") as f:
        h = hashlib.sha256(f.read())
    for key in sorted(files.keys()):
        shape = files.shape(key)
        picked = [None]
        if len(shape) > 1:
            picked = sorted({j * (shape[0] - 1) // (rows - 1) for j in range(rows)})
        for i in picked:
            t = files.read(key) if i is None else files.read(key, i, i + 1)
            h.update(f"{key}{shape}{t.dtype}".encode()
                     + t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def from_pretrained(path, dtype=None, device="cpu"):
    """A Transformer from a Hugging Face folder (dtype None: the checkpoint's); peak memory: model +
    one tensor."""
    config = read_hf_config(path)
    files = SafetensorsFolder(path)
    with torch.device("meta"):
        model = Transformer(config)
    model.to(dtype=dtype
             or files.read("model.embed_tokens.weight", 0, 1).dtype).to_empty(device=device)
    load_hf_weights(model, files)
    return model


@torch.no_grad()
def load_hf_weights(model, files, params=None):
    """Fill a placed model's parameters (params: (name, parameter) pairs, LoRA's base) from a
    Hugging Face folder, a path or a SafetensorsFolder, after checking every name and shape; an
    FSDP2 shard reads only its own rows."""
    files = files if isinstance(files, SafetensorsFolder) else SafetensorsFolder(files)
    params = list(model.named_parameters() if params is None else params)
    path, cfg = files.path, model.config
    # old exports' RoPE buffers
    unused = {k for k in files.keys() if not k.endswith("rotary_emb.inv_freq")}
    # some exports also write the tied head
    tied_copy = cfg.tie_embeddings and "lm_head.weight" in files.keys()
    if tied_copy:
        unused.discard("lm_head.weight")  # checked against the embedding below
    for name, p in params:
        key = _hf_key(name)
        if key not in unused:
            hint = ""
            if name == "lm_head.weight":
                hint = " (config.json says tie_word_embeddings=false)"
            raise ValueError(f"{path}: tensor {key!r} missing from the checkpoint{hint} — the "
                             "weights and config.json do not match; re-download or re-export the "
                             "model")
        unused.discard(key)
        want = (cfg.vocab_size, *p.shape[1:]) if name in VOCAB_ROWS else tuple(p.shape)
        if files.shape(key) != want:
            raise ValueError(f"{path}: tensor {key!r} has shape {files.shape(key)}, config.json "
                             f"implies {want} — the weights and config.json come from different "
                             "models")
    # weights the model would drop: a bias, a layer or a head this config has no place for
    if unused:
        raise ValueError(f"{path}: {len(unused)} tensor(s) in the checkpoint are not used by this "
                         f"{cfg.arch} config.json, e.g. {sorted(unused)[:3]} — the weights belong "
                         "to another architecture or config.json is wrong; re-export the model")
    for name, p in params:
        local, start = p, 0
        # Shard(0): rank r holds rows [r * ceil(n / W), ...), as torch.chunk splits
        if hasattr(p, "to_local"):
            local = p.to_local()
            start = min(p.shape[0],
                        p.device_mesh.get_local_rank() * -(-p.shape[0] // p.device_mesh.size()))
        stop = start + local.shape[0]
        if name in VOCAB_ROWS:
            stop = max(start, min(stop, cfg.vocab_size))
        rows = files.read(_hf_key(name), start, stop)
        tied_differs = tied_copy and not torch.equal(rows,
                                                     files.read("lm_head.weight", start, stop))
        if name == "embed_tokens.weight" and tied_differs:
            raise ValueError(f"{path}: config.json says tie_word_embeddings=true, but the "
                             "checkpoint's 'lm_head.weight' differs from "
                             "'model.embed_tokens.weight' — set tie_word_embeddings to false if "
                             "the model has its own head, or re-export it")
        local[:len(rows)].copy_(rows)
        local[len(rows):].zero_()


def save_pretrained(model, path, max_shard_bytes=5 * 2**30, state=None):
    """config.json + safetensors that transformers loads (an index past max_shard_bytes), one tensor
    at a time; under FSDP2 every rank calls it and sends its rows to rank 0. state: instead of
    model.state_dict() (LoRA's merged)."""
    # FSDP2: DTensors, each rank holding its own rows
    state = model.state_dict() if state is None else state
    # send this rank's rows, tensor by tensor as rank 0 writes
    if dist.is_initialized() and dist.get_rank() != 0:
        for t in state.values():
            _gather_rows(t.detach(), write=False)
        return
    V = model.config.vocab_size
    shapes = {name: (V if name in VOCAB_ROWS else t.shape[0], *t.shape[1:])
              for name, t in state.items()}
    sizes = {name: math.prod(shapes[name]) * t.element_size() for name, t in state.items()}
    shards, size = [[]], 0
    for name, nbytes in sizes.items():
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    # a previous export goes first: its index or shards would be loaded instead of these, and a file
    # written over keeps its mode (save_file's is 0600) where a new one gets the umask's, so others
    # can read it
    os.makedirs(path, exist_ok=True)
    for fname in os.listdir(path):
        if fname in ("config.json", "model.safetensors", "model.safetensors.index.json") or (
                fname.startswith("model-") and "-of-" in fname and fname.endswith(".safetensors")):
            os.remove(os.path.join(path, fname))
    for fname, shard in zip(names, shards):
        with open(os.path.join(path, fname), "wb") as f:
            header = [(_hf_key(n), shapes[n], state[n].dtype, sizes[n]) for n in shard]
            _write_safetensors_header(f, header)
            for name in shard:
                t = _gather_rows(state[name].detach(), write=True)
                # no copy
                f.write(t[:shapes[name][0]].contiguous().cpu().view(-1).view(torch.uint8).numpy())
    if len(shards) > 1:
        weight_map = {_hf_key(name): fname for fname, shard in zip(names, shards) for name in shard}
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map},
                      f, indent=2)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf(model.config, model.embed_tokens.weight.dtype), f, indent=2)
