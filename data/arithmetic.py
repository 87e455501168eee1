"""
The built-in dataset: short arithmetic chats, generated deterministically, so that
`python train_sft.py` and `python train_dpo.py` run offline with nothing to download.

    system:    Be concise.                      (in about 1 conversation out of 3)
    user:      What is 23+17?
    assistant: 23+17 = 40                       (the "plain" style: the equation and its result)
    user:      Now subtract 9 from that.        (follow-ups reuse the previous answer)
    assistant: Sure! 40-9 = 31                  (the "chatty" style: a filler word first)

1 to 4 turns, several phrasings. A hash of its text puts each conversation in train or val; both
draw on one finite table of facts, so held-out accuracy measures the chat task, not arithmetic on
unseen numbers. SFT mixes the styles at random: which to prefer is left to preference tuning. DPO:
chosen, the right answer plain; rejected, in 3 pairs of 4 the right answer chatty, else a plausible
wrong answer plain (so moving towards the style is not away from being right). evaluate(): greedy
val replies' exact-match accuracy (score()) and share of plain replies (preferred()). RL:
rl_prompts(), chats cut before their last answer, which reward() checks; hard=True keeps those whose
last question adds to or subtracts from the previous answer (the SFT model is ~60% right there
against ~83% overall).

    python data/arithmetic.py    # print a few examples
"""
import json
import os
import random
import re
import sys
import zlib

import torch
import torch.distributed as dist

# python data/arithmetic.py
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data.prepare import read_meta, write_token_files  # noqa: E402
from nanopack.generate import generate  # noqa: E402
from nanopack.tokenizer import get_tokenizer  # noqa: E402

VERSION = "arithmetic-v4"  # part of the cache key: bump it when the generator changes
MAX_ADD = 30  # + and -: operands 0..MAX_ADD
MAX_MUL = (9, 9)  # *: a in 2..9, b in 2..9
MAX_FOLLOW_ADD = 9  # follow-ups add or subtract 1..9 from the previous answer
MAX_FOLLOW_MUL = 30  # ... or double it, if it is at most this
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
WORDS = {"+": "plus", "-": "minus", "*": "times"}
QUESTIONS = ["What is {a}{op}{b}?", "what is {a} {op} {b}?", "Compute {a}{op}{b}.", "{a}{op}{b}=?",
             "How much is {a} {word} {b}?", "Calculate {a} {op} {b}", "Quick: {a}{op}{b}",
             "Can you work out {a} {word} {b}?"]
FOLLOW_UPS = {"+": ["Now add {b} to that.", "And plus {b}?"],
              "-": ["Now subtract {b} from that.", "Then take away {b}."],
              "*": ["Now multiply that by {b}.", "And times {b}?"]}
STYLES = ("plain", "chatty")  # how an answer is written: "23+17 = 40" or "Sure! 23+17 = 40"
SYSTEMS = ["You are a calculator. Reply with the equation and its result.",
           "You are a helpful math tutor.",
           "Answer arithmetic questions briefly.", "Be concise."]


def is_val(messages):
    return zlib.crc32(json.dumps(messages).encode()) % 10 == 0  # ~10% of conversations are held out


def draw_problem(rng, prev):
    """-> (a, op, b, follow_up). The ranges at the top keep the table small enough for the toy model
    to learn."""
    op = rng.choice("+-*")
    follow_up = prev is not None and rng.random() < 0.4 and (op != "*" or prev <= MAX_FOLLOW_MUL)
    if follow_up:
        a, b = prev, (2 if op == "*" else rng.randint(1, MAX_FOLLOW_ADD))
    elif op == "*":
        a, b = rng.randint(2, MAX_MUL[0]), rng.randint(2, MAX_MUL[1])
    else:
        a, b = rng.randint(0, MAX_ADD), rng.randint(0, MAX_ADD)
    if op == "-" and b > a:  # answers stay >= 0
        a, b = (a, rng.randint(0, a)) if follow_up else (b, a)
    return a, op, b, follow_up


