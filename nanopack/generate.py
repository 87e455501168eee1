"""
Generation with a KV cache in slots: a batch of prompts is read once, in one packed prefill (however
many replies each gets), each prompt's cache copied to its replies' slots, then each new token is
one decode step over the unfinished replies (no padding anywhere). A reply that ends frees its slot
for the next prompt waiting (continuous batching). Sampling is one vectorised draw for the batch,
its noise a hash of (seed, prompt key, reply, token index): a reply's tokens do not depend on what
else is in the batch, on the slot it ran in, on the world size or on a resume.
"""
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from model import varlen_attention
from nanopack.attention import alike_groups
from nanopack.decode_graphs import DecodeGraphs, cuda_capture

M32 = 0xFFFFFFFF


class KVCache:
    """Per layer a buffer (slots, Hkv, capacity + spare, D), slot s holding one sequence's keys
    (values) at their positions. Each forward calls begin() once, then each layer attend(). Set by
    the caller: `rows` (B,), each sequence's slot (default 0..B-1); `continuing`, whether a prefill
    appends to live slots; `columns` (B,), where a decode step's tokens are written and read up to
    (default their positions; CUDA graphs send their pads to the spare column past `capacity`). A
    prefill from position 0 attends within the packed stream, as without a cache; a decode step
    (one new token per row) over its slot's positions 0..position, all rows in one SDPA call; a
    continuation (tokens appended to live slots) over their slots, one call a group of alike
    lengths."""

    def __init__(self, slots, capacity, spare=0):
        self.slots, self.capacity, self.spare = slots, capacity, spare
        self.rows, self.continuing, self.columns = None, False, None
        # per layer (slots, Hkv, capacity + spare, D), made at the first write, in k's dtype
        self.k, self.v = [], []

    def begin(self, position_ids, cu_seqlens, max_seqlen, sliding_window):
        T, B = position_ids.shape[0], cu_seqlens.shape[0] - 1
        device = position_ids.device
        slot = torch.arange(B, device=device) if self.rows is None else self.rows
        assert len(slot) == B, f"a forward of {B} sequences with {len(slot)} cache rows"
        self.layer = 0  # the next attend() is this layer's
        # a prefill of length-1 prompts is also one token per row: the same arithmetic
        self.decoding = T == B
        self.rows_of = slot  # (B,)
        self.slot = torch.repeat_interleave(slot, cu_seqlens.diff(), output_size=T)  # (T,)
        self.pos = position_ids if self.columns is None else self.columns
        self.length, self.window = max_seqlen, sliding_window
        # rows 0..B-1 in order: the buffers' first rows are a view, not a copy
        self.in_order = self.rows is None
        key_pos = torch.arange(max_seqlen, device=device)
        if self.decoding:
            self.mask = self.sees(key_pos, self.pos)[:, None, None, :]  # (B, 1, 1, L)

    def sees(self, key_pos, query_pos):
        """(Q, L) causal (and windowed): unwritten or stale slots lie past each position."""
        seen = key_pos <= query_pos[:, None]
        if self.window is not None:
            seen &= key_pos > query_pos[:, None] - self.window
        return seen

    # eager even when compiled: in-place writes to a Python object's buffers, and no layer index to
    # specialise on
    @torch.compiler.disable
    def attend(self, q, k, v, cu_seqlens, max_seqlen, sliding_window):
        if self.layer == len(self.k):
            shape = (self.slots, k.shape[1], self.capacity + self.spare, k.shape[2])
            self.k.append(k.new_zeros(shape))
            self.v.append(v.new_zeros(shape))
        k_buf, v_buf = self.k[self.layer], self.v[self.layer]
        self.layer += 1
        k_buf[self.slot, :, self.pos] = k  # (T, Hkv, D) scattered to (slot, :, position)
        v_buf[self.slot, :, self.pos] = v
        if not self.decoding:
            if not self.continuing:
                return varlen_attention(q, k, v, cu_seqlens, max_seqlen, sliding_window)
            return self.continuation(q, k_buf, v_buf, cu_seqlens)
        B, H, D = q.shape
        rows = slice(0, B) if self.in_order else self.rows_of
        k, v = k_buf[rows, :, :self.length], v_buf[rows, :, :self.length]  # (B, Hkv, L, D)
        # GQA without repeating K/V: the query heads that share a K/V head become its query rows
        q = q.view(B, k.shape[1], H // k.shape[1], D)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask).reshape(B, H, D)

    def continuation(self, q, k_buf, v_buf, cu):
        """Tokens appended to live slots: each sequence's queries over its slot's keys so far, one
        SDPA call per group of alike lengths (attention.alike_groups: one long observation pads no
        short ones)."""
        out, lengths = torch.empty_like(q), cu.diff().tolist()
        for group, _ in alike_groups(lengths, [self.length] * len(lengths)):
            if lengths[group[0]]:
                self.group_attention(q, k_buf, v_buf, cu, group, out)
        return out

    def group_attention(self, q, k_buf, v_buf, cu, group, out):
        """continuation() for the sequences in group (indices), their queries padded to the
        longest's, written into out at their tokens."""
        index = torch.tensor(group, device=q.device)
        start, n = cu[index], cu[index + 1] - cu[index]
        B, (H, D), Hkv = len(group), q.shape[1:], k_buf.shape[1]
        most = int(n.max())
        j = torch.arange(most, device=q.device)
        # (B, most): each padded query's token (a pad repeats the sequence's last)
        at = start[:, None] + torch.minimum(j, n[:, None] - 1)
        qi = q[at].transpose(1, 2).reshape(B, Hkv, H // Hkv * most, D)
        slots = self.rows_of[index]
        k, v = k_buf[slots, :, :self.length], v_buf[slots, :, :self.length]
        mask = self.sees(torch.arange(self.length, device=q.device), self.pos[at].reshape(-1))
        mask = mask.view(B, 1, 1, most, -1).expand(-1, -1, H // Hkv, -1, -1)
        y = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask.reshape(B, 1, -1, self.length))
        y = y.reshape(B, H, most, D).transpose(1, 2)  # (B, most, H, D)
        real = j < n[:, None]  # the pads dropped
        out[at[real]] = y[real]

    def move(self, sources, targets, length):
        """Slot sources[i]'s first `length` positions into slot targets[i], all read first (so a
        pair of moves swaps two slots)."""
        index = torch.as_tensor(sources, device=self.k[0].device)
        into = torch.as_tensor(targets, device=self.k[0].device)
        for buf in self.k + self.v:
            buf[into, :, :length] = buf[index, :, :length]


def mix(x):
    """A 32-bit integer hash (lowbias32's shape; multipliers under 2**31, so int64 products never
    overflow): works alike on Python ints and int64 tensors."""
    x = x & M32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & M32
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & M32
    return x ^ (x >> 16)


def stream(seed, key, reply):
    """A reply's random stream: its seed, its prompt's key (e.g. its position in the prompt stream)
    and its index among the prompt's replies."""
    return mix(mix(mix(seed) ^ key) ^ reply)


def uniforms(streams, token_index):
    """(B,) streams and token indices -> (B,) float32 uniforms in (0, 1), 24 bits each."""
    return ((mix(streams ^ mix(token_index)) >> 8).float() + 0.5) / 2**24


def sample(logits, temperature=0.0, top_k=None, top_p=None, noise=None):
    """(B, V) float logits -> (B,) next ids and (B,) their log-probs under softmax(logits /
    temperature) (the trainer's; at temperature 0, softmax(logits)). Argmax at temperature 0, else
    the inverse CDF at noise (B,) uniforms of softmax(logits / temperature) kept to the top_k tokens
    and to the nucleus (the fewest most likely tokens reaching top_p)."""
    if temperature == 0.0:
        ids = logits.argmax(-1)
        return ids, logits.gather(1, ids[:, None])[:, 0] - logits.logsumexp(-1)
    logits = logits / temperature
    nucleus = top_p is not None and top_p < 1.0
    # the candidates: the top_k sorted, or every token (sorted when the nucleus needs it)
    if top_k is not None:
        values, order = torch.topk(logits, min(top_k, logits.shape[-1]))
    elif nucleus:
        values, order = logits.sort(-1, descending=True)
    else:
        values, order = logits, None
    probs = torch.softmax(values, -1)
    # 1.0 skipped: a float cumsum may reach 1 before the last tokens
    if nucleus:
        # the tokens before it already reach top_p
        probs = probs.masked_fill(probs.cumsum(-1) - probs >= top_p, 0.0)
    cdf = probs.cumsum(-1)
    # the first candidate whose cumulative probability reaches the draw: never one of probability 0
    pick = torch.searchsorted(cdf, (noise * cdf[:, -1])[:, None]).clamp_(max=cdf.shape[1] - 1)
    ids = (pick if order is None else order.gather(1, pick))[:, 0]
    return ids, logits.gather(1, ids[:, None])[:, 0] - logits.logsumexp(-1)


def packed(pieces, starts, device):
    """Token lists, each from position starts[i] on -> (ids, positions, cu_seqlens, each one's last
    index), made on the host (plan.py keeps them real under fake tensors)."""
    lens = [len(p) for p in pieces]
    cu = np.cumsum([0] + lens)
    pos = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)])
    ids = np.fromiter((t for p in pieces for t in p), dtype=np.int64, count=cu[-1])
    return (torch.from_numpy(ids).to(device), torch.from_numpy(pos).to(device),
            torch.from_numpy(cu.astype(np.int32)).to(device),
            torch.from_numpy(cu[1:] - 1).to(device))


