"""
Lengths in, packed micro-batches out. A micro-batch is whole examples back to back, at most
`microbatch_tokens` long, cu_seqlens marking the boundaries attention never crosses: nothing
padded, cut or dropped.

Data (data/prepare.py): ids (M,) all tokens; offsets (N+1,), example i is
ids[offsets[i]:offsets[i+1]]; loss_mask (M,), 1 on the tokens to learn; units (U+1,) optional,
unit u = sequences units[u]:units[u+1]. A unit travels whole: an SFT example, a group of group_size
adjacent sequences sharing a prompt (a DPO pair: 2, chosen then rejected; an RL group: k replies),
or a conversation's turn examples (reasoning_turns='each': data["units"]). The label shift happens
here, once: the model knows nothing of shifting or boundaries.

Prefix sharing: each sequence of a unit computes only what it does not share with the one before
it, a tree laid out `trunk | branch 2 | ... | branch n`: a pair or group `prompt | rest 1 | ... |
rest k` (positions 0..P-1 | P.. | P..), a conversation's turn j after the history turn j - 1. Each
branch attends to the rows it shares and to its own through a key/value stream of its own
(kv_index: each sequence's rows; cu_seqlens_k). A shared row then predicts several tokens, so such
a batch's targets are triples (target_rows, targets, seq_ids).
"""
import heapq
from bisect import bisect_left, insort
from dataclasses import dataclass, replace

import numpy as np
import torch

# a target that contributes no loss (Hugging Face convention)
IGNORE_INDEX = -100


def pack(lengths, token_budget):
    """Best-fit-decreasing: each item, longest first, into the open bin with the least room that
    fits it (ties: input order) -> bins of item indices, in the order opened."""
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    bad = np.flatnonzero((lengths <= 0) | (lengths > token_budget))
    if bad.size:
        i, n = int(bad[0]), int(lengths[bad[0]])
        if n <= 0:
            raise ValueError(
                f"pack: item {i} has length {n}; every item needs at least one token")
        raise ValueError(
            f"pack: item {i} has length {n}, over the token budget {token_budget}; "
            f"raise the budget to at least {n} or re-prepare the data with a max length")
    order = np.argsort(-lengths, kind="stable")
    min_length = int(lengths.min()) if lengths.size else 1
    # bins[b]: item indices in bin b
    bins = []
    # the open bins' distinct free spaces, sorted: bisect finds the best fit. Integers <=
    # token_budget, so the list stays short and bisect/insort run in C
    spaces = []
    # free space -> stack of bin ids with exactly that much room
    bins_with = {}
    for i, n in zip(order.tolist(), lengths[order].tolist()):
        k = bisect_left(spaces, n)
        if k == len(spaces):
            # no open bin has room: open a new one
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
        # a bin with less room than the shortest item is closed for good
        if space >= min_length:
            if space not in bins_with:
                insort(spaces, space)
            bins_with.setdefault(space, []).append(b)
    return bins


def balance(lengths, world_size):
    """Units, longest first, each to the rank with the fewest tokens so far (ties: lowest rank)
    -> indices per rank."""
    heap = [(0, r) for r in range(world_size)]
    shares = [[] for _ in range(world_size)]
    for u in np.argsort(-np.asarray(lengths), kind="stable").tolist():
        tokens, r = heapq.heappop(heap)
        shares[r].append(u)
        heapq.heappush(heap, (tokens + int(lengths[u]), r))
    return shares


def rank_bins(units, lengths, token_budget, rank=0, world_size=1):
    """This rank's bins of unit indices (lengths: (U,) of every unit), padded with fillers ([]: one
    dummy token) to as many as the busiest rank has: under DDP and FSDP every forward is a
    collective."""
    units = np.asarray(units, dtype=np.int64).reshape(-1)
    shares = [units[s] for s in balance(lengths[units], world_size)]
    bins = [[share[b].tolist() for b in pack(lengths[share], token_budget)] if len(share) else []
            for share in shares]
    return bins[rank] + [[]] * (max(map(len, bins)) - len(bins[rank]))


def target_counts(data):
    """(N,) trained tokens of each sequence: its mask less its first token, never a target
    (make_batch)."""
    offsets, mask = np.asarray(data["offsets"], dtype=np.int64), np.asarray(data["loss_mask"])
    if len(offsets) == 1:
        return np.zeros(0, dtype=np.int64)
    return np.add.reduceat(mask[:offsets[-1]], offsets[:-1], dtype=np.int64) - mask[offsets[:-1]]