def conversation(rng):
    """-> (messages, problems): a chat ending in an assistant answer, and its (a, op, b, follow_up)
    per turn."""
    messages = [dict(role="system", content=rng.choice(SYSTEMS))] if rng.random() < 0.3 else []
    problems, prev = [], None
    for _ in range(rng.randint(1, 4)):
        a, op, b, follow_up = draw_problem(rng, prev)
        question = rng.choice(FOLLOW_UPS[op] if follow_up else QUESTIONS)
        prev = OPS[op](a, b)
        messages += [dict(role="user", content=question.format(a=a, op=op, b=b, word=WORDS[op])),
                     dict(role="assistant", content=answer(a, op, b, prev, rng.choice(STYLES)))]
        problems.append((a, op, b, follow_up))
    return messages, problems


def answer(a, op, b, result, style):
    return f"{a}{op}{b} = {result}" if style == "plain" else f"Sure! {a}{op}{b} = {result}"


def preferred(reply):
    """The preferred behaviour: the reply is the plain equation, no filler (whether or not its
    result is right)."""
    return re.fullmatch(r"\s*\d+\s*[-+*]\s*\d+\s*=\s*-?\d+\s*", reply) is not None


def conversations(split, n, seed=0, hard=False):
    """The first n conversations of `split` from one seeded stream (~1 in 10 goes to val); hard:
    those whose last question is a follow-up + or -."""
    assert split in ("train", "val")
    rng = random.Random(f"{VERSION}-{seed}")  # str seeds are hashed stably across runs
    made = 0
    while made < n:
        messages, problems = conversation(rng)
        if is_val(messages) == (split == "val") and (not hard or problems[-1][3]
                                                     and problems[-1][1] != "*"):
            made += 1
            yield messages, problems


def wrong_answer(rng, a, op, b):
    """A plausible mistake: off by one, the last two digits swapped, or the wrong operation."""
    right = OPS[op](a, b)
    s = str(right)
    options = [right + 1, right - 1] + [f(a, b) for o, f in OPS.items() if o != op]
    if len(s) >= 2:
        options.append(int(s[:-2] + s[-1] + s[-2]))
    return rng.choice([w for w in options if w != right and w >= 0])


def sft_examples(split, n, seed=0):
    for messages, _ in conversations(split, n, seed):
        yield dict(messages=messages)


def dpo_examples(split, n, seed=0):
    rng = random.Random(f"{VERSION}-{split}-{seed}-rejected")
    for messages, problems in conversations(split, n, seed):
        a, op, b, _ = problems[-1]
        right = OPS[op](a, b)
        rejected = (answer(a, op, b, right, "chatty") if rng.random() < 0.75 else
                    answer(a, op, b, wrong_answer(rng, a, op, b), "plain"))
        yield dict(prompt=messages[:-1], chosen=answer(a, op, b, right, "plain"), rejected=rejected)


def rl_prompts(split, n, seed=0, hard=False):
    """Yields (prompt messages, answer): the first n conversations of `split`, cut before their last
    assistant turn."""
    for messages, (*_, (a, op, b, _)) in conversations(split, n, seed, hard):
        yield messages[:-1], OPS[op](a, b)


def env_prompts(split, n, seed=0):
    """Multi-turn RL (train_rl.py --env=builtin): yields (prompt messages, FollowUps' fields) for
    the first n conversations of `split` with a follow-up: the chat cut after the question the
    first follow-up builds on; the follow-ups the environment asks after each answer."""
    made = 0
    for messages, problems in conversations(split, 10 ** 9, seed):
        starts = [j for j in range(len(problems) - 1) if problems[j + 1][3]]
        if not starts:
            continue
        j, system = starts[0], int(messages[0]["role"] == "system")
        chain = [(op, b) for _, op, b, _ in problems[j + 1:]]
        follow = len(chain) if all(p[3] for p in problems[j + 1:]) else \
            [p[3] for p in problems[j + 1:]].index(False)
        a, op, b, _ = problems[j]
        yield messages[:system + 2 * j + 1], dict(answer=OPS[op](a, b), follow_ups=chain[:follow])
        made += 1
        if made == n:
            return


