"""
The largest microbatch_tokens whose plan fits, in few plans (plan.py). A plan's peak is affine in
the tokens of its largest micro-batch between the phase changes it knows (the chunked LM head, a
checkpointed layer, the peak moving to another phase), so the search fits a line through two
plans, predicts the largest budget under gpu_memory, plans it and the next budget to confirm
(2 plans), and bisects only where the check disagrees. Worst-case data fills micro-batches with
whole sequences: the peak is a staircase in the budget, flat over a stair; the line is fitted in
the tokens a micro-batch holds, and the prediction is a stair's top. Both searches (fit_and_confirm,
and bisection, its fallback and the tests' reference) assume what bisection does: a larger budget
never holds less. A plan is plan_at(n) for a budget of n steps -> dict(peak_gib, fits,
whole_step_tokens, filled_tokens (0: the budget), unit_tokens (a stair's width; 0: none)).
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
            self.add(n, self.plan_at(n))
        return self.plans[n]["fits"]

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


def predict(bracket, gpu_memory):
    """The largest budget the plans nearest the crossing say fits: a line through two, a parabola
    through three (attention's quadratic part, a phase change), a stair's top where micro-batches
    hold whole units; None where the peak does not rise."""
    b, step = bracket, bracket.step
    below = sorted(n for n, p in b.plans.items() if p["fits"])
    above = sorted(n for n, p in b.plans.items() if not p["fits"])
    near = below[-2:] + above[:2]
    # the peak is affine within one phase: the plans in the phase of the nearest above the line
    phase = b.plans[(above or below[::-1])[0]].get("peak_phase")
    alike = [n for n in below + above if b.plans[n].get("peak_phase") == phase]
    near = alike if len(alike) > 1 else near
    near = sorted(near, key=lambda n: abs(b.plans[n]["peak_gib"] - gpu_memory))
    xs = {n: filled(b.plans[n], n, step) for n in near}
    # distinct tokens, the nearest first
    near = [n for i, n in enumerate(near) if xs[n] not in [xs[m] for m in near[:i]]][:3]
    if len(near) < 2:
        return None
    points = sorted((xs[n], b.plans[n]["peak_gib"]) for n in near)
    lo_x = xs[below[-1]] if below and below[-1] in xs else 0
    x = crossing(points, gpu_memory, lo_x)
    if x is None:
        return None
    units = {b.plans[n].get("unit_tokens", 0) for n in near}
    if len(units) == 1 and (unit := units.pop()):
        # whole units fit up to x: the stair's top, just under one more unit
        return math.ceil((math.floor(x / unit + 1e-9) + 1) * unit / step - 1e-9) - 1
    return math.floor(x / step + 1e-9)


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
