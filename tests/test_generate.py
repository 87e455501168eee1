"""The generation engine (nanopack/generate.py): k replies per prompt from one prefill, slots refilled as replies end
(continuous batching), one vectorised draw per step whose noise is keyed by (seed, prompt key, reply, token index), and
multi-turn continuation of a live slot. A reply's tokens depend on its own stream only: the same whatever the batch,
the slot count, the order of the prompts, and with or without the cache."""
import math
from unittest import mock

import pytest
import torch

from nanopack.generate import Engine, KVCache, Sampling, generate, mix, sample, stream, uniforms
from test_sample import CACHE_CONFIGS, PROMPTS, random_model

K = 3
SAMPLED = dict(temperature=0.9, top_k=20, top_p=0.9)


@pytest.mark.slow
@pytest.mark.parametrize("config", CACHE_CONFIGS)
def test_replies_are_the_same_whatever_the_batch_slots_and_order(config):
    model = random_model(**CACHE_CONFIGS[config])
    read = []  # tokens each forward reads
    model.register_forward_pre_hook(lambda m, args: read.append(len(args[0])))
    greedy = generate(model, PROMPTS, 10, num_samples=K)
    assert read[0] == sum(map(len, PROMPTS)) and read[1] == K * len(PROMPTS)  # one prefill, then K rows a prompt
    assert greedy == [generate(model, [p], 10)[0] for p in PROMPTS for _ in range(K)]

    grouped = generate(model, PROMPTS, 10, num_samples=K, seed=7, **SAMPLED)
    assert len({tuple(r) for r in grouped[:K]}) > 1  # the replies to one prompt differ: their own draws
    one_by_one = [r for i, p in enumerate(PROMPTS) for r in generate(model, [p], 10, num_samples=K, seed=7, keys=[i],
                                                                     **SAMPLED)]
    order = [2, 0, 3, 1]
    reordered = generate(model, [PROMPTS[i] for i in order], 10, num_samples=K, seed=7, keys=order, **SAMPLED)
    back = [None] * len(grouped)
    for at, i in enumerate(order):
        back[i * K:(i + 1) * K] = reordered[at * K:(at + 1) * K]
    assert one_by_one == grouped and back == grouped
    # K slots: one prompt at a time, each in the slots the last one freed
    assert generate(model, PROMPTS, 10, num_samples=K, seed=7, slots=K, **SAMPLED) == grouped
    assert generate(model, PROMPTS, 10, num_samples=K, seed=7, kv_cache=False, **SAMPLED) == grouped
    assert generate(model, PROMPTS, 10, num_samples=K, seed=8, **SAMPLED) != grouped  # the seed matters