def unit_offsets(data, group_size=1):
    """(U+1,) unit u = sequences [units[u], units[u+1]): the data's own units, else groups of
    group_size."""
    if "units" in data:
        return np.asarray(data["units"], dtype=np.int64)
    return np.arange(0, len(data["offsets"]), group_size, dtype=np.int64)


def per_unit(values, bounds):
    """(N,) per-sequence values -> (U,) their sums over each unit."""
    sums = np.concatenate([[0], np.cumsum(values, dtype=np.int64)])
    return sums[bounds[1:]] - sums[bounds[:-1]]


def unit_lengths(data, group_size=1, prefix=None):
    """(U,) tokens each unit computes: its sequences, less what each shares with the one before it
    (prefix)."""
    lengths = np.diff(np.asarray(data["offsets"], dtype=np.int64))
    return per_unit(lengths if prefix is None else lengths - prefix, unit_offsets(data, group_size))


def shared_prefixes(data, group_size=2):
    """(N,) tokens each sequence shares at its start with the one before it in its unit (a unit's
    first: 0), at most one less than its own length, so that each keeps a token of its own."""
    offsets, ids = np.asarray(data["offsets"], dtype=np.int64), data["ids"]
    lengths = np.diff(offsets)
    limit = np.minimum(lengths - 1, np.concatenate([[0], lengths[:-1]]))
    limit[unit_offsets(data, group_size)[:-1]] = 0
    shared = np.zeros(len(lengths), dtype=np.int64)
    active = np.flatnonzero(limit > 0)
    # one token position per pass, over the sequences still equal so far: O(sum of prefixes)
    while active.size:
        here = offsets[active] + shared[active]
        active = active[ids[here] == ids[here - lengths[active - 1]]]
        shared[active] += 1
        active = active[shared[active] < limit[active]]
    return shared


def layout(data, budget, group_size=1, prefix_sharing=False):
    """What a split computes -> (the data, its units cut where one computes more than the budget:
    a conversation's turn examples into pieces between sequences, each piece starting whole; prefix
    per sequence or None; (P,) tokens each piece computes; (U+1,) piece offsets of each unit).
    Groups of group_size are never cut (check_fits)."""
    bounds = unit_offsets(data, group_size)
    shares = prefix_sharing and np.diff(bounds).max(initial=1) > 1
    prefix = shared_prefixes(data, group_size) if shares else None
    lengths = np.diff(np.asarray(data["offsets"], dtype=np.int64))
    own = lengths if prefix is None else lengths - prefix
    starts = bounds[:-1].tolist()
    for u in np.flatnonzero(per_unit(own, bounds) > budget).tolist() if "units" in data else []:
        size = lengths[bounds[u]]
        # a piece starts whole: its first sequence shares nothing
        for i in range(bounds[u] + 1, bounds[u + 1]):
            size += own[i]
            if size > budget:
                starts.append(i)
                size = lengths[i]
    if len(starts) == len(bounds) - 1:
        return data, prefix, unit_lengths(data, group_size, prefix), np.arange(len(bounds))
    pieces = np.array(sorted(starts) + [bounds[-1]], dtype=np.int64)
    if prefix is not None:
        prefix = prefix.copy()
        prefix[pieces[:-1]] = 0
    cut = dict(data, units=pieces)
    return cut, prefix, unit_lengths(cut, 1, prefix), np.searchsorted(pieces, bounds)


def group_data(prompts, replies, masks=None):
    """RL groups as token data: group g is sequences g*k .. g*k+k-1, each `prompt + reply`, trained
    on the reply (masks: 0/1 per reply token; None: all)."""
    seqs = [(p, r, np.ones(len(r)) if masks is None else masks[g][j])
            for g, (p, group) in enumerate(zip(prompts, replies)) for j, r in enumerate(group)]
    cat = lambda parts, dtype: (np.concatenate([np.asarray(x, dtype) for x in parts]) if parts
                                else np.zeros(0, dtype))
    return dict(ids=cat([t for p, r, _ in seqs for t in (p, r)], np.int64),
                loss_mask=cat([t for p, _, m in seqs for t in (np.zeros(len(p)), m)], np.uint8),
                offsets=np.cumsum([0] + [len(p) + len(r) for p, r, _ in seqs]).astype(np.int64))


