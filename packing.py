"""
Lengths in, packed micro-batches out. A micro-batch is whole examples back to back, at most `microbatch_tokens`
long, cu_seqlens marking the boundaries attention never crosses: nothing padded, cut or dropped.

Data (data/prepare.py): ids (M,) all tokens; offsets (N+1,), example i is ids[offsets[i]:offsets[i+1]];
loss_mask (M,), 1 on the tokens to learn. A unit travels whole: an SFT example, or a group of group_size adjacent
sequences sharing a prompt (a DPO pair: 2, chosen then rejected; an RL group: k replies). The label shift happens
here, once: the model knows nothing of shifting or boundaries.

Prefix sharing: a group of k sequences that start with the same P tokens (the prompt) is laid out
`prompt | rest 1 | ... | rest k` (positions 0..P-1 | P.. | P..): the prompt is computed once, each later rest attending
to it through a key/value stream of its own (kv_index: each sequence's rows, the prompt's k times; cu_seqlens_k). The
prompt's last row then predicts k tokens, so a group's targets are triples (target_rows, targets, seq_ids).
"""
import heapq
from bisect import bisect_left, insort
from dataclasses import dataclass, replace

import numpy as np
import torch

IGNORE_INDEX = -100  # target value that contributes no loss (Hugging Face convention)


def pack(lengths, token_budget):
    """Best-fit-decreasing: each item, longest first, into the open bin with the least room that fits it (ties: input
    order) -> bins of item indices, in the order opened."""
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    bad = np.flatnonzero((lengths <= 0) | (lengths > token_budget))
    if bad.size:
        i, n = int(bad[0]), int(lengths[bad[0]])
        if n <= 0:
            raise ValueError(f"pack: item {i} has length {n}; every item needs at least one token")
        raise ValueError(f"pack: item {i} has length {n}, over the token budget {token_budget}; "
                         f"raise the budget to at least {n} or re-prepare the data with a max length")
    order = np.argsort(-lengths, kind="stable")
    min_length = int(lengths.min()) if lengths.size else 1
    bins = []     # bins[b] = item indices in bin b
    spaces = []   # sorted distinct free-space values that some open bin has: bisect finds best fit
    bins_with = {}  # free space -> stack of bin ids with exactly that much room
    # free space is an integer <= token_budget: `spaces` stays short, and bisect/insort run in C
    for i, n in zip(order.tolist(), lengths[order].tolist()):
        k = bisect_left(spaces, n)
        if k == len(spaces):  # no open bin has room: open a new one
            b, space = len(bins), token_budget - n
            bins.append([i])
        else:
            space = spaces[k]
            stack = bins_with[space]
            b = stack.pop()
            if not stack:
                del spaces[k], bins_with[space]
            bins[b].append(i)
            space -= n
        if space >= min_length:  # a bin with less room than the shortest item is closed for good
            if space not in bins_with:
                insort(spaces, space)
            bins_with.setdefault(space, []).append(b)
    return bins


def balance(lengths, world_size):
    """Units, longest first, each to the rank with the fewest tokens so far (ties: lowest rank) -> indices per rank."""
    heap = [(0, r) for r in range(world_size)]
    shares = [[] for _ in range(world_size)]
    for u in np.argsort(-np.asarray(lengths), kind="stable").tolist():
        tokens, r = heapq.heappop(heap)
        shares[r].append(u)
        heapq.heappush(heap, (tokens + int(lengths[u]), r))
    return shares


def rank_bins(units, lengths, token_budget, rank=0, world_size=1):
    """This rank's bins of unit indices (lengths: (U,) of every unit), padded with fillers ([]: one dummy token) to as
    many as the busiest rank has, since under DDP and FSDP every forward is a collective."""
    units = np.asarray(units, dtype=np.int64).reshape(-1)
    shares = [units[s] for s in balance(lengths[units], world_size)]
    bins = [[share[b].tolist() for b in pack(lengths[share], token_budget)] if len(share) else [] for share in shares]
    return bins[rank] + [[]] * (max(map(len, bins)) - len(bins[rank]))


def target_counts(data):
    """(N,) trained tokens of each sequence: its mask less its first token, never a target (make_batch)."""
    offsets, mask = np.asarray(data["offsets"], dtype=np.int64), np.asarray(data["loss_mask"])
    if len(offsets) == 1:
        return np.zeros(0, dtype=np.int64)
    return np.add.reduceat(mask[:offsets[-1]], offsets[:-1], dtype=np.int64) - mask[offsets[:-1]]


