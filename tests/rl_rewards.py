"""Reward functions for tests/test_train_rl.py, named as users name theirs: --reward=tests.rl_rewards:<function>."""


def distinct_characters(prompt, reply, **fields):
    return float(len(set(reply)))


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
