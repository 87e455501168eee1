"""
A Llama-style transformer that runs on a *packed* 1-D token stream: the network, and nothing else.

Several sequences are concatenated into one stream of T tokens with no padding:
  input_ids    (T,)    the tokens
  position_ids (T,)    restart at 0 for every sequence (RoPE reads them)
  cu_seqlens   (N+1,)  int32 sequence boundaries: sequence i is [cu_seqlens[i], cu_seqlens[i+1])
  max_seqlen   int     the longest sequence (the attention kernels want it on the host)
Attention never crosses a boundary, so the stream computes exactly what N separate padded rows
would. Optional kv = (kv_index, cu_seqlens_k, max_seqlen_k[, context-parallel group]): keys and
values are k[kv_index], a stream of their own (a reply reads its prompt, laid out once: packing.py),
causal attention aligned at the bottom right; with a group (context.py), kv_index reads the whole
group's K/V rows, all-gathered.
"""
import inspect
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from nanopack import kernels
from nanopack.attention import grouped_sdpa

try:
    from flash_attn import flash_attn_varlen_func
except ImportError:
    flash_attn_varlen_func = None

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None
# its keywords changed across releases (2.10: is_causal; later: window_size, then enable_gqa): we
# call what is there
VARLEN_KEYWORDS = set()
if varlen_attn is not None:
    VARLEN_KEYWORDS = set(inspect.signature(varlen_attn).parameters)

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "smollm3")  # Hugging Face model_type values


@dataclass
class ModelConfig:
    vocab_size: int = 512
    n_layer: int = 6
    n_head: int = 6
    n_kv_head: Optional[int] = None  # None -> n_head (no GQA)
    d_model: int = 192
    ffn_hidden: int = 512
    head_dim: Optional[int] = None  # None -> d_model // n_head
    rope_theta: float = 10000.0
    # {"rope_type": "llama3", factor, ...} or {"rope_type": "linear", "factor": f}
    rope_scaling: Optional[dict] = None
    max_seq_len: int = 2048  # RoPE table size; Hugging Face's max_position_embeddings
    norm_eps: float = 1e-5
    qkv_bias: bool = False  # Qwen2 has biases on q, k, v (not on o)
    qk_norm: bool = False  # Qwen3: an RMSNorm over head_dim on each q and k head, before RoPE
    nope_layers: tuple = ()  # SmolLM3: indices of the layers that skip RoPE ("NoPE")
    tie_embeddings: bool = False
    # Mistral: a token sees itself and the sliding_window-1 before it
    sliding_window: Optional[int] = None
    arch: str = "llama"  # the Hugging Face architecture hf.save_pretrained writes: one of ARCHS

    def __post_init__(self):
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.head_dim is None:
            self.head_dim = self.d_model // self.n_head
        assert self.n_head % self.n_kv_head == 0, \
            f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}"
        assert self.head_dim % 2 == 0, f"RoPE needs an even head_dim, got {self.head_dim}"
        assert self.arch in ARCHS, f"unknown arch {self.arch!r}; one of {ARCHS}"
        # checked here, not at export: a run must not train for hours a model save_pretrained cannot
        # describe
        assert not self.qk_norm or self.arch == "qwen3", "qk_norm needs arch='qwen3'"
        assert not self.nope_layers or self.arch == "smollm3", "nope_layers needs arch='smollm3'"
        # a list (JSON, a config file) too: equal configs compare equal
        self.nope_layers = tuple(self.nope_layers)
        # vocab rows padded to a multiple of 64 keep the head matmul on fast tiles: zero, never
        # indexed, cut off
        self.padded_vocab_size = -(-self.vocab_size // 64) * 64


# all Llama 3.x
LLAMA3_ROPE = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
PRESETS = {
    # ~0.1M parameters: tests and smoke runs of the training scripts
    "tiny": dict(vocab_size=512, n_layer=2, n_head=4, n_kv_head=2, d_model=64, ffn_hidden=128,
                 max_seq_len=2048),
    # ~1.1M parameters: learns the built-in arithmetic chat task in a few minutes on a laptop CPU.
    "toy": dict(vocab_size=512, n_layer=4, n_head=4, n_kv_head=2, d_model=128, ffn_hidden=512,
                max_seq_len=2048),
    "smollm2-135m": dict(vocab_size=49152, n_layer=30, n_head=9, n_kv_head=3, d_model=576,
                         ffn_hidden=1536, rope_theta=100000.0, max_seq_len=8192,
                         tie_embeddings=True),
    "qwen2.5-0.5b": dict(vocab_size=151936, n_layer=24, n_head=14, n_kv_head=2, d_model=896,
                         ffn_hidden=4864, rope_theta=1000000.0, max_seq_len=32768, norm_eps=1e-6,
                         qkv_bias=True, tie_embeddings=True, arch="qwen2"),
    "qwen3-0.6b": dict(vocab_size=151936, n_layer=28, n_head=16, n_kv_head=8, d_model=1024,
                       ffn_hidden=3072, head_dim=128, rope_theta=1000000.0, max_seq_len=40960,
                       norm_eps=1e-6, qk_norm=True, tie_embeddings=True, arch="qwen3"),
    "qwen3-1.7b": dict(vocab_size=151936, n_layer=28, n_head=16, n_kv_head=8, d_model=2048,
                       ffn_hidden=6144, head_dim=128, rope_theta=1000000.0, max_seq_len=40960,
                       norm_eps=1e-6, qk_norm=True, tie_embeddings=True, arch="qwen3"),
    "llama-3.2-1b": dict(vocab_size=128256, n_layer=16, n_head=32, n_kv_head=8, d_model=2048,
                         ffn_hidden=8192, rope_theta=500000.0, max_seq_len=131072,
                         tie_embeddings=True,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, **LLAMA3_ROPE)),
    "llama-3.1-8b": dict(vocab_size=128256, n_layer=32, n_head=32, n_kv_head=8, d_model=4096,
                         ffn_hidden=14336, rope_theta=500000.0, max_seq_len=131072,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, **LLAMA3_ROPE)),
    "llama-3.1-70b": dict(vocab_size=128256, n_layer=80, n_head=64, n_kv_head=8, d_model=8192,
                          ffn_hidden=28672, rope_theta=500000.0, max_seq_len=131072,
                          rope_scaling=dict(rope_type="llama3", factor=8.0, **LLAMA3_ROPE)),
}