class Poisoning(Engine):
    """An engine that fills a slot's cache with garbage as soon as its reply ends (what a refilled slot's stale cache
    would hold at worst), and records which slots were refilled."""

    def __init__(self, *args, live=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.used, self.refilled, self.live = set(), 0, live

    def admit(self, waiting):
        admitted = super().admit(waiting)
        for r in (r for group in admitted for r in group):
            self.refilled += r.slot in self.used
            self.used.add(r.slot)
        return admitted

    def draw(self, replies, logits, sampling):
        slots = [r.slot for r in replies]
        super().draw(replies, logits, sampling)
        ended = [s for s, r in zip(slots, replies) if r.done]
        # live=True: a live slot poisoned instead, to show that the poison would be seen
        for s in [s for s, r in zip(slots, replies) if not r.done][:1] if self.live else ended:
            for buf in self.cache.k + self.cache.v:
                buf[s].normal_(0, 1e3)


@pytest.mark.parametrize("config", ["gqa", pytest.param("sliding window", marks=pytest.mark.slow)])
def test_a_refilled_slot_never_sees_the_last_replys_cache(config):
    model = random_model(**CACHE_CONFIGS[config])
    sampling = Sampling(10, stop_ids=(5, 17, 30), **SAMPLED)
    want = [r.tokens for r in Engine(model).generate(PROMPTS, sampling, K)]
    assert len({len(r) for r in want}) > 1  # replies end at different steps: slots free at different times
    engine = Poisoning(model, slots=K + 1)
    got = [r.tokens for r in engine.generate(PROMPTS, sampling, K)]
    assert engine.refilled > 0 and got == want
    poisoned = Poisoning(model, slots=K + 1, live=True)
    assert [r.tokens for r in poisoned.generate(PROMPTS, sampling, K)] != want  # the poison is strong enough to see


@pytest.mark.parametrize("config", CACHE_CONFIGS)
def test_continuing_a_live_slot_equals_generating_from_the_whole_chat(config):
    """Multi-turn: observations appended to finished replies' slots, read in one more prefill, then more tokens:
    greedy, the same tokens as a fresh generation from prompt + reply + observation (float32; margins decide). Three
    replies, observations of 4, 5 and 14 tokens (each read after its reply's last token): the long one is read in its own
    attention call, the two short ones together (each call pads its sequences to its longest)."""
    model = random_model(**CACHE_CONFIGS[config])
    engine, sampling = Engine(model, keep_slots=True), Sampling(5)
    replies = engine.generate(PROMPTS, sampling, 2, capacity=40)
    # replies of different prompts, observations of different lengths, one prefill
    picked = (3, 0, 5)
    chosen, observations = [replies[i] for i in picked], [[7, 8, 9, 10], list(range(11, 16)), list(range(20, 34))]
    first_turns = [list(r.tokens) for r in chosen]
    groups = []
    group_attention = KVCache.group_attention
    with mock.patch.object(KVCache, "group_attention", lambda self, *a: groups.append(len(a[4])) or
                           group_attention(self, *a)):
        engine.extend(chosen, observations, [5, 4, 3], sampling)
    assert sorted(set(groups)) == [1, 2]  # the long observation alone, the short two together
    for reply, first, obs, i, more in zip(chosen, first_turns, observations, picked, (5, 4, 3)):
        n = len(first) + len(obs)
        assert reply.tokens[:n] == first + obs and all(map(math.isnan, reply.logprobs[len(first):n]))
        assert reply.tokens[n:] == generate(model, [PROMPTS[i // 2] + first + obs], more)[0]
    others = [r.tokens for i, r in enumerate(replies) if i not in picked]
    assert others == [r for i, r in enumerate(generate(model, PROMPTS, 5, num_samples=2)) if i not in picked]


def test_kept_slots_must_hold_every_reply():
    """keep_slots (multi-turn): a slot is never freed, so fewer slots than replies would leave the rest waiting
    forever (dummy forwards in a loop): one clear error instead."""
    with pytest.raises(ValueError, match="keep_slots needs a slot for each of the 8 replies, not slots=6"):
        Engine(random_model(), slots=6, keep_slots=True).generate(PROMPTS, Sampling(3), 2)


def test_a_stop_token_ends_that_reply_only():
    model = random_model()
    run = lambda **kw: generate(model, PROMPTS[:2], 10, num_samples=K, seed=1, **SAMPLED, **kw)
    ref = run()
    stop = next(t for t in ref[1][2:] if t not in ref[0] and t not in ref[1][:2])  # ends reply 1, never reply 0
    out = run(stop_ids=[stop])
    assert out[1] == ref[1][:ref[1].index(stop) + 1] and out[0] == ref[0]
    for got, want in zip(out, ref):  # every reply: its own tokens up to its stop, whatever the others did
        assert got == (want[:want.index(stop) + 1] if stop in want else want)


def test_top_p_one_is_plain_sampling_and_tiny_top_p_is_greedy():
    model = random_model()
    plain = generate(model, PROMPTS, 10, temperature=1.0, seed=3)
    assert generate(model, PROMPTS, 10, temperature=1.0, top_p=1.0, seed=3) == plain
    greedy = generate(model, PROMPTS, 10, num_samples=K)
    tiny = generate(model, PROMPTS, 10, num_samples=K, temperature=1.0, top_p=1e-6, seed=12)
    assert tiny == greedy and plain != greedy[::K]


N = 20_000  # draws: a frequency's standard error is at most ~0.0035, so 0.02 (5.7 of them) between noise and a bug


def test_nucleus_keeps_the_fewest_tokens_that_reach_top_p():
    """Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.75 keeps the first two (0.5 < 0.75 <= 0.8), renormalised to
    0.625 / 0.375; top_p 0.85 the first three; top_k 2 the first two whatever top_p; no limit: all four."""
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    logits = probs.log().expand(N, 4)
    noise = uniforms(torch.tensor([stream(0, i, 0) for i in range(N)]), torch.zeros(N, dtype=torch.long))
    for kw, want in ((dict(top_p=0.75), [0, 0.625, 0, 0.375]), (dict(top_p=0.85), [0.15 / 0.95, 0.5 / 0.95, 0, 0.3 / 0.95]),
                     (dict(top_k=2, top_p=0.99), [0, 0.625, 0, 0.375]), (dict(), probs.tolist())):
        ids, logps = sample(logits, 1.0, noise=noise, **kw)
        freq = torch.bincount(ids, minlength=4).float() / len(ids)
        torch.testing.assert_close(freq, torch.tensor(want), atol=0.02, rtol=0)
        assert freq[torch.tensor(want) == 0].sum() == 0  # outside the nucleus: never drawn
        # the sampler's log-prob: the token's under softmax(logits / temperature), before top_k / top_p
        torch.testing.assert_close(logps, probs.log()[ids])


def test_the_noise_is_uniform_and_independent_across_streams_and_tokens():
    """mix is a 32-bit hash: the same on Python ints and tensors; its uniforms fill 10 bins evenly (100,000 draws: a
    bin's share has standard error 0.00095, so 0.005) whether they vary by stream or by token index, and neighbouring
    token indices of one stream are uncorrelated (|r| < 0.02, 6 standard errors of 0.0032)."""
    x = torch.arange(1000, dtype=torch.int64) * 7919
    assert mix(x).tolist() == [mix(int(v)) for v in x]
    streams = torch.tensor([stream(1337, i, j) for i in range(1000) for j in range(100)])
    across = uniforms(streams, torch.zeros_like(streams))
    along = uniforms(torch.full((100_000,), stream(1337, 5, 2)), torch.arange(100_000))
    for u in (across, along):
        assert 0 < u.min() and u.max() < 1
        share = torch.histc(u, 10, 0, 1) / len(u)
        torch.testing.assert_close(share, torch.full((10,), 0.1), atol=0.005, rtol=0)
    assert abs(torch.corrcoef(torch.stack([along[:-1], along[1:]]))[0, 1]) < 0.02
