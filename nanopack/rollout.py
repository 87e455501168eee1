"""
RL's rollouts: a step's prompts drawn from the shuffled stream, k replies to each sampled by the
engine (nanopack/generate.py), scored by the rewards; with dynamic sampling (DAPO) the groups whose
rewards are all equal are dropped and more prompts sampled. Each reply's random stream is keyed by
(seed, prompt position, reply), so a step's samples depend neither on the world size nor on a
resume; each sampled token keeps its log-prob as the sampler computed it.
"""
import math
import time
from functools import lru_cache

import numpy as np
import torch

from nanopack import generate as generation
from nanopack.parallel import all_reduce_sum


def teaches(rewards):
    """(G, k) -> (G,) whether a group's rewards differ: one whose k rewards are equal has all
    advantages 0."""
    return rewards.max(1, initial=-math.inf) > rewards.min(1, initial=math.inf)


class Rollouts:
    """run: the script's run (ranks, CP group, autocast); prompts: (ids, messages, fields, where)
    records; config: the script's keys (k, prompts_per_step, temperature, top_p, max_new_tokens,
    dynamic_sampling, max_extra_rounds, seed)."""

    def __init__(self, run, config, prompts, rewards, model, raw_model, tok, sync_ranks):
        self.run, self.config, self.prompts, self.rewards = run, config, prompts, rewards
        self.model, self.raw_model, self.tok, self.sync_ranks = model, raw_model, tok, sync_ranks
        self.first_in_cp = run.cp.rank == 0

    @lru_cache(maxsize=2)
    def permutation(self, epoch):
        return np.random.default_rng((self.config["seed"], epoch)).permutation(len(self.prompts))

    def generate(self, prompts, **sampling):
        """The engine's replies to prompt records -> (token lists, the sampler's log-prob lists),
        the model in eval mode, under the run's autocast."""
        self.model.eval()
        with self.run.autocast:
            # through the module, where plan.py's fake step patches it
            out = generation.generate(self.raw_model, [p[0] for p in prompts],
                                      self.config["max_new_tokens"], self.tok.stop_ids,
                                      sync_ranks=self.sync_ranks, logprobs=True, **sampling)
        self.model.train()
        return out

    def sample(self, first):
        """This rank's share of the prompts at stream positions first .. first + prompts_per_step
        -> (their positions, prompts, k token lists per prompt, k sampler log-prob lists per
        prompt, rewards (G, k), each reward function's (G * k, F), seconds in `reward`)."""
        c, cp, n, k = self.config, self.run.cp, len(self.prompts), self.config["k"]
        mine = list(range(first + cp.data_rank, first + c["prompts_per_step"], cp.data_size))
        prompts = [self.prompts[self.permutation(i // n)[i % n]] for i in mine]
        replies, logps = self.generate(prompts, temperature=c["temperature"], top_p=c["top_p"],
                                       seed=c["seed"], keys=mine, num_samples=k)
        t0 = time.perf_counter()
        scored = None
        if self.first_in_cp:
            scored = self.rewards.score(prompts, replies, k, self.tok.decode_reply)
        # a CP group's first rank's replies and rewards are the group's: a nondeterministic
        # kernel or reward cannot set its ranks apart
        (replies, logps), (rewards, each) = cp.broadcast(((replies, logps), scored))
        groups = [replies[g * k:(g + 1) * k] for g in range(len(prompts))]
        logps = [logps[g * k:(g + 1) * k] for g in range(len(prompts))]
        return mine, prompts, groups, logps, rewards.reshape(-1, k), each, time.perf_counter() - t0

    def collect(self, first):
        """One step's groups from prompt stream position `first` -> ((prompts, replies, sampler
        log-probs, rewards) to train, (every reply sampled, every reward, each reward function's,
        rounds), seconds in `reward`, the next position). dynamic_sampling (DAPO): groups whose
        rewards are all equal are dropped and rounds of prompts_per_step more prompts sampled until
        prompts_per_step groups teach something (the first ones in the stream: the same on any
        world size), or max_extra_rounds were sampled."""
        c, device = self.config, self.run.device
        per_step = c["prompts_per_step"]
        kept, sampled, reward_s, rounds, n_kept = ([], [], [], []), ([], [], []), 0.0, 0, 0
        while True:
            positions, prompts, replies, logps, rewards, each, seconds = self.sample(first)
            for part, x in zip(sampled, (replies, [rewards], [each])):
                part.extend(x)
            reward_s, rounds = reward_s + seconds, rounds + 1
            if not c["dynamic_sampling"]:
                to_train = (prompts, replies, logps, rewards)
                return to_train, (*sampled, rounds), reward_s, first + per_step
            flags = np.zeros(per_step)
            flags[np.array(positions, dtype=np.int64) - first] = teaches(rewards)
            teaching = np.flatnonzero(np.array(all_reduce_sum(flags.tolist(), device)))
            chosen = teaching[:per_step - n_kept] + first
            for g in np.flatnonzero(np.isin(positions, chosen)):
                for part, x in zip(kept, (prompts[g], replies[g], logps[g], rewards[g])):
                    part.append(x)
            n_kept, first = n_kept + len(chosen), first + per_step
            # the step trains what it has: its line says so
            if n_kept == per_step or rounds > c["max_extra_rounds"]:
                to_train = (*kept[:3], np.array(kept[3]).reshape(-1, c["k"]))
                return to_train, (*sampled, rounds), reward_s, first


def sampler_logps(logps, keep, masks, units, k):
    """The sampler's log-probs of a micro-batch's trained tokens, in its packed order: groups
    `units` (indices into `keep`, the kept groups), k replies each, the tokens their masks train."""
    out = [np.asarray(logps[keep[u]][j], dtype=np.float64)[masks[u][j] != 0]
           for u in units.tolist() for j in range(k)]
    return torch.from_numpy(np.concatenate(out) if out else np.zeros(0)).float()