def config_from_preset(name, **overrides):
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides})


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # statistics in float32 whatever the activation dtype (bf16 squares lose digits), like the
        # reference
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_tables(config, device):
    """cos, sin: (max_seq_len, D/2) float32, looked up by position id."""
    dim, base = config.head_dim, config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # (D/2,)
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend smoothly in between
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / hi) * ~(wavelen > old_len / lo)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    elif kind != "default":
        raise ValueError(f"rope_scaling.rope_type={kind!r} is not supported (supported: default, "
                         "linear, llama3)")
    freqs = torch.outer(torch.arange(config.max_seq_len, device=device, dtype=torch.float32),
                        inv_freq.to(device))
    return freqs.cos(), freqs.sin()


def rope_reference(q, k, cos, sin, position_ids):
    """q: (T, Hq, D), k: (T, Hkv, D); cos/sin: (P, D/2) float32. Hugging Face's rotate_half layout,
    math in float32."""
    c, s = cos[position_ids][:, None, :], sin[position_ids][:, None, :]  # (T, 1, D/2)

    def rotate(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


# None: fused where it runs (rope_fusable), else the reference; tests may force "fused"
ROPE_BACKEND = None


# the Triton kernel: CUDA, a power-of-two head dim >= 16 (not 80, 96, a toy's 8)
def rope_fusable(is_cuda, head_dim):
    return is_cuda and kernels.HAS_TRITON and kernels.rope_fits(head_dim)


def apply_rope(q, k, cos, sin, position_ids):
    if ROPE_BACKEND == "fused" or (ROPE_BACKEND is None and rope_fusable(q.is_cuda, q.shape[-1])):
        return kernels.rope_fused(q, k, cos, sin, position_ids)
    return rope_reference(q, k, cos, sin, position_ids)


# device type -> backend name (tests may set it), fixed at import: a dict filled in a compiled call
# fails its guard once
_ATTN_BACKEND = dict(cpu="sdpa", cuda="flash_attn" if flash_attn_varlen_func is not None
                     else "torch_varlen"
                     if varlen_attn is not None else "sdpa")


def attention_backend(device, dtype):
    # the flash kernels take half precision only; a float32 run (e.g. a parity test) uses the exact
    # fallback
    return _ATTN_BACKEND.get(device.type, "sdpa") if dtype in (torch.float16,
                                                               torch.bfloat16) else "sdpa"


def varlen_attention(q, k, v, cu_seqlens, max_seqlen, sliding_window=None, cu_seqlens_k=None,
                     max_seqlen_k=None, kv_index=None):
    """Causal attention within each packed sequence: q (T, Hq, D), k/v (T, Hkv, D) -> (T, Hq, D).
    With cu_seqlens_k, k/v are (Tk, Hkv, D) (with kv_index: k[kv_index]), query segment i
    attending to key segment i aligned at the bottom right (as flash-attn)."""
    backend = attention_backend(q.device, q.dtype)
    if backend == "sdpa":  # it reads k[kv_index] in its own gather
        return grouped_sdpa(q, k, v, cu_seqlens, sliding_window, cu_seqlens_k, kv_index)
    if kv_index is not None:  # gradients add back into the prompt's rows
        k, v = k.index_select(0, kv_index), v.index_select(0, kv_index)
    left = -1 if sliding_window is None else sliding_window - 1  # tokens seen before the query
    cu_k, max_k = (cu_seqlens, max_seqlen) if cu_seqlens_k is None else (cu_seqlens_k, max_seqlen_k)
    if backend == "flash_attn":
        return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_k, max_seqlen, max_k, causal=True,
                                      window_size=(left, 0))
    if backend == "torch_varlen" and (sliding_window is None or "window_size" in VARLEN_KEYWORDS):
        causal = dict(is_causal=True)
        if "window_size" in VARLEN_KEYWORDS:
            causal = dict(window_size=(left, 0))
        if "enable_gqa" in VARLEN_KEYWORDS:
            causal["enable_gqa"] = q.shape[1] != k.shape[1]
        elif q.shape[1] != k.shape[1]:
            # a release whose varlen_attn takes as many K/V heads as query heads
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        return varlen_attn(q, k, v, cu_seqlens, cu_k, max_seqlen, max_k, **causal)
    return grouped_sdpa(q, k, v, cu_seqlens, sliding_window, cu_seqlens_k)


class Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        C, H, Hkv, D = config.d_model, config.n_head, config.n_kv_head, config.head_dim
        self.q_proj = nn.Linear(C, H * D, bias=config.qkv_bias)
        self.k_proj = nn.Linear(C, Hkv * D, bias=config.qkv_bias)
        self.v_proj = nn.Linear(C, Hkv * D, bias=config.qkv_bias)
        self.o_proj = nn.Linear(H * D, C, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(D, config.norm_eps)
            self.k_norm = RMSNorm(D, config.norm_eps)
        self.use_rope = layer_idx not in config.nope_layers

    def forward(self, x, rope, position_ids, cu_seqlens, max_seqlen, kv=None, cache=None):
        T, cfg = x.shape[0], self.config
        q = self.q_proj(x).view(T, cfg.n_head, cfg.head_dim)
        k = self.k_proj(x).view(T, cfg.n_kv_head, cfg.head_dim)
        v = self.v_proj(x).view(T, cfg.n_kv_head, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q, k = apply_rope(q, k, *rope, position_ids)
        # under autocast float32 norm weights promote q, k; SDPA's autocast casts
        q, k = q.to(v.dtype), k.to(v.dtype)
        # a key stream of its own: e.g. the shared prompt's keys again for a rejected response
        if kv is not None:
            # context parallel: kv_index reads K/V all-gathered over the group kv[3] (context.py)
            if len(kv) > 3:
                k, v = kv[3].gather(torch.cat([k, v], 1)).chunk(2, 1)  # one collective for both
            y = varlen_attention(q, k, v, cu_seqlens, max_seqlen, cfg.sliding_window, kv[1], kv[2],
                                 kv_index=kv[0])
        elif cache is None:
            y = varlen_attention(q, k, v, cu_seqlens, max_seqlen, cfg.sliding_window)  # (T, H, D)
        else:
            y = cache.attend(q, k, v, cu_seqlens, max_seqlen, cfg.sliding_window)
        return self.o_proj(y.reshape(T, -1))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(config.ffn_hidden, config.d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.input_layernorm = RMSNorm(config.d_model, config.norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, rope, position_ids, cu_seqlens, max_seqlen, kv=None, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), rope, position_ids, cu_seqlens, max_seqlen,
                               kv, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        # Module names follow Hugging Face's Llama so checkpoints map one-to-one (see hf.py)
        self.embed_tokens = nn.Embedding(config.padded_vocab_size, config.d_model)
        self.layers = nn.ModuleList([Block(config, i) for i in range(config.n_layer)])
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = (None if config.tie_embeddings else
                        nn.Linear(config.d_model, config.padded_vocab_size, bias=False))
        self._rope = {}  # device -> (cos, sin); kept out of the state dict and out of .to(dtype)
        # recompute each block in backward: less memory, ~1/3 more compute
        self.activation_checkpointing = False
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        # GPT-2 style N(0, 0.02), residual-branch outputs scaled by 1/sqrt(2 * n_layer): variance
        # stays flat in depth
        std = 0.02
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif name.endswith("norm.weight"):
                # the layer norms, the final norm, Qwen3's q_norm / k_norm
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, std / math.sqrt(2 * self.config.n_layer))
            else:
                p.normal_(0.0, std)
        self.head_weight()[self.config.vocab_size:].zero_()

    def head_weight(self):
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def rope(self, device):
        if device not in self._rope:
            self._rope[device] = rope_tables(self.config, device)
        return self._rope[device]

    def hidden_states(self, input_ids, position_ids=None, cu_seqlens=None, max_seqlen=None, kv=None,
                      cache=None):
        """The trunk: (T,) token ids -> (T, d_model) final-normed hidden states."""
        T = input_ids.shape[0]
        if cu_seqlens is None:  # a plain (T,) call is one sequence
            cu_seqlens, max_seqlen = torch.tensor([0, T], dtype=torch.int32,
                                                  device=input_ids.device), T
        if position_ids is None:
            assert cu_seqlens.numel() == 2, \
                "packed input needs position_ids restarting at 0 per sequence"
            position_ids = torch.arange(T, device=input_ids.device)
        if max_seqlen is None:
            # host sync; the packer passes it
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        # a shared rest's positions start past 0
        longest = max_seqlen if kv is None else max(max_seqlen, kv[2])
        if longest > self.config.max_seq_len:
            raise ValueError(f"a sequence of {longest} tokens exceeds "
                             f"max_seq_len={self.config.max_seq_len} (the RoPE table size); raise "
                             "max_seq_len in the config or use shorter sequences")
        rope = self.rope(input_ids.device)
        if cache is not None:
            cache.begin(position_ids, cu_seqlens, max_seqlen, self.config.sliding_window)
        x = self.embed_tokens(input_ids)
        for block in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, rope, position_ids, cu_seqlens,
                                                      max_seqlen, kv,
                                                      use_reentrant=False)
            else:
                x = block(x, rope, position_ids, cu_seqlens, max_seqlen, kv, cache)
        return self.norm(x)

    def forward(self, input_ids, position_ids=None, cu_seqlens=None, max_seqlen=None, targets=None,
                loss_weights=None, logprobs=False, logits_at=None, cache=None, target_rows=None,
                kv=None, temperature=1.0, head=None):
        """All uses go through forward, so that the DDP / FSDP2 wrappers' hooks run (gradient sync,
        all-gathers):
          targets:                 (summed cross-entropy float32, number of targets),
                                   loss_weights (T,) per position
          targets, logprobs=True:  (T,) float32 log p(targets[t]), 0 where ignored (DPO);
                                   p = softmax(logits / temperature): RL's at its sampling one
          no targets:              logits (T, vocab_size), or only at the rows logits_at
                                   (generation)
        targets (T,): each position's next token, -100 where none; with target_rows (K,), row
        target_rows[i]'s (a shared prompt's last row predicts two). cache: generate.KVCache,
        max_seqlen counting the cached tokens. head: f(h, w, targets, vocab_size) in place of the
        LM head (distillation: the teacher's states, the student's loss through both heads)."""
        h = self.hidden_states(input_ids, position_ids, cu_seqlens, max_seqlen, kv, cache)
        if target_rows is not None:
            h = h.index_select(0, target_rows)  # (K, d): the gradient of a row used twice is summed
        w, V = self.head_weight(), self.config.vocab_size
        if head is not None:
            return head(h, w, targets, V)
        if targets is None:
            h = h if logits_at is None else h[logits_at]
            return F.linear(h, w)[:, :V]
        if logprobs:
            return kernels.chunked_logprobs(h, w, targets, V, temperature)
        return kernels.chunked_cross_entropy(h, w, targets, V, loss_weights)

    def flops_per_token(self, seq_lens, head_tokens=None, key_lens=None):
        """Training FLOPs per real token of a packed batch: 6 per matmul parameter (4 if frozen: no
        weight gradient), plus causal attention from the actual lengths, 6 * n_layer * H * D *
        sum(L^2) / sum(L) (QK^T and AV: 4 L^2 H D, halved by the mask, x3 with backward); Lq queries
        over key_lens Lk score Lq (2 Lk - Lq) / 2 pairs. head_tokens: the LM head runs on the target
        tokens alone."""
        cfg = self.config
        lens = torch.as_tensor(seq_lens, dtype=torch.float64)
        n_tokens = float(lens.sum())
        keys = lens if key_lens is None else torch.as_tensor(key_lens, dtype=torch.float64)
        scored = lens * (2 * keys - lens)  # L^2 where Lk = Lq
        per_param = lambda p: p.numel() * (6 if p.requires_grad else 4)
        head_weight = self.head_weight()
        head = cfg.d_model * cfg.vocab_size * per_param(head_weight) / head_weight.numel()
        # a lookup is no matmul; the head: above
        tables = {id(self.embed_tokens.weight), id(self.head_weight())}
        trunk = sum(per_param(p) for p in self.parameters() if id(p) not in tables)
        head_share = 1.0 if head_tokens is None else head_tokens / n_tokens
        attn = 6 * cfg.n_layer * cfg.n_head * cfg.head_dim * float(scored.sum()) / n_tokens
        return trunk + head * head_share + attn
