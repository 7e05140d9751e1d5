"""Training throughput of highrank's AWD-LSTM language model against a plain PyTorch LSTM
language model of the same size, on the same Penn Treebank batches.

A benchmark's peer model, not part of the library: run by
``benchmarks/studies/plain_lstm_vs_awd.py`` (``python -m benchmarks.studies.plain_lstm_vs_awd``
from the repository root, highrank installed) and tested by
``tests/bench/test_plain_lstm_vs_awd.py``.

*Ours* is the model a recipe builds (:func:`highrank.models.build_model`, default
``configs/ptb/small-softmax.toml``) with every AWD regulariser off: no embedding dropout, no
input dropout, no weight drop, no AR/TAR, fixed-length BPTT windows; only the dropouts a
plain model has stay on (between the LSTM layers and on the output; locked here, one mask per
sequence). Each step is :func:`highrank.train.optimization_step`, the step the AWD-LSTM recipe
takes: the head's chunked loss, gradient clipping, SGD with weight decay.

*Plain* is the same network written the usual way (:class:`PlainLSTMLM`): ``nn.Embedding``
-> ``nn.LSTM`` -> ``nn.Dropout`` -> ``nn.Linear`` tied to the embedding, ``F.cross_entropy``
over the whole window, ``clip_grad_norm_``, ``torch.optim.SGD``. AWD-LSTM's layers differ in
size (d_embed -> d_hidden -> ... -> d_last, with d_last = d_embed when tied), which one
``nn.LSTM(num_layers=L)`` cannot express, so the plain model then stacks one ``nn.LSTM`` per
layer with ``nn.Dropout`` between them, of exactly the same sizes (on CPU a multi-layer
``nn.LSTM`` runs the same per-layer kernels in a loop). When every layer has the same size
it is one ``nn.LSTM(num_layers=L, dropout=...)``. It starts from a copy of our weights, and
both compute the same loss in eval mode (checked and recorded).

Timing: both models train in one process on the same windows, *interleaved*: after
``warmup`` untimed steps each, ``repeats`` rounds, each timing ``steps`` consecutive steps of
one model then the same windows on the other (the order alternates per round), so that
machine noise hits both alike. Reported: the median tokens/s of each, the ratio of medians
(ours / plain) and the median of the per-round ratios.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from highrank.config import Config, load_config
from highrank.data import get_batch, load_corpus
from highrank.models import LanguageModel, build_model, count_parameters
from highrank.train import build_optimizer, head_chunk_size, optimization_step, seed_everything
from highrank.util.machine import describe_machine

# Every AWD-LSTM regulariser off; dropout_hidden and dropout_output stay (a plain LM has them).
REGULARIZERS_OFF = (
    "model.dropout_embedding=0",
    "model.dropout_input=0",
    "model.weight_drop=0",
    "model.ar_alpha=0",
    "model.tar_beta=0",
)

Window = tuple[torch.Tensor, torch.Tensor]  # (tokens, target), each (bptt, batch)
LSTMState = list[tuple[torch.Tensor, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class Settings:
    """What to run: ``steps`` timed steps per model per round, ``repeats`` rounds, after
    ``warmup`` untimed steps each, on ``threads`` torch threads."""

    steps: int = 20
    repeats: int = 10
    warmup: int = 10
    threads: int = 2

    def __post_init__(self) -> None:
        for name in ("steps", "repeats", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {value!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be an integer >= 0; got {self.warmup!r}")


def benchmark_config(
    recipe: str | Path, data_dir: str | Path | None = None, overrides: Sequence[str] = ()
) -> Config:
    """The recipe with :data:`REGULARIZERS_OFF` (then ``overrides``), on the CPU."""
    extra = [f"data.dir={data_dir}"] if data_dir is not None else []
    config = load_config(recipe, [*extra, *REGULARIZERS_OFF, "run.device=cpu", *overrides])
    if config.head.name != "softmax" or not config.model.tie_weights:
        raise ValueError(
            f"the plain model is a tied softmax LM; the recipe has head.name = "
            f"{config.head.name!r}, model.tie_weights = {config.model.tie_weights}"
        )
    return config


# ---- the plain model --------------------------------------------------------------------------


class PlainLSTMLM(nn.Module):
    """An LSTM language model written the usual way (PyTorch's word_language_model example):
    embedding -> LSTM layers with dropout between -> dropout -> tied linear decoder.

    ``layer_sizes`` are the hidden sizes of the layers; equal sizes make one
    ``nn.LSTM(num_layers=L, dropout=dropout_hidden)``, different ones a stack of one-layer
    ``nn.LSTM`` modules with ``nn.Dropout(dropout_hidden)`` between them. The last size must
    be ``d_embed`` (the tied decoder).
    """

    def __init__(
        self,
        vocab_size: int,
        d_embed: int,
        layer_sizes: Sequence[int],
        dropout_hidden: float,
        dropout_output: float,
    ) -> None:
        super().__init__()
        if layer_sizes[-1] != d_embed:
            raise ValueError(f"tying needs a last layer of d_embed={d_embed}; got {layer_sizes}")
        self.layer_sizes = tuple(layer_sizes)
        self.embedding = nn.Embedding(vocab_size, d_embed)
        self.stacked = len(set(self.layer_sizes)) == 1
        if self.stacked:
            n, size = len(self.layer_sizes), self.layer_sizes[0]
            dropout = dropout_hidden if n > 1 else 0.0
            self.lstms = nn.ModuleList([nn.LSTM(d_embed, size, num_layers=n, dropout=dropout)])
        else:
            inputs = (d_embed, *self.layer_sizes[:-1])
            self.lstms = nn.ModuleList(
                nn.LSTM(i, o) for i, o in zip(inputs, self.layer_sizes, strict=True)
            )
        self.hidden_dropout = nn.Dropout(dropout_hidden)
        self.output_dropout = nn.Dropout(dropout_output)
        self.decoder = nn.Linear(d_embed, vocab_size)
        self.decoder.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor, state: LSTMState) -> tuple[torch.Tensor, LSTMState]:
        """tokens (T, B) -> logits (T, B, V) and the new state (one (h, c) per module)."""
        x = self.embedding(tokens)  # (T, B, d_embed)
        new_state = []
        for i, (lstm, lstm_state) in enumerate(zip(self.lstms, state, strict=True)):
            if i > 0:
                x = self.hidden_dropout(x)
            x, lstm_state = lstm(x, lstm_state)  # (T, B, H_i)
            new_state.append(lstm_state)
        return self.decoder(self.output_dropout(x)), new_state

    def init_state(self, batch_size: int) -> LSTMState:
        like = self.embedding.weight
        return [(like.new_zeros(m.num_layers, batch_size, m.hidden_size),) * 2 for m in self.lstms]

    def copy_from(self, model: LanguageModel) -> None:
        """Take the weights of ``model`` (an AWD-LSTM with a tied softmax head of our sizes)."""
        backbone = model.backbone
        with torch.no_grad():
            self.embedding.weight.copy_(backbone.embedding.weight)
            self.decoder.bias.copy_(model.head.bias)
            for layer, wrapped in enumerate(backbone.layers):
                lstm, suffix = (
                    (self.lstms[0], f"l{layer}") if self.stacked else (self.lstms[layer], "l0")
                )
                for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                    source = getattr(wrapped.lstm, f"{kind}_l0")
                    getattr(lstm, f"{kind}_{suffix}").copy_(source)


def build_plain(config: Config, ours: LanguageModel) -> PlainLSTMLM:
    """The plain model of ``ours``'s sizes and dropouts, starting from its weights."""
    backbone = ours.backbone
    plain = PlainLSTMLM(
        backbone.vocab_size,
        backbone.d_embed,
        backbone.layer_sizes,
        config.model.dropout_hidden,
        config.model.dropout_output,
    )
    plain.copy_from(ours)
    return plain


# ---- one training step of each --------------------------------------------------------------


class OursRunner:
    """Our model, trained by :func:`highrank.train.optimization_step` with the recipe's SGD,
    weight decay and clipping (fixed BPTT: the lr scale is 1); the hidden state carried."""

    name = "ours"

    def __init__(self, config: Config, model: LanguageModel) -> None:
        self.config, self.model = config, model
        t = config.train
        self.optimizer = build_optimizer(model, t.lr, t.weight_decay)
        self.params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.state = model.init_state(t.batch_size)
        self.losses: list[float] = []

    def step(self, window: Window) -> None:
        tokens, target = window
        t = self.config.train
        outcome = optimization_step(
            self.model,
            self.optimizer,
            self.params,
            tokens,
            target,
            self.state,
            chunk_size=head_chunk_size(self.config),
            clip=t.clip,
            lr_scale=tokens.size(0) / t.bptt,
        )
        if outcome.nll is None:
            raise RuntimeError(f"ours: a training step was skipped: the {outcome.skip_reason}")
        self.state = outcome.state
        self.losses.append(outcome.nll)


class PlainRunner:
    """The plain model trained the usual way: cross_entropy, clip_grad_norm_, SGD."""

    name = "plain"

    def __init__(self, config: Config, model: PlainLSTMLM) -> None:
        self.config, self.model = config, model
        t = config.train
        self.optimizer = torch.optim.SGD(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
        self.state = model.init_state(t.batch_size)
        self.losses: list[float] = []

    def step(self, window: Window) -> None:
        tokens, target = window
        self.optimizer.zero_grad(set_to_none=True)
        logits, state = self.model(tokens, self.state)  # (T, B, V)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), target.reshape(-1))
        loss.backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), self.config.train.clip)
        self.optimizer.step()
        self.state = [(h.detach(), c.detach()) for h, c in state]
        self.losses.append(loss.item())