def unit_lengths(data, group_size=1, prefix=None):
    """(U,) tokens each unit computes: an example, or a group of group_size sequences (its shared prefix once)."""
    lengths = np.diff(np.asarray(data["offsets"], dtype=np.int64)).reshape(-1, group_size).sum(1)
    return lengths if prefix is None else lengths - (group_size - 1) * prefix


def shared_prefixes(data, group_size=2):
    """(U,) tokens all of a group's sequences share at the start, at most one less than any of their lengths, so
    each keeps a token of its own. A lone sequence (group_size 1) shares nothing."""
    offsets, ids = np.asarray(data["offsets"], dtype=np.int64), data["ids"]
    starts = offsets[:-1].reshape(-1, group_size)  # (U, k)
    limit = np.diff(offsets).reshape(-1, group_size).min(1) - 1 if group_size > 1 else np.zeros(len(starts), int)
    shared = np.zeros(len(starts), dtype=np.int64)
    active = np.flatnonzero(limit > 0)
    while active.size:  # one token position per pass, over the groups still equal so far: O(sum of prefixes)
        tokens = ids[starts[active] + shared[active, None]]  # (A, k)
        active = active[(tokens == tokens[:, :1]).all(1)]
        shared[active] += 1
        active = active[shared[active] < limit[active]]
    return shared


def group_data(prompts, replies, masks=None):
    """RL groups as token data: group g is sequences g*k .. g*k+k-1, each `prompt + reply`, trained on the reply
    (masks: 0/1 per reply token; None: all)."""
    seqs = [(p, r, np.ones(len(r)) if masks is None else masks[g][j])
            for g, (p, group) in enumerate(zip(prompts, replies)) for j, r in enumerate(group)]
    cat = lambda parts, dtype: np.concatenate([np.asarray(x, dtype) for x in parts]) if parts else np.zeros(0, dtype)
    return dict(ids=cat([t for p, r, _ in seqs for t in (p, r)], np.int64),
                loss_mask=cat([t for p, _, m in seqs for t in (np.zeros(len(p)), m)], np.uint8),
                offsets=np.cumsum([0] + [len(p) + len(r) for p, r, _ in seqs]).astype(np.int64))


