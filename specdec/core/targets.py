"""Target distributions π = T(q, p) of the speculative-cascades paper (Tables 1 and 3, eqs. 6, 11–16).

Deferral decisions use the untransformed distributions q_raw, p_raw; the interpolation uses the
transformed (temperature / top-k / top-p) q, p that are sampled and verified (App. C.1). OPT and OPTLog
measure the rejection cost with D_TV of the transformed pair (App. C.1). BiLD's discrepancy is
D(q, p) = −Σ_v q(v)·log p_raw(v) with the transformed q (App. F.1; F.5 drops the minus sign).

Every function is jit-able with α and β traced; the rule name is static.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specdec import checks, sampling

Array = jax.Array
Inputs = frozenset[str]   # a subset of {"q", "p", "q_raw", "p_raw"}


@dataclasses.dataclass(frozen=True)
class Rule:
  """A target rule π = T(q, p) as data: the one place the decode loops learn what a rule does.

  `target(q=, p=, q_raw=, p_raw=, alpha=, beta=)` -> π [..., V] reads `reads` (q, p transformed; q_raw,
  p_raw untransformed, App. C.1); α ∈ [0, `alpha_hi`) (`alpha_unit` names its scale), unused where
  `uses_alpha` is False; `lossless` where π = p (the output's law is the verifier's). `bonus`: the law at
  the bonus position after a row's last draft, 'target' (π there too) or 'p' (drawn from p, as the lossy
  rules of Tran-Thien). `defers(q_raw=, p_raw=, q=, p=,
  alpha=)` -> δ [...] bool for a rule with π = (1 − δ)·q + δ·p (eq. 6), reading `defer_reads`; such a
  rule's reported deferral is δ itself, any other rule's is π ≠ q (`moves_mass`). Registered in `RULES`
  (`register_rule`), like `decoding.methods.Method`.
  """
  name: str
  target: Callable[..., Array]
  reads: Inputs
  summary: str
  alpha_hi: float = 1.0
  alpha_unit: str = ""
  uses_alpha: bool = True
  lossless: bool = False
  bonus: str = "target"
  defers: Callable[..., Array] | None = None
  defer_reads: Inputs = frozenset()

  def __post_init__(self):
    unknown = (self.reads | self.defer_reads) - {"q", "p", "q_raw", "p_raw"}
    if unknown or self.bonus not in ("target", "p") or (self.defers is None) != (not self.defer_reads):
      raise ValueError(f"rule {self.name!r}: reads and defer_reads are subsets of q, p, q_raw, p_raw (a "
                       f"deferral rule reads at least one), bonus is 'target' or 'p'")

  @property
  def needs_bonus_q(self) -> bool:
    """Whether π at the bonus position reads the drafter's distribution there (else its call is saved)."""
    return self.bonus == "target" and bool(self.reads & {"q", "q_raw"})

  @property
  def decides_from_q(self) -> bool:
    """A deferral rule whose δ reads q_raw alone: usable before the verifier runs (sequential cascades)."""
    return self.defers is not None and self.defer_reads <= {"q_raw"}

  def alpha_range(self) -> tuple[float, float, str]:
    """α's allowed interval [lo, hi) and the name errors give it."""
    unit = f", a threshold in {self.alpha_unit}" if self.alpha_unit else ""
    return 0.0, self.alpha_hi, f"alpha (rule {self.name!r}{unit})"

  def check_alpha(self, alpha) -> None:
    """α in `alpha_range()` when concrete (raises ValueError)."""
    lo, hi, label = self.alpha_range()
    checks.check_range(label, alpha, lo, hi, hi_closed=False)

  def distribution(self, *, q: Array, p: Array, q_raw: Array, p_raw: Array, alpha=0.0, beta=1.0) -> Array:
    """π = T(q, p), [..., V] each -> [..., V]; α checked when concrete."""
    self.check_alpha(alpha)
    return self.target(q=q, p=p, q_raw=q_raw, p_raw=p_raw, alpha=alpha, beta=beta)

  def with_bonus(self, pi: Array, p: Array, is_bonus: Array) -> Array:
    """π with p at the bonus positions (`is_bonus`, broadcast against [..., V]) where `bonus` is 'p'."""
    return jnp.where(is_bonus, p, pi) if self.bonus == "p" else pi

  def deferred(self, *, q: Array, p: Array, q_raw: Array, p_raw: Array, pi: Array, alpha) -> Array:
    """The reported deferral [...]: δ for a deferral rule (at T = 0 a deferral to an agreeing p leaves π =
    q), else π ≠ q (`moves_mass`)."""
    if self.defers is not None:
      return self.defers(q_raw=q_raw, p_raw=p_raw, q=q, p=p, alpha=jnp.asarray(alpha, jnp.float32))
    return moves_mass(pi, q)


