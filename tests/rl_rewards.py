"""Reward functions for tests/test_train_rl.py, named as users name theirs: --reward=tests.rl_rewards:<function>."""


def distinct_characters(prompt, reply, **fields):
    return float(len(set(reply)))


def distinct_characters_1e8(prompt, reply, **fields):
    """distinct_characters offset by 1e8: the same advantages, and the same spread of rewards."""
    return 1e8 + distinct_characters(prompt, reply)


def contains_target(prompt, reply, target):
    return float(target in reply)


def raises(prompt, reply, **fields):
    return 1 / 0


def nan(prompt, reply, **fields):
    return float("nan")


def many_characters(prompt, reply, **fields):
    """1 for a reply of at least 5 distinct characters, else 0: a group of 2 replies often ties (nothing to learn)."""
    return float(len(set(reply)) >= 5)


def slow(prompt, reply, **fields):
    """A reward that takes 0.25 s a call, as one calling a judge model or running code might."""
    import time
    time.sleep(0.25)
    return float(len(set(reply)))


def as_string(prompt, reply, **fields):
    """The reported case: a number written as text, which float() would have read."""
    return "1"


def echo(prompt, reply, value):
    """Whatever the record's `value` is: a way to test what a reward may return."""
    return value


def answer_in_reply(prompt, reply, answer, bonus=0.0):
    """Takes only `answer` (and `bonus`, with a default): a record's other fields must not reach it."""
    return float(str(answer) in reply) + bonus


def exits(prompt, reply, **fields):
    raise SystemExit(3)


def interrupts(prompt, reply, **fields):
    raise KeyboardInterrupt
