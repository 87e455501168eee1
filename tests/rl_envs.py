"""Environments for tests/test_train_rl_env.py, named as users name theirs: --env=tests.rl_envs:<Class>."""


class Chatty:
    """Three turns: "More." after each of the first two replies; each reply rewarded by its distinct characters,
    so that trajectories' rewards differ."""

    def __init__(self, **fields):
        self.turns = 0

    def step(self, reply):
        self.turns += 1
        done = self.turns == 3
        return None if done else "More.", len(set(reply)), done


class BrokenAtTurn2(Chatty):
    def step(self, reply):
        if self.turns == 1:
            raise KeyError("score")
        return super().step(reply)


class NeedsField:
    def __init__(self, level):
        self.level = level