RULES: dict[str, Rule] = {}


def register_rule(rule: Rule) -> Rule:
  """Adds `rule` to `RULES`; every method taking `rule` (speculative, oracle_cascade) then runs it."""
  if rule.name in RULES:
    raise ValueError(f"a rule named {rule.name!r} is already registered")
  RULES[rule.name] = rule
  return rule


def get_rule(name: str) -> Rule:
  """The registered rule `name` (ValueError naming the registered ones otherwise)."""
  return checks.check_registered("rule", name, RULES)


def check_rule(name: str) -> None:
  get_rule(name)


def alpha_range(name: str) -> tuple[float, float, str]:
  """α's allowed interval [lo, hi) for rule `name` and the name errors give it: [0, 1) for probability-scale
  rules, [0, ∞) for the nats-scale ones."""
  return get_rule(name).alpha_range()


def check_alpha(name: str, alpha) -> None:
  """α in `alpha_range(name)` (raises ValueError)."""
  get_rule(name).check_alpha(alpha)


def moves_mass(pi: Array, q: Array) -> Array:
  """π ≠ q beyond rounding, [..., V] -> [...] bool: some |π(v) − q(v)| exceeds 4 ulps of max(π(v), q(v))
  in their dtype (a relative test: an absolute threshold would hide real moves of small mass and count a
  bfloat16 rounding as one)."""
  tolerance = 4 * jnp.finfo(jnp.result_type(pi, q)).eps
  return jnp.any(jnp.abs(pi - q) > tolerance * jnp.maximum(pi, q), axis=-1)


def check_beta(alpha, beta) -> None:
  """β ≥ 1 − α (Tran-Thien's condition), checked when both are concrete."""
  if checks.is_concrete(alpha) and checks.is_concrete(beta):
    a, b = np.asarray(alpha, np.float64), np.asarray(beta, np.float64)
    if np.any(np.isnan(b)) or np.any(b < 1.0 - a):
      raise ValueError(f"beta must satisfy beta >= 1 - alpha; got beta={b.tolist()}, alpha={a.tolist()}")


def _per_token(x) -> Array:
  """A scalar or [...] parameter, broadcast against [..., V]. A scalar stays a scalar: broadcast to
  [..., 1], XLA:CPU writes it out at [..., V] when two fusions share it."""
  x = jnp.asarray(x, jnp.float32)
  return x if x.ndim == 0 else x[..., None]


def tv_distance(p: Array, q: Array) -> Array:
  """D_TV(p, q) = Σ_v max(0, p(v) − q(v)) over the last axis (Lemma 3)."""
  return sampling.masked_sum(p - q, p > q)[0]


def bild_discrepancy(q: Array, p_raw: Array) -> Array:
  """D(q, p) = −Σ_v q(v)·log p_raw(v): cross-entropy, and −log p_raw(argmax q) when q is one-hot."""
  log_p = jnp.log(jnp.maximum(p_raw, jnp.finfo(jnp.float32).tiny))
  return -sampling.masked_sum(q * log_p, q > 0)[0]


def deferral(rule: str, *, q_raw: Array, p_raw: Array | None = None, q: Array | None = None,
             p: Array | None = None, alpha) -> Array:
  """δ(q, p) ∈ {0, 1} of a deferral rule (`Rule.defers`; the built-in ones in Table 3, eqs. 2, 5, 10, 26–28),
  [..., V] -> [...] bool. Only the inputs the rule reads (`Rule.defer_reads`) are needed: chow and
  chow_log decide from q_raw alone (sequential cascades)."""
  found = get_rule(rule)
  if found.defers is None:
    raise ValueError(f"deferral() is defined for the deferral rules {', '.join(deferral_rules())}; got {rule!r}")
  given = {"q_raw": q_raw, "p_raw": p_raw, "q": q, "p": p}
  missing = [name for name in sorted(found.defer_reads) if given[name] is None]
  if missing:
    raise ValueError(f"rule {rule!r} needs {', '.join(missing)}")
  return found.defers(q_raw=q_raw, p_raw=p_raw, q=q, p=p, alpha=jnp.asarray(alpha, jnp.float32))


