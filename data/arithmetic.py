"""
The built-in dataset: short arithmetic chats, generated deterministically, so that
`python train_sft.py` and `python train_dpo.py` run offline with nothing to download.

    system:    Be concise.                      (in about 1 conversation out of 3)
    user:      What is 37+48?
    assistant: 37+48 = 85
    user:      Now subtract 9 from that.        (follow-ups reuse the previous answer)
    assistant: 85-9 = 76

1 to 4 turns and several phrasings, so lengths really vary (about 25 to 300 bytes). Every problem
(a, op, b) belongs either to train or to val (a fixed hash decides) and a conversation draws all its
turns from its own split, so no val question is ever seen in training.

DPO pairs: the prompt is a conversation up to its last question; chosen is the right answer,
rejected a plausible wrong one (off by one, last two digits swapped, or the wrong operation).
Accuracy: val_problems() gives (prompt messages, answer); score(answer, reply) checks a reply.

    python data/arithmetic.py    # print a few examples
"""
import json
import os
import random
import re
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # python data/arithmetic.py
from data.prepare import write_token_files  # noqa: E402
from tokenizer import get_tokenizer  # noqa: E402

VERSION = "arithmetic-v1"  # part of the cache key: bump it when the generator changes
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
WORDS = {"+": "plus", "-": "minus", "*": "times"}
QUESTIONS = ["What is {a}{op}{b}?", "what is {a} {op} {b}?", "Compute {a}{op}{b}.", "{a}{op}{b}=?",
             "How much is {a} {word} {b}?", "Calculate {a} {op} {b}", "Quick: {a}{op}{b}",
             "Can you work out {a} {word} {b}?"]
FOLLOW_UPS = {"+": ["Now add {b} to that.", "And plus {b}?"],
              "-": ["Now subtract {b} from that.", "Then take away {b}."],
              "*": ["Now multiply that by {b}.", "And times {b}?"]}
SYSTEMS = ["You are a calculator. Reply with the equation and its result.", "You are a helpful math tutor.",
           "Answer arithmetic questions briefly.", "Be concise."]


def is_val(a, op, b):
    return zlib.crc32(f"{a}{op}{b}".encode()) % 10 == 0  # ~10% of problems are held out


def draw_problem(rng, split, prev):
    """-> (a, op, b, follow_up) from the wanted split; a follow-up continues from the previous answer.
    Numbers stay small (answers 0..~260) so that a ~2M-parameter model learns the task in minutes."""
    while True:  # about 10 draws for a val problem, 1.1 for a train one
        op = rng.choice("+-*")
        follow_up = prev is not None and rng.random() < 0.4 and (op != "*" or prev <= 50)
        if follow_up:
            a, b = prev, (rng.randint(2, 3) if op == "*" else rng.randint(1, 20))
        elif op == "*":
            a, b = rng.randint(2, 19), rng.randint(2, 9)
        else:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
        if op == "-" and b > a:  # answers stay >= 0
            a, b = (a, rng.randint(0, a)) if follow_up else (b, a)
        if is_val(a, op, b) == (split == "val"):
            return a, op, b, follow_up


def conversation(rng, split):
    """-> (messages, problems): a chat ending in an assistant answer, and its (a, op, b) per turn."""
    messages = [dict(role="system", content=rng.choice(SYSTEMS))] if rng.random() < 0.3 else []
    problems, prev = [], None
    for _ in range(rng.randint(1, 4)):
        a, op, b, follow_up = draw_problem(rng, split, prev)
        question = rng.choice(FOLLOW_UPS[op] if follow_up else QUESTIONS)
        prev = OPS[op](a, b)
        messages += [dict(role="user", content=question.format(a=a, op=op, b=b, word=WORDS[op])),
                     dict(role="assistant", content=f"{a}{op}{b} = {prev}")]
        problems.append((a, op, b))
    return messages, problems


def conversations(split, n, seed=0):
    assert split in ("train", "val")
    rng = random.Random(f"{VERSION}-{split}-{seed}")  # str seeds are hashed stably across runs
    for _ in range(n):
        yield conversation(rng, split)


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
        a, op, b = problems[-1]
        yield dict(prompt=messages[:-1], chosen=messages[-1]["content"],
                   rejected=f"{a}{op}{b} = {wrong_answer(rng, a, op, b)}")


def val_problems(n=200, seed=0):
    """-> [(prompt messages, answer)]: the first n val conversations, cut before their last answer."""
    return [(messages[:-1], OPS[op](a, b)) for messages, (*_, (a, op, b)) in conversations("val", n, seed)]


def score(answer, reply):
    """Exact match: the first number after the reply's last '=' (or in the reply, if none) is the answer."""
    numbers = re.findall(r"-?\d+", reply.rsplit("=", 1)[-1])
    return bool(numbers) and int(numbers[0]) == answer


def prepare_builtin(out_dir, tokenizer="byte", kind="sft", n_train=20_000, n_val=500, seed=0, verbose=True):
    """Write the dataset as token files in out_dir (see data/prepare.py), unless they are already
    there for the same settings; returns the meta dict. tokenizer: a Tokenizer, "byte" or a model folder."""
    tok = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    settings = dict(source=f"{VERSION}-{kind}", n_train=n_train, n_val=n_val, seed=seed)
    if os.path.exists(os.path.join(out_dir, "meta.json")):
        with open(os.path.join(out_dir, "meta.json")) as f:
            meta = json.load(f)
        wanted = dict(settings, tokenizer=tok.name, template=tok.template)
        if all(meta.get(k) == v for k, v in wanted.items()):
            return meta
    make = dict(sft=sft_examples, dpo=dpo_examples)[kind]
    items = ((f"{VERSION}:{split}:{i}", split, record)  # (where, split, record), as prepare.py reads them
             for split, n in (("train", n_train), ("val", n_val))
             for i, record in enumerate(make(split, n, seed)))
    return write_token_files(items, out_dir, tok, max_len=4096, extra_meta=settings, verbose=verbose)


if __name__ == "__main__":
    for record in sft_examples("train", 3):
        print(json.dumps(record))
    for record in dpo_examples("train", 2):
        print(json.dumps(record))
    print(val_problems(2))