@dataclass
class PackedBatch:
    """N whole sequences back to back (a filler, N = 0, is one dummy token). Targets: SFT, one per position
    (target_rows None); groups, one triple per trained token (target_rows, targets, seq_ids (K,))."""
    input_ids: torch.Tensor        # (T,) long
    targets: torch.Tensor          # (T,) the next token where it is trained, else IGNORE_INDEX; groups (K,) tokens
    target_rows: object            # None, or groups (K,) long: the hidden row that predicts targets[i]
    seq_ids: torch.Tensor          # (T,) sequence 0..N-1 of each position (a filler's token: N); groups (K,)
    position_ids: torch.Tensor     # (T,) long, restarting at 0 for every sequence (P.. for a shared rejected rest)
    cu_seqlens: torch.Tensor       # (N+1,) int32 query segments, one per sequence
    max_seqlen: int                # longest query segment (the kernel sees it)
    kv: object                     # None: keys = queries; prefix sharing: (kv_index (Tk,), cu_seqlens_k, max_seqlen_k)
    units: torch.Tensor            # (U,) long, the data's units in this batch: examples, or groups
    num_sequences: int             # N, real sequences (0 for a filler); groups: seqs j*k .. j*k+k-1 = group j
    num_groups: int                # U for groups (DPO pairs, RL groups), 0 for SFT examples
    num_tokens: int                # real tokens computed (a shared prompt counts once)
    num_target_tokens: int         # trained tokens (rows the LM head scores)
    num_padding: int               # 1 for a filler's dummy token, else 0; a CP slice: its padding rows
    context: object = None         # a CP slice: the context.ContextParallel whose ranks hold the rest of the stream

    def to(self, device):
        move = lambda t: t.to(device, non_blocking=True)
        moved = {k: move(v) for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        if self.kv is not None:
            moved["kv"] = (move(self.kv[0]), move(self.kv[1]), self.kv[2])
        return replace(self, **moved)

    def inputs(self):
        """The model's keyword arguments for this micro-batch: model(**mb.inputs(), logprobs=True)."""
        return dict(input_ids=self.input_ids, position_ids=self.position_ids, cu_seqlens=self.cu_seqlens,
                    max_seqlen=self.max_seqlen, kv=self.kv if self.context is None else (*self.kv, self.context),
                    targets=self.targets, target_rows=self.target_rows)

    def key_lengths(self):
        """Keys each query segment of real tokens attends over (a CP slice: its sequence up to the piece's end)."""
        cu = self.cu_seqlens if self.kv is None else self.kv[1]
        n = self.num_sequences if self.context is None else len(cu) - 1 - (self.num_padding > 0)
        return np.diff(cu.cpu().numpy())[:n]

    def sequence_sums(self, values):
        """values per target -> (N,) per-sequence sums, no host sync; a CP slice's summed over its group (the gradient
        passes through: each rank computes the same loss from them)."""
        sums = values.new_zeros(self.num_sequences + 1)  # + 1: a filler's slot
        sums = sums.index_add_(0, self.seq_ids, values)[:self.num_sequences]
        return sums if self.context is None else self.context.sum(sums)

    def group_sums(self, values, group_size):
        """values per target -> (U, k) per-sequence sums, row u the batch's unit u."""
        return self.sequence_sums(values)[:group_size * len(self.units)].view(len(self.units), group_size)

    def pair_sums(self, values):
        """DPO: values per target -> (chosen (P,), rejected (P,)) per-sequence sums."""
        return self.group_sums(values, 2).unbind(1)


def make_batch(data, units, group_size=1, prefix=None):
    """The data's units as one PackedBatch, sequences j*k .. j*k+k-1 its group j. prefix: shared_prefixes() of the
    data, each group's prompt computed once; None lays every sequence out whole."""
    ids, offsets, loss_mask = data["ids"], data["offsets"], data["loss_mask"]
    units = np.asarray(units, dtype=np.int64).reshape(-1)
    grouped = group_size > 1
    examples = (group_size * units[:, None] + np.arange(group_size)).reshape(-1)
    skip = np.zeros(len(examples), dtype=np.int64)  # leading tokens a sequence takes from the one before it
    if grouped and prefix is not None:
        skip.reshape(-1, group_size)[:, 1:] = prefix[units, None]
    # Per sequence: its tokens, mask, and `rows`, where each of its positions sits in the stream. A shared
    # later sequence appends only its rest; its rows start with the group's prompt rows.
    stream, positions, q_lens, rows, tokens, masks, T = [], [], [], [], [], [], 0
    for e, p in zip(examples.tolist(), skip.tolist()):
        x, m = ids[offsets[e]:offsets[e + 1]].astype(np.int64), loss_mask[offsets[e]:offsets[e + 1]] != 0
        own = np.arange(T, T + len(x) - p)
        rows.append(np.concatenate([rows[-1][:p], own]) if p else own)
        stream.append(x[p:])
        positions.append(np.arange(p, len(x)))
        q_lens.append(len(x) - p)
        tokens.append(x)
        masks.append(m)
        T += len(x) - p
    n_seq, n_tok, n_pad = len(examples), T, int(len(examples) == 0)
    if n_pad:  # a filler: a zero-length micro-batch would trip the attention kernels, so one dummy token
        stream, positions, q_lens = [np.zeros(1, np.int64)], [np.zeros(1, np.int64)], [1]
    cat = lambda arrays: np.concatenate(arrays).astype(np.int64) if arrays else np.zeros(0, np.int64)
    # Position j of a sequence predicts its token j+1 where that one is trained: its first token is never a
    # target, so no loss ever reaches across a packed boundary, whatever the mask says.
    trained = [np.flatnonzero(m[1:]) for m in masks]
    target_rows = cat([r[j] for r, j in zip(rows, trained)])
    targets = cat([x[j + 1] for x, j in zip(tokens, trained)])
    target_seq = np.repeat(np.arange(n_seq), [len(j) for j in trained])
    if grouped:
        seq_ids = target_seq
    else:  # SFT: one target slot per position, the form the loss weights and the tests use
        targets_per_row = np.full(n_tok + n_pad, IGNORE_INDEX, dtype=np.int64)
        targets_per_row[target_rows] = targets
        targets, target_rows = targets_per_row, None
        seq_ids = np.repeat(np.arange(n_seq + n_pad), q_lens)
    kv = None
    if skip.any():  # keys: every sequence's own rows in full, aligned at the bottom right
        k_lens = [len(r) for r in rows]
        kv = (torch.from_numpy(cat(rows)), torch.from_numpy(np.cumsum([0] + k_lens).astype(np.int32)), max(k_lens))
    as_long = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    return PackedBatch(
        input_ids=as_long(cat(stream)), targets=as_long(targets),
        target_rows=None if target_rows is None else as_long(target_rows), seq_ids=as_long(seq_ids),
        position_ids=as_long(cat(positions)), cu_seqlens=torch.from_numpy(np.cumsum([0] + q_lens).astype(np.int32)),
        max_seqlen=max(q_lens), kv=kv, units=as_long(units), num_sequences=n_seq,
        num_groups=len(units) if grouped else 0, num_tokens=n_tok, num_target_tokens=len(target_seq), num_padding=n_pad)


@dataclass
class Step:
    """One optimizer step. Counts are GLOBAL (all ranks): the loss is normalised exactly without communication."""
    microbatches: list        # this rank's PackedBatch list; the same length on every rank
    num_examples: int         # sequences in the step (DPO: 2 * num_groups)
    num_groups: int           # groups (DPO pairs) in the step (0 for SFT)
    num_target_tokens: int    # tokens with a label in the step
    units: np.ndarray         # the step's units, all ranks
    state: dict               # loader state that resumes right after this step


class PackedLoader:
    """One Step per optimizer step, forever (len() = steps per epoch). Step k of epoch e holds the units
    perm[k*B:(k+1)*B] of a permutation seeded by (seed, e): a step's data never depends on world_size or
    microbatch_tokens, so a run resumes on another number of GPUs. Each rank packs a near-equal share (rank_bins).
    state_dict() is the state after the last step returned (or step.state of a step in hand)."""

    def __init__(self, data, batch_size, microbatch_tokens, rank=0, world_size=1, seed=0, group_size=1,
                 prefix_sharing=False, context=None):
        assert 0 <= rank < world_size and batch_size >= 1 and (len(data["offsets"]) - 1) % group_size == 0
        self.data, self.batch_size, self.microbatch_tokens = data, batch_size, microbatch_tokens
        self.context = context  # context parallel (context.py): rank/world are the data-parallel ones; this cuts slices
        self.rank, self.world_size, self.seed, self.group_size = rank, world_size, seed, group_size
        self.prefix = shared_prefixes(data, group_size) if group_size > 1 and prefix_sharing else None
        self.lengths = unit_lengths(data, group_size, self.prefix)  # (U,) tokens per unit, as computed
        self.targets = target_counts(data).reshape(-1, group_size).sum(1)  # (U,) target tokens per unit
        self.steps_per_epoch = -(-len(self.lengths) // batch_size)
        self.epoch, self.step, self.perm_epoch = 0, 0, None

    def __len__(self):
        return self.steps_per_epoch

    def __iter__(self):
        return self

    def __next__(self):
        if self.step >= self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        if self.perm_epoch != self.epoch:
            self.perm = np.random.default_rng((self.seed, self.epoch)).permutation(len(self.lengths))
            self.perm_epoch = self.epoch
        units = self.perm[self.step * self.batch_size:(self.step + 1) * self.batch_size]  # all ranks' units
        bins = rank_bins(units, self.lengths, self.microbatch_tokens, self.rank, self.world_size)
        micro = [make_batch(self.data, b, self.group_size, self.prefix) for b in bins]
        micro = micro if self.context is None else [self.context.split(mb) for mb in micro]
        self.step += 1
        return Step(microbatches=micro, num_examples=len(units) * self.group_size,
                    num_groups=len(units) if self.group_size > 1 else 0,
                    num_target_tokens=int(self.targets[units].sum()), units=units, state=self.state_dict())

    def state_dict(self):
        return dict(epoch=self.epoch, step=self.step, seed=self.seed, batch_size=self.batch_size,
                    num_units=len(self.lengths), group_size=self.group_size)

    def load_state_dict(self, state):
        # world_size and microbatch_tokens may change on resume; what fixes the order may not.
        state = dict(state, group_size=state.get("group_size", 2 if state.get("dpo") else 1))  # saved before groups
        for key in ("seed", "batch_size", "num_units", "group_size"):
            if state[key] != self.state_dict()[key]:
                raise ValueError(f"loader state has {key}={state[key]} but this loader has "
                                 f"{self.state_dict()[key]}; resume with the same data and {key}")
        self.epoch, self.step = state["epoch"], state["step"]