def token_deferral(rule: str, *, q_raw: Array, p_raw: Array, alpha) -> Array:
  """r(v) ∈ {0, 1} of a token-specific rule, eqs. (13)–(15), [..., V] -> [..., V] bool.

  token_v1  q_raw(v) < max p_raw − α
  token_v2  p_raw(v) < max p_raw − α
  token_v3  p_raw(v) < max p_raw·(1 − α)
  """
  if rule not in _TOKEN_DEFERRALS:
    raise ValueError(f"token_deferral() is defined for {', '.join(_TOKEN_DEFERRALS)}; got {rule!r}")
  alpha = _per_token(alpha)
  return _TOKEN_DEFERRALS[rule](q_raw, p_raw, jnp.max(p_raw, axis=-1, keepdims=True), alpha)


def lossy_target(q: Array, p: Array, alpha, beta) -> Array:
  """π_Lossy(v) = max(min(q(v), p(v)/(1 − α)), p(v)/β) (Table 1, Lemma 2; Table 3 swaps q and p)."""
  return jnp.maximum(jnp.minimum(q, p / (1.0 - _per_token(alpha))), p / _per_token(beta))


@functools.partial(jax.jit, static_argnames=("iterations",))
def lossy_beta(q: Array, p: Array, alpha, *, iterations: int = 64) -> Array:
  """β* ≥ 1 solving Σ max(0, q − p/(1−α)) = Σ max(0, p/β − q) (App. F.6) by Newton's method. [..., V] -> [...]

  In x = 1/β the right side f(x) = Σ max(0, p·x − q) is convex, piecewise linear and increasing, and
  f(1) = D_TV(p, q) ≥ lhs, the left side; so Newton's iteration from β = 1,
  β ← Σ_{p > βq} p / (lhs + Σ_{p > βq} q), increases β monotonically to β*, exactly once the set
  {p > βq} stops changing. Each step is one pass over q and p. It converges quadratically (relative steps
  9e-3, 7e-6, 0 at V = 32k), so it stops after a step below 2^-16 of β, whose successor would be below
  float32 resolution, or once the set is unchanged: 2 steps at V = 32k (at most `iterations`), where a
  bisection took 64 passes. With this β*, Σ π_Lossy = 1. When lhs = 0 every β ≥ max p/q solves it and
  all give π = q: the smallest, max(1, max p/q) (at most 1e12, where q = 0 < p), is returned.
  """
  excess = q - p / (1.0 - _per_token(alpha))
  lhs, n_excess = sampling.masked_sum(excess, excess > 0.0)
  tuned = n_excess > 0

  def moving(state):
    beta, previous, n_active, n_previous, k = state
    moved = (beta - previous > beta * 2.0 ** -16) & (n_active != n_previous)
    return jnp.any(tuned & moved) & (k < iterations)

  def newton(state):
    beta, _, previous_count, _, k = state
    active = p > beta[..., None] * q
    (above_p, n_active), (above_q, _) = sampling.masked_sum(p, active), sampling.masked_sum(q, active)
    step = jnp.where(tuned, jnp.maximum(beta, above_p / (lhs + above_q)), beta)
    return step, beta, n_active, previous_count, k + 1

  ones = jnp.ones_like(lhs)
  unset = jnp.full(lhs.shape, -1, jnp.int32)
  beta = jax.lax.while_loop(moving, newton, newton((ones, ones, unset, unset, 0)))[0]

  def smallest_solution(_):
    return jnp.clip(jnp.max(p / jnp.maximum(q, jnp.finfo(jnp.float32).tiny), axis=-1), 1.0, 1e12)

  return jnp.where(tuned, beta, jax.lax.cond(jnp.all(tuned), lambda _: ones, smallest_solution, None))