Runner = OursRunner | PlainRunner


@torch.no_grad()
def eval_loss_difference(ours: LanguageModel, plain: PlainLSTMLM, window: Window) -> float:
    """|ours - plain| mean NLL of ``window`` in eval mode from zero states: about 1e-6 when the
    two are the same function."""
    ours.eval()
    plain.eval()
    tokens, target = window
    nll, _, _ = ours(tokens, target, ours.init_state(tokens.size(1)))
    logits, _ = plain(tokens, plain.init_state(tokens.size(1)))
    reference = F.cross_entropy(logits.view(-1, logits.size(-1)), target.reshape(-1))
    ours.train()
    plain.train()
    return abs(float(nll) - float(reference))


# ---- timing ---------------------------------------------------------------------------------


def training_windows(config: Config, source: torch.Tensor, count: int) -> list[Window]:
    """``count`` consecutive full windows ``(bptt, batch)`` of ``source`` (the batchified
    training split), cycled if it has fewer."""
    bptt = config.train.bptt
    available = (source.size(0) - 1) // bptt
    if available < 1:
        raise ValueError(
            f"the training split of {config.data.dir} has {source.size(0)} rows at batch size "
            f"{config.train.batch_size}: too few for one window of bptt {bptt}"
        )
    return [get_batch(source, (i % available) * bptt, bptt) for i in range(count)]


