"""Unargmaxable tokens: planted interior points are found, points on a sphere are all
argmaxable, the LP agrees with brute force in 2-D (an exact hull test on R^2, polygon vertex
enumeration in a box), every witness is real (checked here in float64, independently of the
module), monotone pointwise heads keep softmax's argmax set, MoS cannot rescue a dominated
token (the module's theorem, checked numerically) and Mixtape can (found by search)."""

from __future__ import annotations

import itertools
import json
import shutil
import sys

import numpy as np
import pytest
import torch

from highrank.analysis.unargmaxable import (
    ARGMAXABLE_CODES,
    UnargmaxableError,
    _Layer,
    find_unargmaxable,
    head_layer,
    precheck,
    search_argmax_input,
    verify_witnesses,
)
from highrank.cli import main
from highrank.heads import build_head


def sphere(n: int, d: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    points = rng.standard_normal((n, d))
    return points / np.linalg.norm(points, axis=1, keepdims=True)


def planted(n: int, d: int, interior: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(W, interior ids)``: n points on the unit sphere, then ``interior`` rows replaced by
    random convex combinations of the sphere points (strictly inside the hull)."""
    rng = np.random.default_rng(seed + 1000)
    weight = sphere(n, d, seed)
    ids = rng.choice(n, size=interior, replace=False)
    outer = np.setdiff1d(np.arange(n), ids)
    for i in ids:
        weight[i] = rng.dirichlet(np.ones(len(outer))) @ weight[outer]
    return weight, np.sort(ids)


def assert_witness(weight, bias, token, point, radius):
    """Independent float64 check: ``point`` makes ``token`` the unique argmax, in the box."""
    logits = weight @ point + (0 if bias is None else bias)
    others = np.delete(logits, token)
    assert logits[token] > others.max(), f"token {token}: margin {logits[token] - others.max()}"
    if radius is not None:
        assert np.abs(point).max() <= radius


# ---- known answers ---------------------------------------------------------------------------


@pytest.mark.parametrize("radius", [100.0, None])
@pytest.mark.parametrize(
    ("n", "d", "interior", "seed"), [(30, 2, 1, 0), (60, 3, 2, 1), (80, 5, 3, 2)]
)
def test_planted_interior_points_are_exactly_the_unargmaxable_tokens(n, d, interior, seed, radius):
    weight, ids = planted(n, d, interior, seed)
    report = find_unargmaxable(weight, radius=radius, keep_witnesses=True)
    np.testing.assert_array_equal(report.unargmaxable, ids)
    assert len(report.undecided) == 0
    for token in np.flatnonzero(report.argmaxable):
        assert_witness(weight, None, token, report.witnesses[token], radius)
    assert np.isnan(report.witnesses[ids]).all()


@pytest.mark.parametrize(("n", "d"), [(200, 4), (500, 8)])
def test_points_on_a_sphere_are_all_argmaxable(n, d):
    # w_i . w_i = 1 > w_i . w_j for distinct unit vectors: every point is a vertex.
    weight = sphere(n, d, seed=n)
    report = find_unargmaxable(weight, keep_witnesses=True)
    assert report.argmaxable.all() and len(report.unargmaxable) == 0
    for token in range(n):
        assert_witness(weight, None, token, report.witnesses[token], 100.0)


def test_duplicate_rows_tie_or_lose():
    weight = np.array([[1.0, 0], [0, 1], [-1, 0], [0, -1], [1, 0], [0, -1]])
    bias = np.array([0.0, 0, 0, 0.5, 0, 0.2])
    # Tokens 0 and 4: same row, same bias -> both always tie. Tokens 3 and 5: same row, token
    # 5's bias is lower -> 5 always loses to 3, and 3 is a vertex.
    report = find_unargmaxable(weight, bias, radius=None)
    np.testing.assert_array_equal(report.unargmaxable, [0, 4, 5])
    assert report.counts()["duplicate"] == 3
    assert set(np.flatnonzero(report.argmaxable)) == {1, 2, 3}


# ---- brute force in 2-D ---------------------------------------------------------------------


def hull_argmaxable(weight: np.ndarray, bias: np.ndarray) -> set[int]:
    """Exact on R^2 (Grivas et al. compare with QHull likewise): i is the strict argmax of
    w . h + b for some h iff (w_i, b_i) is a vertex of an upper facet (outward normal with a
    positive last coordinate) of the hull of the lifted points (w_j, b_j) in R^3."""
    from scipy.spatial import ConvexHull

    hull = ConvexHull(np.column_stack([weight, bias]))
    upper = hull.equations[:, 2] > 1e-12
    return {int(v) for facet in hull.simplices[upper] for v in facet}


def box_argmaxable(weight: np.ndarray, bias: np.ndarray, radius: float) -> set[int]:
    """Exact in the box |h_k| <= R of R^2, by vertex enumeration: the region of i is the
    polygon cut out by the lines (w_i - w_j) . h + b_i - b_j = 0 and the box edges; its
    vertices are among the pairwise intersections of those lines; i is argmaxable iff the
    feasible intersections span a positive area."""
    found = set()
    for i in range(len(weight)):
        normals = [weight[i] - weight[j] for j in range(len(weight)) if j != i]
        offsets = [bias[i] - bias[j] for j in range(len(weight)) if j != i]
        for axis, sign in itertools.product((0, 1), (1.0, -1.0)):  # -sign h_axis + R >= 0
            normals.append(-sign * np.eye(2)[axis])
            offsets.append(radius)
        normals, offsets = np.array(normals), np.array(offsets)  # region: normals.h + offsets >= 0
        vertices = []
        for a, b in itertools.combinations(range(len(normals)), 2):
            system = normals[[a, b]]
            if abs(np.linalg.det(system)) < 1e-12:
                continue
            point = np.linalg.solve(system, -offsets[[a, b]])
            if (normals @ point + offsets >= -1e-9).all():
                vertices.append(point)
        if len(vertices) >= 3 and _area(np.array(vertices)) > 1e-12:
            found.add(i)
    return found


def _area(points: np.ndarray) -> float:
    from scipy.spatial import ConvexHull, QhullError

    try:
        return float(ConvexHull(points).volume)  # in 2-D, volume is the area
    except QhullError:  # collinear: no area
        return 0.0


@pytest.mark.parametrize("patience", [10, 0])  # 0: no reflections, the LP decides more
@pytest.mark.parametrize("seed", range(6))
def test_the_lp_matches_an_exact_hull_test_on_the_plane(seed, patience):
    rng = np.random.default_rng(seed)
    weight, bias = rng.standard_normal((14, 2)), rng.standard_normal(14)
    report = find_unargmaxable(weight, bias, radius=None, patience=patience, keep_witnesses=True)
    assert set(np.flatnonzero(report.argmaxable)) == hull_argmaxable(weight, bias)
    assert len(report.undecided) == 0
    for token in np.flatnonzero(report.argmaxable):  # unbounded: witnesses may be large
        assert_witness(weight, bias, token, report.witnesses[token], None)


@pytest.mark.parametrize(("seed", "radius"), [(0, 1.0), (1, 2.0), (2, 3.0), (3, 0.5)])
def test_the_lp_matches_vertex_enumeration_in_a_box(seed, radius):
    rng = np.random.default_rng(seed + 10)
    weight, bias = rng.standard_normal((12, 2)), rng.standard_normal(12)
    report = find_unargmaxable(weight, bias, radius=radius, patience=0)
    assert report.counts()["lp-witness"] > 0  # the LP's own witnesses are checked too
    expected = box_argmaxable(weight, bias, radius)
    assert 0 < len(expected) < 12  # the box matters: some tokens need a larger h
    assert set(np.flatnonzero(report.argmaxable)) == expected
    assert len(report.undecided) == 0


# ---- the pre-check never claims an unargmaxable token --------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_the_precheck_only_claims_tokens_with_a_real_witness(seed):
    rng = np.random.default_rng(seed)
    weight, ids = planted(120, 4, 6, seed)
    bias = 0.05 * rng.standard_normal(120)
    # An interior row whose bias is below every other bias is dominated: b_i < sum λ_j b_j.
    bias[ids] = bias.min() - 0.1
    layer = _Layer(weight, bias)
    found, how, points = precheck(layer, np.arange(120), None, patience=20)
    assert not found[ids].any()
    for token in np.flatnonzero(found):
        assert how[token] in ARGMAXABLE_CODES
        assert_witness(weight, bias, token, points[token].astype(np.float32), None)


def test_verification_rejects_ties_and_resolves_margins_below_float32_rounding():
    weight = np.array([[1.0, 0.0], [1.0, 1e-9], [-1.0, 0.0]])
    layer = _Layer(weight, None)
    # h = (1, -1): z_0 = 1, z_1 = 1 - 1e-9, equal in float32; float64 tells token 0 wins.
    ok, margins = verify_witnesses(layer, np.array([0, 1]), np.array([[1.0, -1.0]] * 2), None)
    assert ok.tolist() == [True, False]
    assert margins[0] == pytest.approx(1e-9, rel=1e-6)
    # h = 0 ties every token; h outside the box is refused even where it wins.
    ok, _ = verify_witnesses(layer, np.array([0, 2]), np.array([[0.0, 0.0], [-5.0, 0.0]]), 1.0)
    assert ok.tolist() == [False, False]


# ---- heads: monotone pointwise, MoS, Mixtape -----------------------------------------------

POINTWISE = [
    ("sigsoftmax", {}),
    ("gss", {"center": -1.5, "slope": 2.5}),
    ("gss", {"center": 0.5, "slope": 0.3}),  # k < 1 is still strictly increasing
    ("plif", {"n_pieces": 1000}),
]


def head_with_layer(name: str, weight: np.ndarray, bias: np.ndarray | None = None, **knobs):
    """A float64 head of d_in = d whose decoder is ``weight`` (and ``bias``)."""
    torch.manual_seed(0)
    vocab, d = weight.shape
    head = build_head(name, d_in=d, vocab_size=vocab, **knobs).double().eval()
    with torch.no_grad():
        head.weight.copy_(torch.from_numpy(weight))
        head.bias.copy_(torch.zeros(vocab) if bias is None else torch.from_numpy(bias))
    return head


@pytest.mark.parametrize(("name", "knobs"), POINTWISE)
def test_monotone_pointwise_heads_have_softmax_argmax(name, knobs):
    rng = np.random.default_rng(0)
    weight, bias = rng.standard_normal((50, 6)), rng.standard_normal(50)
    head = head_with_layer(name, weight, bias, **knobs)
    hidden = 3.0 * rng.standard_normal((400, 6))
    with torch.no_grad():
        chosen = head.log_prob(torch.from_numpy(hidden)).argmax(dim=1).numpy()
    np.testing.assert_array_equal(chosen, (hidden @ weight.T + bias).argmax(axis=1))


@pytest.mark.parametrize(("name", "knobs"), POINTWISE)
def test_softmax_witnesses_are_witnesses_for_monotone_heads(name, knobs):
    weight, ids = planted(40, 3, 2, seed=7)
    report = find_unargmaxable(weight, radius=5.0, keep_witnesses=True)
    np.testing.assert_array_equal(report.unargmaxable, ids)
    head = head_with_layer(name, weight, **knobs)
    argmaxable = np.flatnonzero(report.argmaxable)
    with torch.no_grad():
        chosen = head.log_prob(torch.from_numpy(report.witnesses[argmaxable])).argmax(dim=1)
    np.testing.assert_array_equal(chosen.numpy(), argmaxable)
    g, margin = search_argmax_input(head, int(ids[0]), d_in=3, steps=100, restarts=1)
    assert g is None and margin <= 0  # as the theorem says: never the strict argmax


def circle_with_interior_token() -> np.ndarray:
    """Token 0 at (0.2, 0.1), strictly inside the regular octagon of tokens 1..8."""
    angles = np.linspace(0, 2 * np.pi, 9)[:-1]
    return np.vstack([[0.2, 0.1], np.column_stack([np.cos(angles), np.sin(angles)])])


def test_mos_cannot_rescue_a_dominated_token():
    weight = circle_with_interior_token()
    assert find_unargmaxable(weight, radius=None).unargmaxable.tolist() == [0]
    # The certificate: w_0 as a convex combination of the octagon (barycentric in one
    # triangle of it), with no bias.
    triangle = [1, 2, 5]  # (1, 0), (0.71, 0.71), (-1, 0)
    coefficients = np.linalg.solve(
        np.vstack([weight[triangle].T, np.ones(3)]), np.array([0.2, 0.1, 1.0])
    )
    assert (coefficients > 0).all()
    head = head_with_layer("mos", weight, n_components=3, latent_dropout=0.0)
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):  # random MoS parameters and inputs: p(0) <= sum_j lambda_j p(j)
        with torch.no_grad():
            for name, parameter in head.named_parameters():
                if name not in ("weight", "bias"):
                    parameter.copy_(3.0 * torch.randn(parameter.shape, generator=generator))
            p = head.log_prob(3.0 * torch.randn(64, 2, generator=generator, dtype=torch.float64))
        p = p.exp().numpy()
        assert (p[:, 0] <= p[:, triangle] @ coefficients * (1 + 1e-12)).all()
    g, margin = search_argmax_input(head, 0, d_in=2, train_head=True, steps=300, restarts=2)
    assert g is None and margin <= 0


@pytest.mark.parametrize("frequent_fraction", [1.0, 0.2])
def test_mixtape_can_make_an_interior_token_the_argmax(frequent_fraction):
    # Token 0 is frequent (id < S) in both settings, so it mixes a context of its own.
    weight = circle_with_interior_token()
    head = head_with_layer("mixtape", weight, gate_dim=2, frequent_fraction=frequent_fraction)
    g, margin = search_argmax_input(head, 0, d_in=2, train_head=True, steps=500, restarts=4)
    assert g is not None and margin > 0
    with torch.no_grad():  # independently: the head (float64, eval) puts token 0 first
        log_p = head.log_prob(g)[0]
    assert int(log_p.argmax()) == 0 and log_p[0] > log_p[1:].max()


def test_head_layer_says_what_is_analysed():
    head = build_head("mos", d_in=4, vocab_size=10)
    weight, bias, domain, meaning = head_layer(head, "mos")
    assert weight.shape == (10, 4) and domain == "unbounded" and "MoS" in meaning
    assert head_layer(build_head("moc", d_in=4, vocab_size=10), "moc")[2] == "box 1"
    with pytest.raises(UnargmaxableError, match="Mixtape gives every frequent token"):
        head_layer(build_head("mixtape", d_in=4, vocab_size=10, gate_dim=2), "mixtape")


@pytest.mark.parametrize(
    ("weight", "bias", "radius", "message"),
    [
        (np.zeros((1, 3)), None, 1.0, "V >= 2"),
        (np.zeros((4, 3)), np.zeros(5), 1.0, r"bias must have shape \(4,\)"),
        (np.full((4, 3), np.nan), None, 1.0, "NaN"),
        (np.zeros((4, 3)), None, -1.0, "radius must be"),
    ],
)
def test_bad_layers_are_named(weight, bias, radius, message):
    with pytest.raises(UnargmaxableError, match=message):
        find_unargmaxable(weight, bias, radius=radius)


# ---- command line ------------------------------------------------------------------------------


def test_the_command_line_on_a_run(tiny_run, tmp_path, capsys):
    run = shutil.copytree(tiny_run, tmp_path / "run")
    status = main(
        [
            "analyze",
            "unargmaxable",
            str(run),
            "--radius",
            "1",
            "--no-progress",
            "--out",
            str(tmp_path),
        ]
    )
    assert status == 0
    record = json.loads((run / "analysis" / "unargmaxable-best-box1.json").read_text())
    assert record["head"] == "softmax" and record["domain"] == "box |h_k| <= 1"
    assert record["argmaxable"] + record["unargmaxable"] + record["undecided"] == 43
    assert len(record["unargmaxable_tokens"]) == record["unargmaxable"]
    assert (tmp_path / "unargmaxable.md").is_file()
    assert main(["analyze", "unargmaxable"]) == 2
    assert main(["analyze", "unargmaxable", "--hf", str(tmp_path)]) == 2
    assert "--hf needs --out" in capsys.readouterr().err


def test_the_command_line_on_a_hugging_face_model(tmp_path, monkeypatch, capsys):
    transformers = pytest.importorskip(
        "transformers", reason="the hf extra (transformers) is not installed"
    )
    pytest.importorskip("tokenizers", reason="the hf extra (tokenizers) is not installed")
    from tokenizers import Tokenizer, models, pre_tokenizers

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    words = ["[UNK]", *"the a of cat dog sat on mat ran far near house".split()]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    config = transformers.GPT2Config(vocab_size=len(words), n_embd=4, n_layer=1, n_head=1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # make token 3 ("of") a convex combination of tokens 1 and 2
        embedding = model.get_output_embeddings().weight
        embedding[3] = 0.5 * embedding[1] + 0.5 * embedding[2]
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    out = tmp_path / "out"
    argv = ["analyze", "unargmaxable", "--hf", str(tmp_path / "model"), "--unbounded"]
    assert main([*argv, "--out", str(out), "--no-progress"]) == 0
    record = json.loads(next(out.glob("unargmaxable-*-unbounded.json")).read_text())
    assert record["head"] == "lm_head" and record["hidden_size"] == 4 and not record["bias"]
    assert 3 in record["unargmaxable_ids"] and "of" in record["unargmaxable_tokens"]
    weight = model.get_output_embeddings().weight.detach().double().numpy()
    expected = find_unargmaxable(weight, radius=None).unargmaxable.tolist()
    assert record["unargmaxable_ids"] == expected


def test_a_mos_run_is_analysed_on_all_of_r_d(tmp_path):
    from tests.conftest import train_tiny_run

    run = train_tiny_run(tmp_path, "mos", "head.name=mos", "head.n_components=2")
    assert main(["analyze", "unargmaxable", str(run), "--no-progress"]) == 0
    # MoS: the domain is R^d whatever --radius says (the theorem needs no box).
    record = json.loads((run / "analysis" / "unargmaxable-best-unbounded.json").read_text())
    assert record["head"] == "mos" and record["domain"] == "all of R^d"
    assert "unargmaxable for MoS too" in record["analysed"]


def test_a_missing_hf_extra_is_one_clear_line(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    argv = ["analyze", "unargmaxable", "--hf", str(folder), "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "transformers" in error and "pip install" in error and "Traceback" not in error
