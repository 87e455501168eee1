"""k replies per prompt (generate(num_samples=k)): each prompt prefilled once, its cache row copied to its replies;
sampling with temperature, top_k and top_p (nucleus). With a generator per reply, a reply's tokens depend on its own
generator only, so k replies from one prefill equal k separate generations token for token."""
import pytest
import torch

from nanopack.generate import generate, sample
from test_sample import CACHE_CONFIGS, PROMPTS, random_model

K = 3
SAMPLED = dict(temperature=0.9, top_k=20, top_p=0.9)


def generators(n, seed=100):
    return [torch.Generator().manual_seed(seed + r) for r in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("config", CACHE_CONFIGS)
def test_k_replies_from_one_prefill_equal_k_separate_generations(config):
    model = random_model(**CACHE_CONFIGS[config])
    read = []  # tokens each forward reads
    model.register_forward_pre_hook(lambda m, args: read.append(len(args[0])))
    greedy = generate(model, PROMPTS, 10, num_samples=K)
    assert read[0] == sum(map(len, PROMPTS)) and read[1] == K * len(PROMPTS)  # one prefill, then K rows a prompt
    assert greedy == [generate(model, [p], 10)[0] for p in PROMPTS for _ in range(K)]

    grouped = generate(model, PROMPTS, 10, num_samples=K, generator=generators(K * len(PROMPTS)), **SAMPLED)
    separate = [generate(model, [p], 10, generator=generators(1, 100 + i * K + j), **SAMPLED)[0]
                for i, p in enumerate(PROMPTS) for j in range(K)]
    assert grouped == separate
    assert len({tuple(r) for r in grouped[:K]}) > 1  # the replies to one prompt differ: their own draws
    no_cache = generate(model, PROMPTS, 10, num_samples=K, generator=generators(K * len(PROMPTS)), kv_cache=False,
                        **SAMPLED)
    assert no_cache == grouped


def test_a_stop_token_ends_that_reply_only():
    model = random_model()
    run = lambda **kw: generate(model, PROMPTS[:2], 10, num_samples=K, generator=generators(2 * K), **SAMPLED, **kw)
    ref = run()
    stop = next(t for t in ref[1][2:] if t not in ref[0] and t not in ref[1][:2])  # ends reply 1, never reply 0
    out = run(stop_ids=[stop])
    assert out[1] == ref[1][:ref[1].index(stop) + 1] and out[0] == ref[0]
    for got, want in zip(out, ref):  # every reply: its own tokens up to its stop, whatever the others did
        assert got == (want[:want.index(stop) + 1] if stop in want else want)


def test_top_p_one_is_plain_sampling_and_tiny_top_p_is_greedy():
    model = random_model()
    plain = generate(model, PROMPTS, 10, temperature=1.0, generator=torch.Generator().manual_seed(3))
    assert generate(model, PROMPTS, 10, temperature=1.0, top_p=1.0, generator=torch.Generator().manual_seed(3)) == plain
    greedy = generate(model, PROMPTS, 10, num_samples=K)
    tiny = generate(model, PROMPTS, 10, num_samples=K, temperature=1.0, top_p=1e-6, generator=generators(12))
    assert tiny == greedy and plain != greedy[::K]


def test_nucleus_keeps_the_fewest_tokens_that_reach_top_p():
    """Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.75 keeps the first two (0.5 < 0.75 <= 0.8), renormalised to
    0.625 / 0.375; top_p 0.85 the first three. 20,000 draws: a frequency's standard error is ~0.0035, so 0.02."""
    logits = torch.tensor([0.15, 0.5, 0.05, 0.3]).log().expand(20_000, 4)
    for top_p, want in ((0.75, [0, 0.625, 0, 0.375]), (0.85, [0.15 / 0.95, 0.5 / 0.95, 0, 0.3 / 0.95])):
        ids = sample(logits, 1.0, top_p=top_p, generator=torch.Generator().manual_seed(0))
        freq = torch.bincount(ids, minlength=4).float() / len(ids)
        torch.testing.assert_close(freq, torch.tensor(want), atol=0.02, rtol=0)
        assert freq[torch.tensor(want) == 0].sum() == 0  # outside the nucleus: never drawn
