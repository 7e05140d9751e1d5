"""A synthetic language of known rank: the softmax bottleneck, measured in two minutes on a CPU.

Yang, Dai, Salakhutdinov & Cohen ("Breaking the Softmax Bottleneck", ICLR 2018, Sec. 2) write
language modelling as matrix factorisation: stack the true next-token log-probabilities of N
contexts into a matrix A (N x V). A softmax over d-dimensional logits E g + b can only produce
log-probability matrices of rank <= d + 2, so when rank(A) is larger no choice of context
vectors g reaches the truth. Their Sec. 2 argument treats the context vectors as free (the
backbone as a universal approximator); this demo does exactly that:

1. Build A with rank exactly r (``true_log_probs``): a random rank-(r - 1) logit matrix
   L = U W^T, row-normalised, A = L - logsumexp_x(L); the normaliser adds one rank.
2. Give every context a free learned vector, ``nn.Embedding(N, d)``, and feed it to each head
   (d_in = d_embed = d, untied). A softmax matches A only if its logits G E^T + 1 b^T equal
   the rank-(r - 1) L up to a constant per row, which needs d >= r - 1; so take d < r - 1.
3. Fit each head by minimising the exact mean KL(P* || P_theta) over contexts, full batch,
   with Adam; report the KL (float64), the Press rank of the learned float32 log-probability
   matrix, the parameter count and the seconds taken (``fit_head``, ``run_demo``).

Scale of the truth. The logits L have standard deviation ``logit_scale`` (3.0 by default):
U and W are standard normal and L = logit_scale * U W^T / sqrt(r - 1). With V = 256 this
gives a mean entropy of 2.5 nats (perplexity 12 out of V = 256) and a mean largest probability
of 0.39 with the defaults: neither near-uniform (entropy -> log V = 5.5 as the scale -> 0)
nor near-one-hot (scale 5 already gives 1.3 nats and a largest probability of 0.61).

Head knobs for the demo (``demo_knobs``; everything else keeps the paper defaults):

* every dropout is off (MoS/MoC ``latent_dropout=0.0``; Mixtape's dropouts default to 0);
* MoS/MoC use ``n_components`` = K = 15, the papers' PTB/WT2 value;
* Mixtape: the synthetic ids have no frequency order, so the paper's gate sharing (per-token
  gates only for the S = floor(0.1 V) "most frequent" ids) would pick an arbitrary tenth of the
  vocabulary. The demo gives every token its own gates (``frequent_fraction=1.0``, the paper's
  "Mixtape without gate sharing"), with ``gate_dim = max(1, d // 4)`` (the paper keeps
  gate_dim << d) so its parameter count stays close to the others'. With the paper's 0.1
  (``--mixtape-frequent-fraction 0.1``) 90% of the tokens share one prior per context, i.e.
  behave as MoC, and Mixtape does worse than the softmax (benchmarks/results/demo-mixtape-0.1);
* LMS-PLIF uses 1,000 pieces instead of the paper's 100,000 (which were 2.5% of a 4M-parameter
  PTB decoder; here 100,000 would be twenty times the rest of the model; with them the default
  KL is 0.53 instead of 0.59). Its slopes keep the paper's own learning rate 0.02 through
  ``parameter_groups``, equal to the demo's default lr anyway.

All heads get the same optimiser, learning rate, number of steps and initial context vectors.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from highrank.analysis.rank import press_rank
from highrank.heads import HEADS, PAPER_HEADS, OutputHead, build_head
from highrank.util.checks import check_names, check_positive_int
from highrank.util.denormals import flush_denormals
from highrank.util.machine import describe_machine
from highrank.util.progress import progress_bar

RESULTS_FILE = "results.json"
PLOT_FILE = "kl_curves.png"
CURVE_POINTS = 200  # KL values kept per head in results.json and the plot


@dataclass(frozen=True)
class DemoSettings:
    """Everything that determines a demo run; the defaults take about 35 s on 2 idle CPU cores.

    Args:
        rank: r, the exact rank of the true log-probability matrix A.
        dim: d, the size of every context vector and output embedding (d_in = d_embed = d).
        vocab: V, the number of tokens.
        contexts: N, the number of contexts (rows of A).
        heads: names from ``highrank.heads.HEADS``, fitted in this order.
        steps: full-batch Adam steps per head.
        seed: seeds the true matrix and, identically, the initialisation of every head.
        lr: Adam learning rate, the same for every head.
        logit_scale: standard deviation of the true logits (see the module docstring).
        n_components: K for MoS and MoC.
        mixtape_frequent_fraction: Mixtape's share of tokens with their own gates (1.0: all;
            the paper's 0.1 picks an arbitrary tenth here, see the module docstring).
        threads: torch intra-op threads while fitting. One by default: these matrices are too
            small to gain from more, and a single thread makes every number independent of
            the machine's load (multi-threaded BLAS may split sums differently when busy).
    """

    rank: int = 64
    dim: int = 8
    vocab: int = 256
    contexts: int = 256
    heads: tuple[str, ...] = field(default_factory=lambda: PAPER_HEADS)
    steps: int = 2000
    seed: int = 0
    lr: float = 0.02
    logit_scale: float = 3.0
    n_components: int = 15
    mixtape_frequent_fraction: float = 1.0
    threads: int = 1

    def __post_init__(self) -> None:
        for name in ("rank", "dim", "vocab", "contexts", "steps", "n_components", "threads"):
            check_positive_int(name, getattr(self, name))
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0; got {self.seed!r}")
        for name in ("lr", "logit_scale"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a finite number > 0; got {value!r}")
        fraction = self.mixtape_frequent_fraction
        if not isinstance(fraction, int | float) or not 0 < fraction <= 1:
            raise ValueError(f"mixtape_frequent_fraction must be in (0, 1]; got {fraction!r}")
        if self.rank > min(self.contexts, self.vocab):
            raise ValueError(
                f"rank={self.rank} is impossible for a {self.contexts} x {self.vocab} matrix: "
                f"it must be <= min(contexts={self.contexts}, vocab={self.vocab})"
            )
        object.__setattr__(self, "heads", tuple(self.heads))
        check_head_names(self.heads)

    def notes(self) -> list[str]:
        """Warnings about settings that are valid but do not show the bottleneck."""
        if self.dim >= self.rank - 1:
            return [
                f"dim={self.dim} >= rank - 1 = {self.rank - 1}: a softmax with d = {self.dim} "
                f"can represent the rank-{self.rank} truth exactly, so there is no bottleneck "
                f"to break (that needs dim < rank - 1)"
            ]
        return []


@dataclass
class HeadResult:
    """What ``fit_head`` measures for one head."""

    kl: float  # mean KL(P* || P_theta) over contexts, nats, float64
    rank: int  # Press rank of the learned (N, V) float32 log-probability matrix
    params: int  # context vectors (N d) + head parameters
    seconds: float  # build + train + evaluate
    curve_steps: list[int]  # training steps at which the curve was recorded (1-based)
    curve_kl: list[float]  # float32 training KL at those steps


def check_head_names(names: tuple[str, ...] | list[str]) -> None:
    """Reject an empty list, duplicates and unknown names, listing the valid ones, and heads
    that read more than a hidden state (MFS, CPR: the demo's contexts are rows, no sequence)."""
    check_names("head", names, HEADS)
    sequential = [name for name in names if HEADS[name].reads != ("hidden",)]
    if sequential:
        raise ValueError(
            f"head(s) {', '.join(sequential)} also read the layers and tokens of a sequence; "
            "the demo's contexts are single vectors: choose heads that read hidden states alone"
        )


# ---- the true language ---------------------------------------------------------------------


def true_log_probs(settings: DemoSettings) -> torch.Tensor:
    """The true log-probability matrix A ``(N, V)``, float64, of rank exactly r (generically).

    L = s U W^T / sqrt(r - 1) with U ``(N, r - 1)``, W ``(V, r - 1)`` standard normal, so each
    logit has standard deviation s = ``logit_scale``; A = L - logsumexp_x(L) subtracts a
    context-dependent constant, i.e. A = [U, -lse] [s W / sqrt(r - 1), 1]^T has rank r.
    Every probability exp(A) is > 0. Drawn from its own generator seeded with ``seed``.
    """
    n, v, k = settings.contexts, settings.vocab, settings.rank - 1
    generator = torch.Generator().manual_seed(settings.seed)
    u = torch.randn(n, k, generator=generator, dtype=torch.float64)  # (N, r-1)
    w = torch.randn(v, k, generator=generator, dtype=torch.float64)  # (V, r-1)
    logits = settings.logit_scale * (u @ w.T) / math.sqrt(max(k, 1))  # (N, V), rank r-1
    return logits - torch.logsumexp(logits, dim=1, keepdim=True)


def mean_kl(target_log_probs: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
    """Mean over contexts of KL(P* || P) = sum_x P*(x) (log P*(x) - log P(x)), from log-probs.

    Both arguments are ``(N, V)`` log-probabilities; the result is a scalar in their dtype.
    """
    return (target_log_probs.exp() * (target_log_probs - log_probs)).sum(dim=1).mean()


def mean_entropy(log_probs: torch.Tensor) -> float:
    """Mean entropy in nats of the rows of a ``(N, V)`` log-probability matrix."""
    return float(-(log_probs.exp() * log_probs).sum(dim=1).mean())


# ---- fitting one head ----------------------------------------------------------------------


def demo_knobs(name: str, settings: DemoSettings) -> dict[str, object]:
    """The knobs the demo passes to head ``name`` (the reasons are in the module docstring)."""
    knobs: dict[str, object] = {"d_embed": settings.dim}
    if name in ("mos", "moc"):
        knobs.update(n_components=settings.n_components, latent_dropout=0.0)
    elif name == "mixtape":
        knobs.update(
            frequent_fraction=settings.mixtape_frequent_fraction,
            gate_dim=max(1, settings.dim // 4),
        )
    elif name == "plif":
        knobs.update(n_pieces=1000)
    return knobs


def build_model(name: str, settings: DemoSettings) -> tuple[nn.Embedding, OutputHead]:
    """Free context vectors ``(N, d)`` and head ``name``, initialised from ``seed``.

    The global generator is reseeded first, so every head starts from the same context
    vectors and a given head is initialised identically in every run.
    """
    torch.manual_seed(settings.seed)
    contexts = nn.Embedding(settings.contexts, settings.dim)  # N(0, 1) rows, (N, d)
    head = build_head(
        name, d_in=settings.dim, vocab_size=settings.vocab, **demo_knobs(name, settings)
    )
    return contexts, head


def count_parameters(*modules: nn.Module) -> int:
    """Number of distinct trainable scalars in ``modules`` (a shared Parameter counts once)."""
    unique = {id(p): p for m in modules for p in m.parameters() if p.requires_grad}
    return sum(p.numel() for p in unique.values())


def fit_head(
    name: str, settings: DemoSettings, target: torch.Tensor, progress: object | None = None
) -> HeadResult:
    """Fit head ``name`` to the true log-probabilities ``target (N, V)`` by exact KL.

    Full batch: every step scores all N contexts against their full distributions and takes
    one Adam step on mean KL(P* || P_theta) (float32). ``progress`` is an optional tqdm bar
    advanced once per step.
    """
    start = time.perf_counter()
    if progress is not None:
        progress.set_description(name)
    with torch.random.fork_rng(devices=[]), _reproducible_and_fast(settings.threads):
        contexts, head = build_model(name, settings)
        curve_steps, curve_kl = _train(contexts, head, settings, target.float(), progress)
        head.eval()
        with torch.no_grad():
            learned = head.log_prob(contexts.weight)  # (N, V) float32
    return HeadResult(
        kl=float(mean_kl(target, learned.double())),
        rank=press_rank(learned),
        params=count_parameters(contexts, head),
        seconds=time.perf_counter() - start,
        curve_steps=curve_steps,
        curve_kl=curve_kl,
    )


def _train(
    contexts: nn.Embedding,
    head: OutputHead,
    settings: DemoSettings,
    target: torch.Tensor,
    progress: object | None,
) -> tuple[list[int], list[float]]:
    """Adam on the full-batch KL; returns the recorded (step, KL) curve."""
    groups = [{"params": list(contexts.parameters()), "lr": settings.lr}]
    optimizer = torch.optim.Adam(groups + head.parameter_groups(settings.lr))
    every = max(1, settings.steps // CURVE_POINTS)
    steps, values = [], []
    head.train()  # dropouts are off (demo_knobs), so train and eval agree
    for step in range(1, settings.steps + 1):
        loss = mean_kl(target, head.log_prob(contexts.weight))  # (N, V) -> scalar
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % every == 0 or step in (1, settings.steps):
            steps.append(step)
            values.append(loss.item())
            if progress is not None:
                progress.set_postfix(kl=f"{values[-1]:.4f}")
        if progress is not None:
            progress.update(1)
    return steps, values


@contextlib.contextmanager
def _reproducible_and_fast(threads: int):
    """``threads`` torch threads, deterministic kernels and denormals flushed to zero while
    fitting; all restored after.

    Deterministic algorithms: the CPU backward of an index with repeated indices (LMS-PLIF's
    piece lookup) otherwise adds with atomics in thread order, so two runs with the same seed
    would differ. Denormals: tiny probabilities of the peaked true rows underflow into
    denormal floats, which make CPU arithmetic many times slower (:mod:`highrank.util.denormals`).
    """
    previous_threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        with flush_denormals():
            yield
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.set_num_threads(previous_threads)


# ---- the whole run -------------------------------------------------------------------------


def run_demo(settings: DemoSettings, out_dir: str | Path, progress: bool = True) -> dict:
    """Fit every head of ``settings``, write ``results.json`` and the KL plot into ``out_dir``.

    Returns the results dictionary that was written (see ``results.json``'s layout below):
    ``settings``, ``true_rank`` (r), ``true_press_rank``, ``true_entropy``,
    ``softmax_rank_bound`` (d + 2), ``total_seconds``, ``machine`` (where the seconds were
    measured) and ``heads``: for every head
    ``kl``, ``rank``, ``params``, ``seconds``, ``knobs`` and ``curve`` {``step``, ``kl``}.
    """
    start = time.perf_counter()
    target = true_log_probs(settings)  # (N, V) float64
    heads = {}
    with _progress_bar(settings, progress) as bar:
        for name in settings.heads:
            result = fit_head(name, settings, target, bar)
            heads[name] = _head_entry(name, settings, result)
    results = {
        "settings": asdict(settings),
        "true_rank": settings.rank,
        "true_press_rank": press_rank(target.float()),
        "true_entropy": mean_entropy(target),
        "softmax_rank_bound": settings.dim + 2,
        "total_seconds": time.perf_counter() - start,
        "machine": describe_machine(threads=settings.threads),
        "heads": heads,
    }
    write_results(results, out_dir)
    return results


def _head_entry(name: str, settings: DemoSettings, result: HeadResult) -> dict:
    return {
        "kl": result.kl,
        "rank": result.rank,
        "params": result.params,
        "seconds": result.seconds,
        "knobs": demo_knobs(name, settings),
        "curve": {"step": result.curve_steps, "kl": result.curve_kl},
    }


@contextlib.contextmanager
def _progress_bar(settings: DemoSettings, enabled: bool):
    if not enabled:
        yield None
        return
    total = settings.steps * len(settings.heads)
    with progress_bar(total=total, desc="demo", unit="step", dynamic_ncols=True) as bar:
        yield bar


def write_results(results: dict, out_dir: str | Path) -> tuple[Path, Path]:
    """Write ``results.json`` and the KL-against-step plot into ``out_dir`` (created)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / RESULTS_FILE
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    plot_path = out / PLOT_FILE
    plot_curves(results, plot_path)
    return json_path, plot_path


def plot_curves(results: dict, path: str | Path) -> None:
    """KL(P* || P_theta) against training step for every head, log-scale y, saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    settings = results["settings"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, entry in results["heads"].items():
        ax.plot(entry["curve"]["step"], entry["curve"]["kl"], label=name)
    ax.set_yscale("log")
    # Plain decimals (0.6, 1, 2) instead of 6 x 10^-1: the KLs span less than two decades.
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(_minor_tick_label))
    ax.set_xlabel("training step")
    ax.set_ylabel("mean KL(P* || P_theta), nats")
    ax.set_title(
        f"true rank r = {results['true_rank']}, d = {settings['dim']} "
        f"(softmax bound d + 2 = {results['softmax_rank_bound']}), "
        f"N = {settings['contexts']}, V = {settings['vocab']}"
    )
    ax.title.set_fontsize(9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _minor_tick_label(value: float, _position: int) -> str:
    """Label the minor ticks 2, 3, 4, 6 and 8 of each decade plainly (0.6, 3, 40); others blank."""
    mantissa = value / 10 ** math.floor(math.log10(value))
    return f"{value:g}" if round(mantissa) in (2, 3, 4, 6, 8) else ""


# ---- reporting -----------------------------------------------------------------------------


def format_table(results: dict) -> str:
    """A plain-text table: head, KL (nats), Press rank, parameters, seconds."""
    lines = [f"{'head':<12}{'KL (nats)':>12}{'Press rank':>12}{'params':>10}{'seconds':>10}"]
    for name, entry in results["heads"].items():
        lines.append(
            f"{name:<12}{entry['kl']:>12.4f}{entry['rank']:>12d}"
            f"{entry['params']:>10,d}{entry['seconds']:>10.1f}"
        )
    return "\n".join(lines)


def reading(results: dict) -> str:
    """One line that reads the table against the softmax rank bound d + 2.

    A head "breaks" the bottleneck here when its learned rank exceeds d + 2 *and* its KL is
    at least 5% below the softmax's: a high rank alone does not mean a better fit.
    """
    bound, r = results["softmax_rank_bound"], results["true_rank"]
    heads = results["heads"]
    line = f"True rank r = {r}; a softmax with d = {bound - 2} has rank <= d + 2 = {bound}"
    if bound >= r + 1:
        return line + ", which is no bound here (d >= r - 1): a softmax can match the truth."
    if "softmax" not in heads:
        return line + "; add softmax to --heads to compare against it."
    floor = heads["softmax"]["kl"]
    broke = [n for n in heads if _breaks(heads[n], bound, floor)]
    broke.sort(key=lambda n: heads[n]["kl"])
    rank_only = [n for n in heads if heads[n]["rank"] > bound and n not in broke]
    line += f". Below the softmax KL {floor:.4f} by > 5% with rank > {bound}: "
    line += ", ".join(f"{n} {heads[n]['kl']:.4f}" for n in broke) or "none"
    if rank_only:
        line += f"; rank > {bound} without that gain: {', '.join(rank_only)}"
    return line + "."


def _breaks(entry: dict, bound: int, softmax_kl: float) -> bool:
    return entry["rank"] > bound and entry["kl"] < 0.95 * softmax_kl
