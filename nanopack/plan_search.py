"""
The largest microbatch_tokens whose plan fits, in few plans (plan.py). Within each phase of a step
(forward, backward, optimizer: a plan measures each one's peak) the peak is affine in the tokens of
the largest micro-batch, so the search fits a line through two plans for each phase, predicts the
largest budget under gpu_memory, plans it and the next budget to confirm (2 plans), and bisects
only where the check disagrees. Worst-case data fills micro-batches with whole sequences: the peak
is a staircase in the budget, flat over a stair; the line is fitted in the tokens a micro-batch
holds, and the prediction is a stair's top. Both searches (fit_and_confirm, and bisection, its
fallback and the tests' reference) assume what bisection does: a larger budget never holds less. A
plan is plan_at(n) for a budget of n steps -> dict(peak_gib, fits, whole_step_tokens,
phase_peaks_gib (phase -> GiB; absent: the peak's phase only), filled_tokens (0: the budget),
unit_tokens (a stair's width; 0: none)).
"""
import math


class Bracket:
    """The plans made, by budget in steps; lo: the largest known to fit (below floor: none), hi:
    the smallest known not to (None: none yet)."""

    def __init__(self, plan_at, floor, step, n0, first):
        self.plan_at, self.floor, self.step = plan_at, floor, step
        self.plans, self.lo, self.hi = {}, floor - 1, None
        self.add(n0, first)

    def add(self, n, plan):
        self.plans[n] = plan
        if plan["fits"]:
            self.lo = max(self.lo, n)
        else:
            self.hi = n if self.hi is None else min(self.hi, n)

    def probe(self, n):
        """Plan budget n (once) unless the bracket already decides it; -> whether it fits."""
        if n <= self.lo:
            return True
        if self.hi is not None and n >= self.hi:
            return False
        if n not in self.plans:
            self.add(n, self.same_stair(n) or self.plan_at(n))
        return self.plans[n]["fits"]

    def same_stair(self, n):
        """A plan made whose micro-batches hold as many whole units as budget n's would (worst-case
        data at full length): the same step, so the same plan; else None."""
        for m, plan in self.plans.items():
            unit = plan.get("unit_tokens")
            if unit and n * self.step // unit == m * self.step // unit:
                return plan
        return None

    def whole(self, n):
        """The budget (in steps) from which plan n's rank step is one micro-batch."""
        return -(-self.plans[n]["whole_step_tokens"] // self.step)

    def answer(self):
        """-> (tokens, any larger fits) once the plans decide it, else None. Any larger fits where
        two fitting plans hold the same rank step (its sequences no longer with more budget) and
        the larger holds it in one micro-batch."""
        fitting = sorted(n for n, p in self.plans.items() if p["fits"])
        for a, b in zip(fitting, fitting[1:]):
            same = self.plans[a]["whole_step_tokens"] == self.plans[b]["whole_step_tokens"]
            if same and self.whole(b) <= b:
                return self.plans[b]["whole_step_tokens"], True
        if self.hi is not None and self.hi - self.lo <= 1:
            return (self.lo * self.step if self.lo >= self.floor else 0), False
        return None


def bisection(bracket, gpu_memory=None):
    """Plain search: double from the largest fitting budget (stopping once at where its step is
    one micro-batch) until one does not fit, then halve the bracket."""
    while (found := bracket.answer()) is None:
        lo, hi = bracket.lo, bracket.hi
        if hi is None:
            whole = bracket.whole(lo)
            bracket.probe(min(2 * lo, whole) if whole > lo else 2 * lo)
        else:
            bracket.probe((lo + hi) // 2)
    return found


def filled(plan, n, step):
    """The tokens plan n's largest micro-batch holds, on the budget's scale."""
    return plan.get("filled_tokens") or n * step


def crossing(points, gpu_memory, lo_x):
    """Where the line (two points) or parabola (three) through (tokens, peak) reaches gpu_memory,
    past lo_x; None where it does not rise there."""
    (xa, pa), (xb, pb) = points[:2]
    if len(points) == 3:
        (xc, pc) = points[2]
        # divided differences: peak = pa + s (x - xa) + q (x - xa)(x - xb)
        s, sbc = (pb - pa) / (xb - xa), (pc - pb) / (xc - xb)
        q = (sbc - s) / (xc - xa)
        # its slope at xa is s + q (xa - xb): the root where it rises, past lo_x
        b, c = s + q * (xa - xb), pa - gpu_memory
        if abs(q) * (xc - xa) > 1e-6 * abs(s) and b * b - 4 * q * c >= 0:
            root = (-b + math.sqrt(b * b - 4 * q * c)) / (2 * q) if q > 0 else (
                (-b - math.sqrt(b * b - 4 * q * c)) / (2 * q))
            if root + xa >= lo_x:
                return root + xa
    if pb <= pa:
        return None
    return xa + (gpu_memory - pa) * (xb - xa) / (pb - pa)


def phase_peaks(plan):
    """{phase: its peak GiB}: each phase's own where the plan measured them, else the peak's."""
    return plan.get("phase_peaks_gib") or {plan.get("peak_phase"): plan["peak_gib"]}


def predict(bracket, gpu_memory):
    """The largest budget the plans say fits: each phase's peak (forward, backward, ...; a later
    micro-batch's apart) is affine in its micro-batch's tokens, so a line through two of its plans,
    or a parabola through three (attention's quadratic part), the nearest gpu_memory; the budget
    where the first phase reaches it, at a stair's top where micro-batches hold whole units; None
    where no phase's peak rises."""
    b, step = bracket, bracket.step
    fitting = max((n for n, p in b.plans.items() if p["fits"]), default=None)
    units = {p.get("unit_tokens", 0) for p in b.plans.values()}
    unit = units.pop() if len(units) == 1 else 0
    budgets = []
    for phase in {ph for p in b.plans.values() for ph in phase_peaks(p)}:
        later = phase.endswith(", later")
        peak = {n: phase_peaks(p)[phase] for n, p in b.plans.items() if phase in phase_peaks(p)}
        xs = {n: (later and b.plans[n].get("later_tokens")) or filled(b.plans[n], n, step)
              for n in peak}
        near = sorted(peak, key=lambda n: abs(peak[n] - gpu_memory))
        # distinct tokens, the nearest first
        near = [n for i, n in enumerate(near) if xs[n] not in [xs[m] for m in near[:i]]][:3]
        x = crossing(sorted((xs[n], peak[n]) for n in near), gpu_memory,
                     xs.get(fitting, 0)) if near[1:] else None
        if x is None:
            continue
        if not unit:
            budgets.append(math.floor(x / step + 1e-9))
            continue
        # whole units fit up to x: the stair's top, just under one more unit
        more = math.floor(x / unit + 1e-9) + 1
        # a later micro-batch holds min(more, a rank's step - more) units: it may never get there
        rank_units = max(p["whole_step_tokens"] for p in b.plans.values()) / unit
        if not later or more < rank_units - x / unit:
            budgets.append(math.ceil(more * unit / step - 1e-9) - 1)
    return min(budgets, default=None)


def fit_and_confirm(bracket, gpu_memory, rounds=3):
    """Fit, predict, confirm (the predicted budget and the next one); bisection where the
    predictions keep missing -> (tokens, any larger fits)."""
    b = bracket
    # the second point of the line: twice the first budget, or half of it where it did not fit
    (n0, first), = b.plans.items()
    b.probe(2 * n0 if first["fits"] else max(b.floor, n0 // 2))
    for _ in range(rounds):
        if b.answer() is not None:
            return b.answer()
        p = predict(b, gpu_memory)
        if p is None:
            break
        # a rank's whole step in one micro-batch: the budgets past it plan alike
        if b.lo in b.plans and b.lo < b.whole(b.lo) <= p:
            p = b.whole(b.lo)
        p = max(p, b.lo + 1, b.floor)
        p = p if b.hi is None else min(p, b.hi - 1)
        if b.probe(p):
            b.probe(p + 1)
    return bisection(b)