@dataclass
class Sampling:
    """How replies are drawn: the settings a serving engine (vLLM's SamplingParams) takes."""
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = None
    top_p: float = None
    stop_ids: tuple = ()
    seed: int = 0


@dataclass
class Reply:
    """One reply: its tokens, each one's log-prob as the sampler computed it, and where it stands
    (its slot while live; ended by a stop token, by max_new_tokens, or by max_seq_len)."""
    prompt: list
    stream: int
    max_new_tokens: int
    tokens: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    slot: int = None
    cached: int = 0  # tokens of prompt + reply in its slot's cache
    done: bool = False


class Engine:
    """The seam where a serving backend (vLLM, SGLang) would plug in: prompts and Sampling in,
    Replies (ids and the sampler's log-probs) out, weights_updated() after each optimizer step.
    This one runs the trainer's own model in this process, so its weights are always current.

    slots: replies decoded at once (default: all of a call's, as memory allows); a reply that ends
    frees its slot for the next waiting prompt, whose replies all need one. compile: the decode step
    through torch.compile. keep_slots: a reply keeps its slot when it ends, so that extend() can
    append to it (multi-turn). kv_cache=False re-reads every sequence whole for each token: the
    reference the cache is tested against. sync_ranks (FSDP: every forward is a collective): ranks
    step together until all are done, one with nothing left running a dummy forward. cuda_graphs:
    the decode step replayed as CUDA graphs (decode_graphs.py; capture: a test's stand-in), the
    KV cache kept from call to call while it holds the call."""

    def __init__(self, model, slots=None, compile=False, keep_slots=False, kv_cache=True,
                 sync_ranks=False, cuda_graphs=False, capture=cuda_capture):
        if cuda_graphs and (sync_ranks or not kv_cache or compile):
            raise ValueError("cuda_graphs replays the decode step over a KV cache on one rank: not "
                             "with sync_ranks (FSDP), kv_cache=False or compile")
        self.model, self.slots, self.keep_slots = model, slots, keep_slots
        self.kv_cache, self.sync_ranks, self.cache = kv_cache, sync_ranks, None
        self.graphs, self.capture = None, capture if cuda_graphs else None
        self.step_model = torch.compile(model, dynamic=True) if compile else model
        self.device = next(model.parameters()).device
        self.positions = model.config.max_seq_len

    def weights_updated(self):
        """After each optimizer step: a backend holding its own copy of the weights reloads them
        here; this one reads the trainer's."""

    def generate(self, prompts, sampling, num_samples=1, keys=None, capacity=None):
        """prompts: token-id lists -> num_samples Replies to each, reply j to prompt i at
        i * num_samples + j. keys: each prompt's key for its replies' random streams (default its
        index). sampling.max_new_tokens: one for all, or a list with one per reply."""
        longest = max(map(len, prompts), default=0)
        if longest >= self.positions:
            raise ValueError(f"a prompt of {longest} tokens leaves no room for a reply: the model "
                             f"reads at most max_seq_len={self.positions} tokens")
        keys = range(len(prompts)) if keys is None else keys
        limits = sampling.max_new_tokens
        if isinstance(limits, int):
            limits = [limits] * (len(prompts) * num_samples)
        groups = [[Reply(list(p), stream(sampling.seed, key, j), limits[i * num_samples + j])
                   for j in range(num_samples)] for i, (p, key) in enumerate(zip(prompts, keys))]
        if self.kv_cache and prompts:
            slots = self.slots or len(prompts) * num_samples
            if slots < num_samples:
                raise ValueError(f"slots={slots} cannot hold a prompt's {num_samples} replies")
            replies = len(prompts) * num_samples
            if self.keep_slots and slots < replies:
                # a kept slot is never freed: the replies past the slots would wait forever
                raise ValueError(f"keep_slots needs a slot for each of the {replies} replies, "
                                 f"not slots={slots}")
            capacity = capacity or min(longest + max(limits), self.positions)
            self.cache = self.cache_for(slots, capacity)
            self.free, self.holder = list(range(slots)), {}  # holder: slot -> its reply
        self.run(groups, sampling)
        return [r for g in groups for r in g]

    def cache_for(self, slots, capacity):
        """A new KV cache, or with CUDA graphs the last one where it holds the call (its graphs
        read it): a spare column for the pads, its capacity in steps of 64 positions."""
        if self.capture is None:
            return KVCache(slots, capacity)
        cache = self.cache
        if cache is None or cache.slots != slots or cache.capacity < capacity:
            cache = KVCache(slots, min(-(-capacity // 64) * 64, self.positions), spare=1)
            self.graphs = DecodeGraphs(self.model, cache, self.capture)
        return cache

    def extend(self, replies, observations, more, sampling):
        """Multi-turn: each reply's observation (token list) appended to its live slot, all read in
        one more prefill, then up to more[i] new tokens sampled after them (logprobs: NaN for the
        appended tokens, which were not sampled)."""
        for r, tokens, n in zip(replies, observations, more):
            assert r.slot is not None or not self.kv_cache, "extend() needs keep_slots=True"
            # the last position fed: past the capacity it would land in no slot (or the spare)
            need = min(len(r.prompt) + len(r.tokens) + len(tokens) + max(n, 1) - 1,
                       self.positions - 1)
            if self.kv_cache and need > self.cache.capacity:
                raise ValueError(f"extend: a reply of {len(r.prompt) + len(r.tokens)} tokens, "
                                 f"{len(tokens)} appended and up to {n} new ones needs {need} "
                                 f"cache positions, the cache has {self.cache.capacity}: give "
                                 f"generate() capacity= the longest whole conversation")
            r.tokens += tokens
            r.logprobs += [float("nan")] * len(tokens)
            r.max_new_tokens, r.done = len(r.tokens) + n, False
        self.run([[r] for r in replies], sampling)
        return replies

    @torch.no_grad()
    def run(self, waiting, sampling):
        """Steps until every reply of `waiting` (groups: a prompt's replies, prefilled once) ends:
        each step either prefills the groups that found slots or decodes the live replies."""
        waiting, live = list(waiting), []
        while True:
            busy = bool(waiting or live)
            if self.sync_ranks:
                busy = torch.tensor(int(busy), device=self.device)
                torch.distributed.all_reduce(busy, op=torch.distributed.ReduceOp.MAX)
                busy = busy.item() > 0
            if not busy:
                break
            admitted = self.admit(waiting)
            if admitted:
                self.prefill(admitted, sampling)
                live += [r for group in admitted for r in group]
            elif live:
                self.decode(live, sampling)
            else:
                # this rank is done, another is not: its forward is a collective
                self.model(torch.zeros(1, dtype=torch.long, device=self.device))
            live = [r for r in live if not r.done]

    def admit(self, waiting):
        """The waiting groups, first come first served, that find a slot for each of their
        replies (a continued reply has its own)."""
        admitted = []
        while waiting and (not self.kv_cache or waiting[0][0].slot is not None
                           or len(waiting[0]) <= len(self.free)):
            group = waiting.pop(0)
            for r in group:
                if self.kv_cache and r.slot is None:
                    r.slot = self.free.pop(0)
                    self.holder[r.slot] = r
            admitted.append(group)
        return admitted

    def prefill(self, groups, sampling):
        """Each group's uncached tokens read once, into its first reply's slot, copied to the other
        replies' slots; each reply's next token drawn from the group's last logits."""
        if not self.kv_cache:
            replies = [r for g in groups for r in g]
            return self.draw(replies, self.reread(replies), sampling)
        firsts = [g[0] for g in groups]
        seqs = [r.prompt + r.tokens for r in firsts]
        logits = self.forward([s[r.cached:] for s, r in zip(seqs, firsts)],
                              [r.cached for r in firsts], [r.slot for r in firsts],
                              max(map(len, seqs)))
        # the prompts' caches to their other replies' slots, one copy for all
        copies = [(g[0].slot, r.slot) for g in groups for r in g[1:]]
        if copies:
            self.cache.move(*zip(*copies), max(map(len, seqs)))
        for group, seq in zip(groups, seqs):
            for r in group:
                r.cached = len(seq)
        each = torch.tensor([i for i, g in enumerate(groups) for _ in g], device=logits.device)
        self.draw([r for g in groups for r in g], logits[each], sampling)

    def decode(self, live, sampling):
        """One new token for each live reply: its newest token read at its position."""
        if not self.kv_cache:
            return self.draw(live, self.reread(live), sampling)
        self.compact(live)
        if self.graphs is not None:
            logits = self.graphs.step([r.tokens[-1] for r in live], [r.cached for r in live])
        else:
            logits = self.forward([r.tokens[-1:] for r in live], [r.cached for r in live],
                                  [r.slot for r in live], max(r.cached for r in live) + 1,
                                  self.step_model)
        for r in live:
            r.cached += 1
        self.draw(live, logits, sampling)

    def compact(self, live):
        """The live replies moved into slots 0..len(live)-1 (a free slot taken, a kept reply's
        swapped), in slot order: a decode step then reads the cache's first rows as a view, where
        scattered slots cost a gather a layer."""
        n = len(live)
        held = {r.slot for r in live}
        holes = [s for s in range(n) if s not in held]
        sources, targets, length = [], [], 0
        for r, s in zip([r for r in live if r.slot >= n], holes):
            other = self.holder.get(s)
            sources.append(r.slot)
            targets.append(s)
            length = max(length, r.cached)
            if other is None:
                self.free[self.free.index(s)] = r.slot
                del self.holder[r.slot]
            else:  # a kept reply's slot: the two swap
                sources.append(s)
                targets.append(r.slot)
                length = max(length, other.cached)
                other.slot, self.holder[r.slot] = r.slot, other
            r.slot, self.holder[s] = s, r
        if sources:
            self.cache.move(sources, targets, length)
        live.sort(key=lambda r: r.slot)

    def reread(self, replies):
        """Without a cache: each reply's whole sequence read again -> (B, V) its last logits."""
        seqs = [r.prompt + r.tokens for r in replies]
        return self.forward(seqs, [0] * len(seqs), None, max(map(len, seqs)))

    def forward(self, pieces, starts, slots, max_len, model=None):
        """Packed pieces at their positions, in their cache slots -> (B, V) float32 logits of each
        one's last token."""
        inputs = packed(pieces, starts, self.device)
        if self.cache is not None:
            # slots 0..B-1 in order: the cache reads its buffers' first rows as a view
            in_order = slots is None or slots == list(range(len(slots)))
            self.cache.rows = None if in_order else torch.tensor(slots, device=self.device)
            self.cache.continuing, self.cache.columns = any(starts), None
        # through forward, not the trunk directly, so that FSDP2's root hooks gather the embeddings
        # and head
        model = self.model if model is None else model
        return model(*inputs[:3], max_len, logits_at=inputs[3],
                     cache=self.cache if self.kv_cache else None).float()

    def draw(self, replies, logits, sampling):
        """Each reply's next token from its (B, V) logits, with its own stream's noise; a reply
        ends at a stop token, at its max_new_tokens or where the model has no positions left."""
        noise = None
        if sampling.temperature:
            streams = torch.tensor([r.stream for r in replies], device=logits.device)
            index = torch.tensor([len(r.tokens) for r in replies], device=logits.device)
            noise = uniforms(streams, index)
        ids, logps = sample(logits, sampling.temperature, sampling.top_k, sampling.top_p, noise)
        stop_ids = set(sampling.stop_ids)
        for r, t, logp in zip(replies, ids.tolist(), logps.tolist()):
            r.tokens.append(t)
            r.logprobs.append(logp)
            r.done = (t in stop_ids or len(r.tokens) >= r.max_new_tokens
                      or len(r.prompt) + len(r.tokens) >= self.positions)
            if r.done and r.slot is not None and not self.keep_slots:
                self.free.append(r.slot)
                del self.holder[r.slot]
                r.slot = None


def generate(model, prompts, max_new_tokens, stop_ids=(), temperature=0.0, top_k=None, seed=0,
             keys=None, sync_ranks=False, kv_cache=True, num_samples=1, top_p=None, slots=None,
             logprobs=False):
    """prompts: token-id lists -> the new tokens of num_samples replies to each, reply j to prompt i
    at i * num_samples + j, the stop token included (and with logprobs, each token's log-prob as
    the sampler computed it); a reply also stops where prompt + reply fill max_seq_len. Reply j of
    prompt i draws from the stream (seed, keys[i], j). See Engine for the rest."""
    sampling = Sampling(max_new_tokens, temperature, top_k, top_p, tuple(stop_ids), seed)
    engine = Engine(model, slots, kv_cache=kv_cache, sync_ranks=sync_ranks)
    replies = engine.generate(prompts, sampling, num_samples, keys)
    ids = [r.tokens for r in replies]
    return (ids, [r.logprobs for r in replies]) if logprobs else ids