def target_distribution(rule: str, *, q: Array, p: Array, q_raw: Array, p_raw: Array, alpha=0.0,
                        beta=1.0) -> Array:
  """π = T(q, p) of the registered rule `rule` (`Rule.distribution`), [..., V] each -> [..., V].

  q, p are the transformed S(·) distributions; q_raw, p_raw the untransformed ones. α and β are
  scalars or arrays of shape [...] (e.g. per row); α is checked against the rule's range when concrete.
  """
  return get_rule(rule).distribution(q=q, p=p, q_raw=q_raw, p_raw=p_raw, alpha=alpha, beta=beta)


def lenient_target(q: Array, p: Array, *, q_raw: Array, p_raw: Array, lenience, greedy) -> Array:
  """CS Drafting's lenient review (§3.2) as the law π of what a reviewer p emits for drafts x ~ q, [..., V].

  Sampling: x is accepted with probability min(1, l·p(x)/q(x)), else a token is drawn from
  norm(max(0, p − q)); so π = m + (1 − Σm)·norm(max(0, p − q)) with m = min(q, l·p). Verifying the
  q-drafts against this π (`verify.verify_block`) performs exactly that test and residual; l = 1 gives
  π = p. Greedy (`greedy` true, q and p one-hot): x = argmax q is kept where x = argmax p or, for l > 1,
  where q_raw(x) ≤ l·p_raw(x) (CSD's greedy rule); otherwise argmax p. At l = 1 only argmax p is kept, so
  lenience 1 is exact (CSD's text would also keep x when q_raw(x) ≤ p_raw(x)). `lenience` ≥ 1 and
  `greedy` may be traced.
  """
  lenience = _per_token(lenience)
  kept = jnp.minimum(q, lenience * p)
  res = jnp.maximum(p - q, 0.0)
  res = res / jnp.maximum(jnp.sum(res, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
  pi = kept + (1.0 - jnp.sum(kept, axis=-1, keepdims=True)) * res
  q_at_x, p_at_x = jnp.sum(q * q_raw, axis=-1, keepdims=True), jnp.sum(q * p_raw, axis=-1, keepdims=True)
  keep_draft = greedy & (lenience > 1.0) & (q_at_x <= lenience * p_at_x)
  return jnp.where(keep_draft, q, pi)


# --- the built-in rules (Tables 1 and 3), in the order of the paper's tables ------------------------------

def _deferral_rule(name: str, defers: Callable[..., Array], defer_reads: set[str], summary: str,
                   alpha_unit: str = "") -> Rule:
  """A rule π = (1 − δ)·q + δ·p with δ from `defers` (eq. 6, App. C.1 eq. 23)."""
  def target(*, q, p, q_raw, p_raw, alpha, beta):
    delta = defers(q_raw=q_raw, p_raw=p_raw, q=q, p=p, alpha=jnp.asarray(alpha, jnp.float32))
    return jnp.where(delta[..., None], p, q)
  return Rule(name, target, reads=frozenset({"q", "p"} | defer_reads), summary=summary, defers=defers,
              defer_reads=frozenset(defer_reads), alpha_hi=math.inf if alpha_unit else 1.0, alpha_unit=alpha_unit)


def _token_rule(name: str, reads: set[str], summary: str) -> Rule:
  """A token-specific rule π(v) = q(v)·(1 − r(v)) + p(v)·Σ_v' r(v')·q(v') (eqs. 11, 16, Alg. 6)."""
  def target(*, q, p, q_raw, p_raw, alpha, beta):
    r = token_deferral(name, q_raw=q_raw, p_raw=p_raw, alpha=alpha)
    eta = sampling.masked_sum(q, r)[0][..., None]
    return jnp.where(r, 0.0, q) + p * eta
  return Rule(name, target, reads=frozenset({"q", "p"} | reads), summary=summary)


def _lossy(*, q, p, q_raw, p_raw, alpha, beta):
  check_beta(alpha, beta)
  return lossy_target(q, p, alpha, beta)


_TOKEN_DEFERRALS = {
    "token_v1": lambda q_raw, p_raw, p_max, alpha: q_raw < p_max - alpha,
    "token_v2": lambda q_raw, p_raw, p_max, alpha: p_raw < p_max - alpha,
    "token_v3": lambda q_raw, p_raw, p_max, alpha: p_raw < p_max * (1.0 - alpha),
}

for _rule in (
    Rule("spec", lambda *, q, p, q_raw, p_raw, alpha, beta: p, reads=frozenset({"p"}), uses_alpha=False, lossless=True,
         summary="p (Alg. 1): lossless speculative decoding"),
    Rule("lossy", _lossy, reads=frozenset({"q", "p"}), bonus="p",
         summary="max(min(q, p/(1−α)), p/β), β given (Table 1, Lemma 2; β = 1 by default; Σπ ≥ 1)"),
    Rule("lossy_tuned", lambda *, q, p, q_raw, p_raw, alpha, beta: lossy_target(q, p, alpha, lossy_beta(q, p, alpha)),
         reads=frozenset({"q", "p"}), bonus="p", summary="lossy with β = β*(q, p, α) of App. F.6 (Σπ = 1)"),
    _deferral_rule("bild", lambda *, q_raw, p_raw, q, p, alpha: bild_discrepancy(q, p_raw) > alpha, {"p_raw", "q"},
                   "BiLD*: defer when −Σ q·log p_raw > α (q transformed)", alpha_unit="nats"),
    _deferral_rule("chow", lambda *, q_raw, p_raw, q, p, alpha: jnp.max(q_raw, axis=-1) < 1.0 - alpha, {"q_raw"},
                   "defer when max q_raw < 1 − α (eq. 2)"),
    _deferral_rule("chow_log", lambda *, q_raw, p_raw, q, p, alpha: sampling.entropy(q_raw) > alpha, {"q_raw"},
                   "defer when entropy(q_raw) > α", alpha_unit="nats"),
    _deferral_rule("diff", lambda *, q_raw, p_raw, q, p, alpha: jnp.max(q_raw, axis=-1) < jnp.max(p_raw, axis=-1)
                   - alpha, {"q_raw", "p_raw"}, "defer when max q_raw < max p_raw − α (eq. 5)"),
    _deferral_rule("diff_log", lambda *, q_raw, p_raw, q, p, alpha: sampling.entropy(p_raw) < sampling.entropy(q_raw)
                   - alpha, {"q_raw", "p_raw"}, "defer when entropy(p_raw) < entropy(q_raw) − α", alpha_unit="nats"),
    _deferral_rule("opt", lambda *, q_raw, p_raw, q, p, alpha: jnp.max(q_raw, axis=-1) < jnp.max(p_raw, axis=-1)
                   - alpha * tv_distance(p, q), {"q_raw", "p_raw", "q", "p"},
                   "defer when max q_raw < max p_raw − α·D_TV(p, q) (eq. 10)"),
    _deferral_rule("opt_log", lambda *, q_raw, p_raw, q, p, alpha: sampling.entropy(p_raw) < sampling.entropy(q_raw)
                   - alpha * tv_distance(p, q), {"q_raw", "p_raw", "q", "p"},
                   "defer when entropy(p_raw) < entropy(q_raw) − α·D_TV(p, q)", alpha_unit="nats"),
    _token_rule("token_v1", {"q_raw", "p_raw"}, "r(v) = [q_raw(v) < max p_raw − α] (eq. 13)"),
    _token_rule("token_v2", {"p_raw"}, "r(v) = [p_raw(v) < max p_raw − α] (eq. 14)"),
    _token_rule("token_v3", {"p_raw"}, "r(v) = [p_raw(v) < max p_raw·(1 − α)] (eq. 15)"),
):
  register_rule(_rule)


def deferral_rules() -> tuple[str, ...]:
  """The registered rules with π = (1 − δ)·q + δ·p (`Rule.defers`)."""
  return tuple(name for name, found in RULES.items() if found.defers is not None)


def sequential_rules() -> tuple[str, ...]:
  """The registered deferral rules that decide from q_raw alone (`Rule.decides_from_q`)."""
  return tuple(name for name, found in RULES.items() if found.decides_from_q)


# The built-in families, for tests and tables that enumerate them.
CASCADE_RULES = deferral_rules()
TOKEN_RULES = tuple(_TOKEN_DEFERRALS)