class FollowUps:
    """The built-in environment: after each answer, the next follow-up ("Now add 4 to that.") on
    the number the model itself gave, so a later turn builds on what it said; 1 per right answer."""

    def __init__(self, answer, follow_ups):
        self.answer, self.follow_ups = answer, [tuple(f) for f in follow_ups]

    def step(self, reply):
        numbers = re.findall(r"-?\d+", reply.rsplit("=", 1)[-1])
        said = int(numbers[0]) if numbers else None
        right = float(said == self.answer)
        if not self.follow_ups:
            return None, right, True
        op, b = self.follow_ups.pop(0)
        self.answer = OPS[op](self.answer if said is None else said, b)
        return FOLLOW_UPS[op][0].format(b=b), right, False


def val_problems(n=200, seed=0, hard=False):
    """-> [(prompt messages, answer)]: the first n val conversations, cut before their last
    answer."""
    return list(rl_prompts("val", n, seed, hard))


def score(answer, reply):
    """Exact match: the first number after the reply's last '=' (or in the reply, if none) is the
    answer."""
    numbers = re.findall(r"-?\d+", reply.rsplit("=", 1)[-1])
    return bool(numbers) and int(numbers[0]) == answer


def reward(prompt, reply, answer):
    """RL (train_rl.py's default reward): 1.0 if the reply's answer is exactly `answer` (score()),
    else 0.0."""
    return float(score(answer, reply))


@torch.no_grad()
def evaluate(model, tok, n, autocast, sync_ranks):
    """The first n val prompts answered greedily, split over ranks -> dict(val_accuracy,
    val_preferred) on every rank. model: the network itself (FSDP2 modules gather their shards when
    called); sync_ranks: FSDP."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    problems = val_problems(n)[rank::world_size]
    with autocast:
        replies = generate(model, [tok.render_prompt(p) for p, _ in problems], max_new_tokens=16,
                           stop_ids=tok.stop_ids, sync_ranks=sync_ranks)
    texts = [tok.decode_reply(r) for r in replies]
    correct = sum(score(ans, t) for (_, ans), t in zip(problems, texts))
    counts = torch.tensor([correct, sum(map(preferred, texts)), len(problems)],
                          dtype=torch.float64, device=next(model.parameters()).device)
    if dist.is_initialized():
        dist.all_reduce(counts)
    return dict(val_accuracy=(counts[0] / counts[2]).item(),
                val_preferred=(counts[1] / counts[2]).item())


def prepare_builtin(out_dir, tokenizer="byte", kind="sft", n_train=20_000, n_val=500, seed=0,
                    verbose=True):
    """The dataset as token files in out_dir (see data/prepare.py), unless there for the same
    settings -> meta. tokenizer: a Tokenizer, "byte" or a model folder."""
    tok = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    settings = dict(source=f"{VERSION}-{kind}", n_train=n_train, n_val=n_val, seed=seed)
    if os.path.exists(os.path.join(out_dir, "meta.json")):
        meta = read_meta(out_dir)
        if all(meta.get(k) == v
               for k, v in dict(settings, tokenizer=tok.name, template=tok.template_id).items()):
            return meta
    make = dict(sft=sft_examples, dpo=dpo_examples)[kind]
    # (where, split, record), as prepare.py reads them
    items = ((f"{VERSION}:{split}:{i}", split, record)
             for split, n in (("train", n_train), ("val", n_val))
             for i, record in enumerate(make(split, n, seed)))
    return write_token_files(items, out_dir, tok, max_len=4096, extra_meta=settings,
                             verbose=verbose)


if __name__ == "__main__":
    for record in sft_examples("train", 3):
        print(json.dumps(record))
    for record in dpo_examples("train", 2):
        print(json.dumps(record))
    print(val_problems(2))
    print(next(rl_prompts("train", 1, hard=True)))
    print(next(env_prompts("train", 1)))