def time_block(runner: Runner, windows: Sequence[Window]) -> float:
    """Seconds to train ``runner`` on ``windows``, one step each."""
    start = time.perf_counter()
    for window in windows:
        runner.step(window)
    return time.perf_counter() - start


def run_benchmark(
    config: Config, settings: Settings = Settings(), progress: Callable[[str], None] | None = None
) -> dict:
    """Build both models, time them interleaved, and return the result record."""
    say = progress or (lambda message: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        return _run(config, settings, say)
    finally:
        torch.set_num_threads(threads)


def _run(config: Config, settings: Settings, say: Callable[[str], None]) -> dict:
    data = config.data
    corpus = load_corpus(data.dir, mode=data.mode, cache_dir=data.cache_dir)
    source = corpus.batchify("train", config.train.batch_size)
    windows = training_windows(config, source, settings.warmup + settings.repeats * settings.steps)
    seed_everything(config.train.seed)
    ours = build_model(config, len(corpus.vocab))
    plain = build_plain(config, ours)
    difference = eval_loss_difference(ours, plain, windows[0])
    runners: dict[str, Runner] = {
        "ours": OursRunner(config, ours),
        "plain": PlainRunner(config, plain),
    }
    for runner in runners.values():
        time_block(runner, windows[: settings.warmup])
    seconds: dict[str, list[float]] = {"ours": [], "plain": []}
    for r in range(settings.repeats):
        start = settings.warmup + r * settings.steps
        block = windows[start : start + settings.steps]
        order = ("ours", "plain") if r % 2 == 0 else ("plain", "ours")
        for name in order:
            seconds[name].append(time_block(runners[name], block))
        say(f"round {r + 1}/{settings.repeats}: " + ", ".join(_rate(seconds, n) for n in order))
    tokens = settings.steps * config.train.bptt * config.train.batch_size
    return _record(config, settings, runners, seconds, tokens, difference)


def _rate(seconds: dict[str, list[float]], name: str) -> str:
    return f"{name} {seconds[name][-1]:.2f} s"


def _record(config, settings, runners, seconds, tokens, difference) -> dict:
    rates = {name: [tokens / s for s in values] for name, values in seconds.items()}
    medians = {name: statistics.median(values) for name, values in rates.items()}
    paired = [a / b for a, b in zip(rates["ours"], rates["plain"], strict=True)]
    m, t = config.model, config.train
    ours, plain = runners["ours"].model, runners["plain"].model
    models = {
        name: {
            "parameters": count_parameters(model),
            "median_tokens_per_s": round(medians[name], 1),
            "tokens_per_s": [round(v, 1) for v in rates[name]],
            "median_ms_per_step": round(1000 * tokens / medians[name] / settings.steps, 2),
            "mean_train_loss_timed": round(
                statistics.fmean(runners[name].losses[settings.warmup :]), 4
            ),
        }
        for name, model in (("ours", ours), ("plain", plain))
    }
    models["ours"]["description"] = (
        f"highrank AWD-LSTM ({m.n_layers} nn.LSTM layers {list(ours.backbone.layer_sizes)}, "
        f"regularisers off, locked dropout hidden {m.dropout_hidden} / output "
        f"{m.dropout_output}) + softmax head (chunk_size {head_chunk_size(config)!r}), "
        "highrank.train.optimization_step"
    )
    models["plain"]["description"] = (
        f"plain PyTorch LSTM LM ({_plain_layers(plain)}, nn.Dropout hidden {m.dropout_hidden} / "
        f"output {m.dropout_output}, tied nn.Linear, F.cross_entropy, clip_grad_norm_, SGD)"
    )
    return {
        "benchmark": "plain-lstm-vs-awd",
        "machine": describe_machine(threads=settings.threads),
        "settings": dataclasses.asdict(settings)
        | {
            "data_dir": str(config.data.dir),
            "batch_size": t.batch_size,
            "bptt": t.bptt,
            "tokens_per_step": t.bptt * t.batch_size,
            "lr": t.lr,
            "weight_decay": t.weight_decay,
            "clip": t.clip,
            "d_embed": m.d_embed,
            "layer_sizes": list(ours.backbone.layer_sizes),
            "regularizers_off": list(REGULARIZERS_OFF),
        },
        "models": models,
        "same_parameter_count": models["ours"]["parameters"] == models["plain"]["parameters"],
        "eval_loss_difference": difference,
        "ratio_of_medians": round(medians["ours"] / medians["plain"], 4),
        "median_of_round_ratios": round(statistics.median(paired), 4),
    }


def _plain_layers(plain: PlainLSTMLM) -> str:
    sizes = list(plain.layer_sizes)
    if plain.stacked:
        return f"one nn.LSTM(num_layers={len(sizes)}) of {sizes[0]}"
    return f"one nn.LSTM per layer, sizes {sizes} (they differ, so no num_layers=L)"


# ---- reporting ------------------------------------------------------------------------------


def markdown_table(result: dict) -> str:
    """The result as a Markdown table with the machine and settings above it."""
    machine, s = result["machine"], result["settings"]
    ours, plain = result["models"]["ours"], result["models"]["plain"]
    same = "same" if result["same_parameter_count"] else "DIFFERENT"
    lines = [
        f"Machine: {machine['cpu']}, {machine['cpu_count']} cores, torch {machine['torch']} "
        f"({machine['torch_threads']} threads)",
        f"Batch {s['batch_size']} x BPTT {s['bptt']} = {s['tokens_per_step']} tokens per step; "
        f"median of {s['repeats']} interleaved rounds of {s['steps']} steps after {s['warmup']} "
        f"warm-up steps each; {same} parameter count; eval-mode loss difference "
        f"{result['eval_loss_difference']:.1e}.",
        "",
        "| model | parameters | median tokens/s | ms/step | range tokens/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, row in (("ours (highrank AWD-LSTM)", ours), ("plain PyTorch LSTM LM", plain)):
        low, high = min(row["tokens_per_s"]), max(row["tokens_per_s"])
        lines.append(
            f"| {name} | {row['parameters']:,} | "
            f"{row['median_tokens_per_s']:,.0f} | {row['median_ms_per_step']:.1f} | "
            f"{low:,.0f}-{high:,.0f} |"
        )
    lines += [
        "",
        f"Ours / plain: {result['ratio_of_medians']:.3f} (ratio of medians), "
        f"{result['median_of_round_ratios']:.3f} (median of per-round ratios).",
        "",
        f"- ours: {ours['description']}",
        f"- plain: {plain['description']}",
    ]
    return "\n".join(lines) + "\n"


__all__ = [
    "REGULARIZERS_OFF",
    "OursRunner",
    "PlainLSTMLM",
    "PlainRunner",
    "Settings",
    "benchmark_config",
    "build_plain",
    "markdown_table",
    "run_benchmark",
]