@dataclass
class PackedBatch:
    """N whole sequences back to back (a filler, N = 0, is one dummy token). Targets: SFT, one per
    position (target_rows None); groups, one triple per trained token (target_rows, targets,
    seq_ids (K,))."""
    # (T,) long
    input_ids: torch.Tensor
    # (T,) the next token where it is trained, else IGNORE_INDEX; groups: (K,) tokens
    targets: torch.Tensor
    # None, or groups (K,) long: the hidden row that predicts targets[i]
    target_rows: object
    # (T,) sequence 0..N-1 of each position (a filler's token: N); groups: (K,)
    seq_ids: torch.Tensor
    # (T,) long, from 0 in every sequence (P.. for a shared rest)
    position_ids: torch.Tensor
    # (N+1,) int32 query segments, one per sequence
    cu_seqlens: torch.Tensor
    # the longest query segment (the kernel sees it)
    max_seqlen: int
    # None: keys = queries; prefix sharing: (kv_index (Tk,), cu_seqlens_k, max_seqlen_k)
    kv: object
    # (U,) long, the data's units in this batch: examples, or groups
    units: torch.Tensor
    # N real sequences (0 for a filler); groups: sequences j*k .. j*k+k-1 are group j
    num_sequences: int
    # U for groups (DPO pairs, RL groups), 0 for SFT examples
    num_groups: int
    # real tokens computed (a shared prompt counts once)
    num_tokens: int
    # trained tokens (rows the LM head scores)
    num_target_tokens: int
    # 1 for a filler's dummy token, else 0; a CP slice: its padding rows
    num_padding: int
    # a CP slice: the context.ContextParallel whose ranks hold the rest of the stream
    context: object = None

    def to(self, device):
        move = lambda t: t.to(device, non_blocking=True)
        moved = {k: move(v) for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        if self.kv is not None:
            moved["kv"] = (move(self.kv[0]), move(self.kv[1]), self.kv[2])
        return replace(self, **moved)

    def inputs(self):
        """The model's keyword arguments for this micro-batch: model(**mb.inputs(),
        logprobs=True)."""
        kv = self.kv if self.context is None else (*self.kv, self.context)
        return dict(input_ids=self.input_ids, position_ids=self.position_ids,
                    cu_seqlens=self.cu_seqlens, max_seqlen=self.max_seqlen, kv=kv,
                    targets=self.targets, target_rows=self.target_rows)

    def key_lengths(self):
        """Keys each query segment of real tokens attends over (a CP slice: its sequence up to the
        piece's end)."""
        cu = self.cu_seqlens if self.kv is None else self.kv[1]
        n = self.num_sequences if self.context is None else len(cu) - 1 - (self.num_padding > 0)
        return np.diff(cu.cpu().numpy())[:n]

    def sequence_sums(self, values):
        """values per target -> (N,) per-sequence sums, no host sync; a CP slice's summed over its
        group (the gradient passes through: each rank computes the same loss from them)."""
        # + 1: a filler's slot
        sums = values.new_zeros(self.num_sequences + 1)
        sums = sums.index_add_(0, self.seq_ids, values)[:self.num_sequences]
        return sums if self.context is None else self.context.sum(sums)

    def group_sums(self, values, group_size):
        """values per target -> (U, k) per-sequence sums, row u the batch's unit u."""
        n = len(self.units)
        return self.sequence_sums(values)[:group_size * n].view(n, group_size)

    def pair_sums(self, values):
        """DPO: values per target -> (chosen (P,), rejected (P,)) per-sequence sums."""
        return self.group_sums(values, 2).unbind(1)


def sequence_rows(data, examples, skip):
    """Per sequence: its tokens, mask, and `rows`, where each of its positions sits in the stream.
    A shared later sequence appends only its rest; its rows start with the group's prompt rows."""
    ids, offsets, loss_mask = data["ids"], data["offsets"], data["loss_mask"]
    stream, positions, q_lens, rows, tokens, masks, T = [], [], [], [], [], [], 0
    for e, p in zip(examples.tolist(), skip.tolist()):
        x = ids[offsets[e]:offsets[e + 1]].astype(np.int64)
        m = loss_mask[offsets[e]:offsets[e + 1]] != 0
        own = np.arange(T, T + len(x) - p)
        rows.append(np.concatenate([rows[-1][:p], own]) if p else own)
        stream.append(x[p:])
        positions.append(np.arange(p, len(x)))
        q_lens.append(len(x) - p)
        tokens.append(x)
        masks.append(m)
        T += len(x) - p
    return stream, positions, q_lens, rows, tokens, masks, T


def make_batch(data, units, group_size=1, prefix=None):
    """The data's units as one PackedBatch, their sequences in order (groups: sequences
    j*k .. j*k+k-1 its group j). prefix: shared_prefixes() of the data, what each sequence shares
    computed once; None lays every sequence out whole."""
    units = np.asarray(units, dtype=np.int64).reshape(-1)
    bounds = unit_offsets(data, group_size)
    sizes = bounds[units + 1] - bounds[units]
    examples = (np.arange(sizes.sum(), dtype=np.int64)
                + np.repeat(bounds[units] - np.cumsum(sizes) + sizes, sizes))
    # what each sequence takes from the one before it
    skip = np.zeros(len(examples), dtype=np.int64) if prefix is None else prefix[examples]
    # target triples: a shared row may predict several tokens
    grouped = group_size > 1 or bool(skip.any())
    stream, positions, q_lens, rows, tokens, masks, T = sequence_rows(data, examples, skip)
    n_seq, n_tok, n_pad = len(examples), T, int(len(examples) == 0)
    if n_pad:
        # a filler: a zero-length micro-batch would trip the attention kernels, so one dummy token
        stream, positions, q_lens = [np.zeros(1, np.int64)], [np.zeros(1, np.int64)], [1]
    cat = lambda arrays: (np.concatenate(arrays).astype(np.int64) if arrays
                          else np.zeros(0, np.int64))
    # Position j of a sequence predicts its token j+1 where that one is trained: its first token is
    # never a target, so no loss ever reaches across a packed boundary, whatever the mask says.
    trained = [np.flatnonzero(m[1:]) for m in masks]
    target_rows = cat([r[j] for r, j in zip(rows, trained)])
    targets = cat([x[j + 1] for x, j in zip(tokens, trained)])
    target_seq = np.repeat(np.arange(n_seq), [len(j) for j in trained])
    if grouped:
        seq_ids = target_seq
    else:
        # SFT: one target slot per position, the form the loss weights and the tests use
        targets_per_row = np.full(n_tok + n_pad, IGNORE_INDEX, dtype=np.int64)
        targets_per_row[target_rows] = targets
        targets, target_rows = targets_per_row, None
        seq_ids = np.repeat(np.arange(n_seq + n_pad), q_lens)
    kv = None
    if skip.any():
        # keys: every sequence's own rows in full, aligned at the bottom right
        k_lens = [len(r) for r in rows]
        cu_seqlens_k = torch.from_numpy(np.cumsum([0] + k_lens).astype(np.int32))
        kv = (torch.from_numpy(cat(rows)), cu_seqlens_k, max(k_lens))
    as_long = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    return PackedBatch(
        input_ids=as_long(cat(stream)), targets=as_long(targets),
        target_rows=None if target_rows is None else as_long(target_rows),
        seq_ids=as_long(seq_ids), position_ids=as_long(cat(positions)),
        cu_seqlens=torch.from_numpy(np.cumsum([0] + q_lens).astype(np.int32)),
        max_seqlen=max(q_lens), kv=kv, units=as_long(units), num_sequences=n_seq,
        num_groups=len(units) if group_size > 1 else 0, num_tokens=n_tok,
        num_target_tokens=len(target_seq), num_padding=n_pad)


def rank_microbatches(data, units, lengths, token_budget, group_size=1, prefix=None, rank=0,
                      world_size=1, context=None, busiest=None):
    """This rank's micro-batches of the data's units: its share of them (lengths: (U,) tokens each
    unit computes) packed into bins of token_budget (a CP group's: microbatch_tokens x its size), as
    many on every rank, each cut into this rank's CP slice (context). busiest: where the units are
    this rank's own (RL's groups; world_size 1), a function of this rank's bin count -> the most any
    rank has (a collective)."""
    bins = rank_bins(units, lengths, token_budget, rank, world_size)
    if busiest is not None:
        bins += [[]] * (busiest(len(bins)) - len(bins))
    microbatches = [make_batch(data, b, group_size, prefix) for b in bins]
    return microbatches if context is None else [context.split(mb) for mb in microbatches]


@dataclass
class Step:
    """One optimizer step. Counts are GLOBAL (all ranks): the loss is normalised exactly without
    communication."""
    microbatches: list        # this rank's PackedBatch list; the same length on every rank
    num_examples: int         # sequences in the step (DPO: 2 * num_groups)
    num_groups: int           # groups (DPO pairs) in the step (0 for SFT)
    num_target_tokens: int    # tokens with a label in the step
    num_tokens_unshared: int  # tokens of its sequences laid out whole, each on its own
    units: np.ndarray         # the step's units, all ranks
    state: dict               # loader state that resumes right after this step


class PackedLoader:
    """One Step per optimizer step, forever (len() = steps per epoch). Step k of epoch e holds the
    units perm[k*B:(k+1)*B] of a permutation seeded by (seed, e): a step's data never depends on
    world_size or microbatch_tokens, so a run resumes on another number of GPUs. Each rank packs a
    near-equal share (rank_microbatches) of the units' pieces (layout: a conversation too long for
    one micro-batch is cut between its turn examples). state_dict() is the state after the last
    step returned (or step.state of a step in hand)."""

    def __init__(self, data, batch_size, microbatch_tokens, rank=0, world_size=1, seed=0,
                 group_size=1, prefix_sharing=False, context=None):
        assert 0 <= rank < world_size and batch_size >= 1
        assert (len(data["offsets"]) - 1) % group_size == 0
        self.data, self.batch_size, self.microbatch_tokens = data, batch_size, microbatch_tokens
        # context parallel (context.py) cuts slices; rank and world_size are the data-parallel ones
        self.context = context
        self.rank, self.world_size, self.seed, self.group_size = rank, world_size, seed, group_size
        self.layout, self.prefix, self.piece_lengths, self.pieces = layout(
            data, microbatch_tokens, group_size, prefix_sharing)
        bounds = unit_offsets(data, group_size)
        # (U,) tokens per unit, as computed
        self.lengths = per_unit(self.piece_lengths, self.pieces)
        # (U,) target tokens per unit
        self.targets = per_unit(target_counts(data), bounds)
        # (U,) sequences, and tokens if laid out whole
        self.sizes, self.whole = np.diff(bounds), unit_lengths(data, group_size)
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
            rng = np.random.default_rng((self.seed, self.epoch))
            self.perm = rng.permutation(len(self.lengths))
            self.perm_epoch = self.epoch
        # all ranks' units
        units = self.perm[self.step * self.batch_size:(self.step + 1) * self.batch_size]
        pieces = np.concatenate([np.arange(self.pieces[u], self.pieces[u + 1])
                                 for u in units.tolist()])
        micro = rank_microbatches(self.layout, pieces, self.piece_lengths, self.microbatch_tokens,
                                  self.group_size, self.prefix, self.rank, self.world_size,
                                  self.context)
        self.step += 1
        return Step(microbatches=micro, num_examples=int(self.sizes[units].sum()),
                    num_groups=len(units) if self.group_size > 1 else 0,
                    num_target_tokens=int(self.targets[units].sum()),
                    num_tokens_unshared=int(self.whole[units].sum()), units=units,
                    state=self.state_dict())

    def state_dict(self):
        return dict(epoch=self.epoch, step=self.step, seed=self.seed, batch_size=self.batch_size,
                    num_units=len(self.lengths), group_size=self.group_size)

    def load_state_dict(self, state):
        # world_size and microbatch_tokens may change on resume; what fixes the order may not.
        # a state saved before groups has no group_size
        state = dict(state, group_size=state.get("group_size", 2 if state.get("dpo") else 1))
        for key in ("seed", "batch_size", "num_units", "group_size"):
            if state[key] != self.state_dict()[key]:
                raise ValueError(f"loader state has {key}={state[key]} but this loader has "
                                 f"{self.state_dict()[key]}; resume with the same data and {key}")
        self.epoch, self.step = state["epoch"], state["step"]
