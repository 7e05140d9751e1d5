"""One vocabulary across the analyze verbs (issue 31 item 9): ``--which`` names the checkpoint
and ``--max-contexts`` the number of contexts in every verb that has them; the old spellings
(saturation's ``--checkpoint``, gradient-bottleneck's ``--max-tokens``) still work, hidden,
and mean the same."""

from __future__ import annotations

import json
import shutil

import pytest

from highrank.cli import build_parser, main

# verb -> (takes --which, takes --max-contexts)
VERBS = {
    "rank": (True, True),
    "kl": (True, True),
    "topk": (True, True),
    "similarity": (True, False),
    "hidden-size": (True, True),
    "unargmaxable": (True, False),
    "saturation": (True, True),
    "gradient-bottleneck": (True, True),
}
REQUIRED = {"topk": ["--random", "3"]}  # what a verb cannot parse without
# the old spellings: verb -> [(new argv, old argv)]
ALIASES = {
    "saturation": [(["--which", "last"], ["--checkpoint", "last"]),
                   (["--which", "a.pt", "--which", "best"], ["--checkpoint", "a.pt",
                                                             "--which", "best"])],
    "gradient-bottleneck": [(["--max-contexts", "7"], ["--max-tokens", "7"])],
}  # fmt: skip


def parse(*argv: str, parser=None):
    return vars((parser or build_parser()).parse_args(["analyze", *argv]))


def test_every_analyze_verb_is_here():
    from highrank.cli.analyze import ANALYSES

    assert set(ANALYSES) == set(VERBS)


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_each_verb_speaks_which_and_max_contexts(verb):
    which, contexts = VERBS[verb]
    argv = [verb, "RUN", *REQUIRED.get(verb, [])]
    if which:
        argv += ["--which", "last"]
    if contexts:
        argv += ["--max-contexts", "9"]
    args = parse(*argv)
    if which:
        assert args["which"] in ("last", ["last"])
    if contexts:
        assert args["max_contexts"] == 9


@pytest.mark.parametrize(
    "verb, new, old", [(verb, new, old) for verb, pairs in ALIASES.items() for new, old in pairs]
)
def test_old_spellings_mean_the_same(verb, new, old):
    parser = build_parser()
    assert parse(verb, "RUN", *new, parser=parser) == parse(verb, "RUN", *old, parser=parser)


@pytest.mark.parametrize("verb", sorted(ALIASES))
def test_old_spellings_are_hidden_from_help(verb, capsys):
    with pytest.raises(SystemExit):
        main(["analyze", verb, "--help"])
    text = capsys.readouterr().out
    assert "--which" in text and "--max-contexts" in text
    assert "--checkpoint" not in text and "--max-tokens" not in text


def test_saturation_which_and_checkpoint_give_the_same_record(tiny_run, tmp_path, capsys):
    run = shutil.copytree(tiny_run, tmp_path / "run")
    # some checkpoints only are named by them (never over the whole curve's record)
    record = run / "analysis" / "saturation-test-first20-last.json"
    base = ["analyze", "saturation", str(run), "--max-contexts", "20", "--no-progress"]
    records = []
    for argv in (["--which", "last"], ["--checkpoint", str(run / "checkpoints" / "last.pt")]):
        assert main([*base, *argv]) == 0
        records.append(json.loads(record.read_text()))
    strip = [{k: v for k, v in point.items() if k != "seconds"}
             for r in records for point in r["checkpoints"]]  # fmt: skip
    assert len(strip) == 2 and strip[0] == strip[1] and strip[0]["checkpoint"] == "last.pt"
    # a short name applies to each run; a .pt path to one
    two = [*base[:3], str(run), *base[3:]]
    assert main([*two, "--which", "last"]) == 0  # each run's last.pt
    assert main([*two, "--which", "nonesuch"]) == 2
    assert "--which nonesuch names no checkpoint" in capsys.readouterr().err
    assert main([*two, "--which", "x.pt"]) == 2
    assert "names a file of one run" in capsys.readouterr().err


def test_gradient_bottleneck_max_contexts_and_max_tokens_give_the_same_record(tiny_run, tmp_path):
    run = shutil.copytree(tiny_run, tmp_path / "run")
    record = run / "analysis" / "gradient-bottleneck-test-last-first15.json"
    base = ["analyze", "gradient-bottleneck", str(run), "--which", "last", "--no-progress"]
    records = []
    for argv in (["--max-contexts", "15"], ["--max-tokens", "15"]):
        assert main([*base, *argv]) == 0
        records.append({k: v for k, v in json.loads(record.read_text()).items()
                        if k not in ("seconds", "elapsed_seconds")})  # fmt: skip
    assert records[0] == records[1] and records[0]["n_tokens"] == 15
