"""Multi-Facet Softmax and Softmax-CPR (heads/mfs.py, heads/cpr.py) against their papers'
equations, written here position by position in float64, independently of the heads' code;
their warm start in every configuration; what they read (heads/sequence.py): a context
longer than the rows (generation with a cache), time-major layout, padding, chunks that read
only their own sequences, and one-line errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from highrank.heads import base_init_knobs, build_head
from highrank.heads.kernels import reference_paths
from highrank.heads.sequence import ContextRows
from tests.conftest import head_inputs

D, V = 12, 50

CPR_VARIANTS = {
    "CPR": {},
    "C": {"pointer": False, "reranker_k1": 0, "reranker_k2": 0},
    "P": {"context_partition": False, "reranker_k1": 0, "reranker_k2": 0},
    "R": {"context_partition": False, "pointer": False},
    "MoS+CPR": {"n_components": 3},
    "no-Mi": {"multi_input": False},
    "raw-Mi": {"normalize_inputs": False},  # the paper's Mi
}
MFS_VARIANTS = {
    "MFS": {},
    "partitions-only": {"n_components": 1},
    "MoS+Mi": {"n_partitions": 1},
    "Mi-only": {"n_components": 1, "n_partitions": 1},  # one softmax: rank-bounded
    "no-Mi": {"multi_input": False, "n_partitions": 2},
    "raw-Mi": {"normalize_inputs": False},  # the paper's Mi
}
VARIANTS = [("cpr", k) for k in CPR_VARIANTS] + [("mfs", k) for k in MFS_VARIANTS]


def make(name: str, variant: str, **knobs):
    small = {"reranker_k1": 10, "reranker_k2": 4} if name == "cpr" else {"n_partitions": 3}
    given = {**small, **(CPR_VARIANTS if name == "cpr" else MFS_VARIANTS)[variant], **knobs}
    return build_head(name, d_in=D, vocab_size=V, **given)


def randomise(head) -> None:
    """Every parameter random and away from zero (the paper init leaves biases at 0)."""
    with torch.no_grad():
        for param in head.parameters():
            param.copy_(0.3 * torch.randn_like(param))


def context(batch=3, length=9, history=0):
    """Hidden states (B, T, D), their layers over a context of ``history`` earlier positions
    (three layers, top last) and that context's ids, words repeating and some padding."""
    layers = [torch.randn(batch, history + length, D, dtype=torch.float64) for _ in range(3)]
    ids = torch.randint(0, 8, (batch, history + length))
    ids[0, 1] = -1  # padding
    return layers[-1][:, history:], layers, ids


# ---- the papers' equations, position by position -----------------------------------------


def mi_reference(head, layers, b, t):
    """q_t = [g_t ; GELU(L^h [l_L(t); l_L(t-1); ...; l_1(t-W)])] with zeros before the start."""
    top = layers[-1][b, t]
    if not head.multi_input:
        return top
    used = layers[len(layers) - head.input_layers :]
    if head.normalize_inputs:  # each position's vector over its features
        used = [layer / (layer.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() for layer in used]
    parts = []
    for layer in reversed(used):
        for k in range(head.input_window + 1):
            parts.append(layer[b, t - k] if t - k >= 0 else torch.zeros_like(top))
    mlp = head.inputs.mlp
    hidden = mlp.weight.double() @ torch.cat(parts) + mlp.bias.double()
    return torch.cat([top, F.gelu(hidden, approximate="tanh")])


def facet(head, i, q):
    w = head.facets.linear.weight.double()[i * head.d_embed : (i + 1) * head.d_embed]
    c = head.facets.linear.bias.double()[i * head.d_embed : (i + 1) * head.d_embed]
    return w @ q + c


def mixture(head, q, first_logits, other_facets):
    """log sum_k pi_k softmax(z_k): the first softmax given, the others one facet each."""
    E, b = head.weight.double(), head.bias.double()
    logits = [first_logits] + [E @ facet(head, i, q) + b for i in other_facets]
    log_p = torch.stack([torch.log_softmax(z, -1) for z in logits])
    if head.gate is None:
        return log_p[0]
    prior = torch.log_softmax(head.gate.weight.double() @ q + head.gate.bias.double(), -1)
    return torch.logsumexp(prior[:, None] + log_p, dim=0)


def cpr_reference(head, layers, ids, b, t):
    E, bias = head.weight.double(), head.bias.double()
    index = head.facet_index
    q = mi_reference(head, layers, b, t)
    z = E @ facet(head, 0, q) + bias
    for stage, top in (("rerank1", head.reranker_k1), ("rerank2", head.reranker_k2)):
        if top:
            chosen = z.topk(top).indices
            z = z.clone()
            z[chosen] = E[chosen] @ facet(head, index[stage], q) + bias[chosen]
    earlier = {}  # word -> its earlier positions j < t
    for j in range(t):
        if ids[b, j] >= 0:
            earlier.setdefault(int(ids[b, j]), []).append(j)
    z = z.clone()
    for word, positions in earlier.items():
        if head.context_partition:
            z[word] = E[word] @ facet(head, index["context"], q) + bias[word]
        if head.pointer:
            query = facet(head, index["pointer_query"], q)
            keys = [
                facet(head, index["pointer_key"], mi_reference(head, layers, b, j))
                for j in positions
            ]
            z[word] = z[word] + torch.stack([query @ k for k in keys]).mean()
    return mixture(head, q, z, range(1, head.n_components))


def mfs_reference(head, layers, b, t):
    E, bias = head.weight.double(), head.bias.double()
    q = mi_reference(head, layers, b, t)
    parts = head.n_partitions
    z = torch.stack([E[x] @ facet(head, x % parts, q) + bias[x] for x in range(V)])
    return mixture(head, q, z, range(parts, parts + head.n_components - 1))


@pytest.mark.parametrize("name, variant", VARIANTS)
def test_the_heads_compute_their_papers_equations(name, variant):
    head = make(name, variant).double()
    randomise(head)
    hidden, layers, ids = context(history=2)
    inputs = {"layers": layers[3 - head.input_layers :]}
    if name == "cpr":
        inputs["context_ids"] = ids
    for paths in (False, True):
        with reference_paths(paths), torch.no_grad():
            got = head.log_prob(hidden, **inputs)  # (B, T, V)
        for b in range(3):
            for t in range(9):
                position = 2 + t  # in the context
                if name == "cpr":
                    expected = cpr_reference(head, layers, ids, b, position)
                else:
                    expected = mfs_reference(head, layers, b, position)
                torch.testing.assert_close(got[b, t], expected, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("variant", ["CPR", "C", "P", "R", "MoS+CPR"])
def test_cprs_gradients_are_its_equations_gradients(variant):
    """The loss's gradients, for every parameter and every input, equal those of the
    position-by-position reference (words repeat in the context: a repeated word's logit
    counts once)."""
    head = make("cpr", variant).double()
    randomise(head)
    hidden, layers, ids = context(history=2)
    layers = [layer.clone().requires_grad_(True) for layer in layers]
    hidden = layers[-1][:, 2:]
    target = torch.randint(0, V, hidden.shape[:-1])
    for paths in (False, True):
        with reference_paths(paths):
            head.zero_grad()
            head.loss(hidden, target, layers=layers, context_ids=ids, chunk_size=7,
                      reduction="none").sum().backward()
        got = [p.grad.clone() for p in head.parameters()] + [x.grad.clone() for x in layers]
        head.zero_grad()
        for layer in layers:
            layer.grad = None
        reference = -sum(cpr_reference(head, layers, ids, b, 2 + t)[target[b, t]]
                         for b in range(3) for t in range(9))
        reference.backward()
        expected = [p.grad for p in head.parameters()] + [x.grad for x in layers]
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, atol=1e-9, rtol=1e-9)
        for layer in layers:
            layer.grad = None


# ---- warm start -----------------------------------------------------------------------------


@pytest.mark.parametrize("d_embed", [D, 9], ids=["same-width", "projected"])
@pytest.mark.parametrize("name, variant", VARIANTS)
def test_every_configuration_starts_at_the_softmax_it_replaces(name, variant, d_embed):
    softmax = build_head("softmax", d_in=D, vocab_size=V, d_embed=d_embed)
    torch.nn.init.normal_(softmax.bias)
    head = make(name, variant, **base_init_knobs(name, {"d_embed": d_embed}))
    with torch.no_grad():
        head.weight.copy_(softmax.weight)
        head.bias.copy_(softmax.bias)
    head.start_at_base(softmax.projection)
    hidden, layers, ids = context(history=3)
    hidden, layers = 3.0 * hidden.float(), [3.0 * layer.float() for layer in layers]
    inputs = {"layers": layers[3 - head.input_layers :]}
    if name == "cpr":
        inputs["context_ids"] = ids
    torch.testing.assert_close(
        head.log_prob(hidden, **inputs), softmax.log_prob(hidden), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("variant, bounded", [("Mi-only", True), ("MFS", False)])
def test_mfs_with_one_softmax_is_rank_bounded_and_with_its_facets_is_not(variant, bounded):
    """One softmax over one facet of Mi's q (the warm-start study's ``mfs1`` control) has a
    log-prob matrix of rank <= d + 2, whatever it reads; MFS's facets break that bound."""
    head = make("mfs", variant).double()
    randomise(head)
    _, layers, _ = context(batch=4, length=20)
    with torch.no_grad():
        matrix = head.log_prob(layers[-1], layers=layers).reshape(-1, V)  # (80, V)
    rank = torch.linalg.matrix_rank(matrix).item()
    assert (rank <= D + 2) == bounded and rank > D // 2


@pytest.mark.parametrize("name", ["mfs", "cpr"])
def test_one_step_from_the_base_leaves_it(name):
    """The facets' zero columns and the pointer's zero query get gradients at the start."""
    head = make(name, "MFS" if name == "mfs" else "CPR", input_layers=2)
    head.start_at_base()
    hidden, layers, ids = context()
    hidden, layers = hidden.float(), [layer.float() for layer in layers[1:]]
    inputs = {"layers": layers, **({"context_ids": ids} if name == "cpr" else {})}
    before = head.log_prob(hidden, **inputs).detach()
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-2)
    target = torch.randint(0, V, hidden.shape[:-1])
    head.loss(hidden, target, **inputs).backward()
    if name == "cpr":
        query = head.facet_index["pointer_query"]
        rows = slice(query * head.d_embed, (query + 1) * head.d_embed)
        assert head.facets.linear.weight.grad[rows].abs().max() > 0
    optimizer.step()
    assert (head.log_prob(hidden, **inputs) - before).abs().max() > 1e-4


# ---- what the heads read ----------------------------------------------------------------------


@pytest.mark.parametrize("name, variant", [("mfs", "MFS"), ("cpr", "CPR"), ("cpr", "C")])
def test_a_context_before_the_rows_gives_what_the_whole_window_gives(name, variant):
    """Generation with a cache hands the last positions and the context so far (MFS and CPR
    without a pointer compute Mi over the rows' windows only, CPR's pointer over it all)."""
    head = make(name, variant, input_layers=3)
    randomise(head)
    hidden, layers, ids = context(length=10)
    hidden, layers = hidden.float(), [layer.float() for layer in layers]
    inputs = {"layers": layers, **({"context_ids": ids} if name == "cpr" else {})}
    whole = head.log_prob(hidden, **inputs)
    for last in (1, 4):
        torch.testing.assert_close(
            head.log_prob(hidden[:, -last:], **inputs), whole[:, -last:], atol=1e-6, rtol=1e-6
        )


@pytest.mark.parametrize("name", ["mfs", "cpr"])
def test_time_major_rows_equal_batch_first_rows(name):
    head = make(name, "MFS" if name == "mfs" else "CPR", input_layers=3)
    randomise(head)
    hidden, layers, ids = context()
    hidden, layers = hidden.float(), [layer.float() for layer in layers]
    target = torch.randint(0, V, hidden.shape[:-1])
    first = {"layers": layers, **({"context_ids": ids} if name == "cpr" else {})}
    major = {"layers": [layer.transpose(0, 1) for layer in layers]}
    if name == "cpr":
        major["context_ids"] = ids.t()
    expected = head.log_prob(hidden, **first)
    losses = head.loss(hidden, target, reduction="none", **first)
    head.time_dim = 0
    torch.testing.assert_close(
        head.log_prob(hidden.transpose(0, 1), **major).transpose(0, 1), expected
    )
    got = head.loss(hidden.transpose(0, 1), target.t(), reduction="none", chunk_size=4, **major)
    torch.testing.assert_close(got.t(), losses)


def test_chunks_route_the_pointer_keys_gradients_to_every_layer_and_position():
    """The keys of earlier positions (a SharedRows input) get their gradients chunk by chunk
    on the gradient-in-forward path: equal to the whole batch's, for every layer."""
    head = make("cpr", "CPR", input_layers=3)
    randomise(head)
    _, layers, ids = context(length=7, history=2)
    layers = [layer.float().requires_grad_(True) for layer in layers]
    target = torch.randint(0, V, (3, 7))
    grads = []
    for chunk_size in (None, 1, 5):
        hidden = layers[-1][:, 2:]
        loss = head.loss(hidden, target, chunk_size=chunk_size, layers=layers, context_ids=ids)
        grads.append(torch.autograd.grad(loss, [*layers, *head.parameters()]))
    for chunked in grads[1:]:
        for got, expected in zip(chunked, grads[0], strict=True):
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    assert grads[0][0][:, :2].abs().max() > 0  # the history reaches the loss through P


def test_a_chunk_reads_only_the_sequences_of_its_rows():
    ids = torch.zeros(4, 10, dtype=torch.long)  # 4 sequences, 6 rows each after 4 of history
    rows = ContextRows(ids, torch.zeros(4, 10, 0), length=6, history=4)
    assert rows.sequences(slice(0, 6)) == slice(0, 1)
    assert rows.sequences(slice(5, 13)) == slice(0, 3)
    chunk = rows[slice(5, 13)]
    assert chunk.ids.shape == (3, 10)
    assert chunk.row_seq().tolist() == [0, 1, 1, 1, 1, 1, 1, 2]
    assert chunk.row_pos().tolist() == [9, 4, 5, 6, 7, 8, 9, 4]
    assert chunk.sequence_runs() == [(0, 0, 1), (1, 1, 7), (2, 7, 8)]  # each row's own only
    query, table = torch.randn(8, 3), torch.randn(3, 10, 3)
    rows = zip(chunk.row_seq().tolist(), query, strict=True)
    expected = torch.stack([table[s] @ q for s, q in rows])
    torch.testing.assert_close(chunk.scores(query, table), expected)


@pytest.mark.parametrize("chunk_size", [None, 4])
@pytest.mark.parametrize("history", [0, 3])
@pytest.mark.parametrize("name, variant", VARIANTS)
def test_no_row_reads_a_later_token_state_or_target(name, variant, history, chunk_size):
    """Leak guard: row t's distribution and loss depend on the context up to t only. Changing
    the ids, every layer's states and the targets from row ``p`` on leaves the rows before
    ``p`` exactly as they were, chunked or not, with or without a history before the rows (an
    off-by-one in Mi's window, in the "earlier positions" mask of C and P, in the pointer's
    keys or in a chunk's row positions would show here). The changed states do reach row p,
    and, for C and P, the changed ids reach row p + 1: the check can fail."""
    head = make(name, variant).double()
    randomise(head)
    hidden, layers, ids = context(length=9, history=history)
    target = torch.randint(0, V, hidden.shape[:-1])
    p = 5  # among the rows; history + p in the context
    at = history + p
    late_layers = [layer.clone() for layer in layers]
    for layer in late_layers:
        layer[:, at:] = torch.randn_like(layer[:, at:])
    late_ids, late_target = ids.clone(), target.clone()
    late_ids[:, at:] = (ids[:, at:].clamp_min(0) + 1) % 8  # other words, still repeating
    late_target[:, p:] = (target[:, p:] + 1) % V

    def rows(layers, ids, target):
        inputs = {"layers": layers[3 - head.input_layers :]}
        if name == "cpr":
            inputs["context_ids"] = ids
        top = layers[-1][:, history:]
        with torch.no_grad():
            log_p = head.log_prob(top, **inputs)
            loss = head.loss(top, target, reduction="none", chunk_size=chunk_size, **inputs)
        return log_p, loss

    log_p, loss = rows(layers, ids, target)
    late_log_p, late_loss = rows(late_layers, late_ids, late_target)
    torch.testing.assert_close(late_log_p[:, :p], log_p[:, :p], atol=1e-12, rtol=0)
    torch.testing.assert_close(late_loss[:, :p], loss[:, :p], atol=1e-12, rtol=0)
    assert not torch.allclose(late_log_p[:, p], log_p[:, p])  # the states at p reach row p
    if name == "cpr" and (head.context_partition or head.pointer):  # the ids at p: row p + 1
        ids_only = rows(layers, late_ids, target)[0]
        torch.testing.assert_close(ids_only[:, :p], log_p[:, :p], atol=1e-12, rtol=0)
        assert not torch.allclose(ids_only[:, p + 1], log_p[:, p + 1])


def test_padding_and_the_current_token_are_not_in_the_context():
    """C assigns the context partition's logits only to words at earlier positions with a
    token: here facets make that partition's logits differ from the softmax's everywhere."""
    head = make("cpr", "C", input_layers=1, multi_input=False)
    head.start_at_base()
    with torch.no_grad():
        c = head.facet_index["context"] * D
        head.facets.linear.weight[c : c + D].mul_(2.0)  # C's facet: 2 g
    hidden = torch.randn(1, 4, D)
    ids = torch.tensor([[5, -1, 7, 9]])
    got = head.log_prob(hidden, layers=[hidden], context_ids=ids)[0, 3]
    plain = hidden[0, 3] @ head.weight.t() + head.bias
    doubled = 2 * hidden[0, 3] @ head.weight.t() + head.bias
    expected = torch.where(torch.isin(torch.arange(V), torch.tensor([5, 7])), doubled, plain)
    torch.testing.assert_close(got, torch.log_softmax(expected, -1))


def test_what_is_read_is_checked_in_one_line(make_head):
    head = make_head("cpr")
    hidden = torch.randn(2, 5, 12)
    inputs = head_inputs(head, hidden)
    with pytest.raises(
        ValueError,
        match=r"^SoftmaxCPR reads hidden, layers, context_ids: pass "
        r"layers, context_ids \(",
    ):
        head.log_prob(hidden)
    with pytest.raises(TypeError, match=r"^Softmax reads hidden; it was also given layers"):
        make_head("softmax").log_prob(hidden, layers=inputs["layers"])
    with pytest.raises(ValueError, match=r"reads the last 2 layers; got 1"):
        head.log_prob(hidden, layers=inputs["layers"][-1:], context_ids=inputs["context_ids"])
    longer = torch.zeros(2, 6, dtype=torch.long)
    with pytest.raises(ValueError, match=r"context_ids cover 6 positions but the layers 5"):
        head.log_prob(hidden, layers=inputs["layers"], context_ids=longer)
    with pytest.raises(
        ValueError, match=r"layers\[0\] has shape \(2, 4, 12\); expected \(2, >=5, 12\)"
    ):
        head.log_prob(hidden, layers=(hidden[:, 1:], hidden), context_ids=inputs["context_ids"])
    beyond = inputs["context_ids"].clone()
    beyond[1, 2] = head.vocab_size + 7
    with pytest.raises(ValueError, match=rf"^SoftmaxCPR: context_ids must lie below the vocabulary "
                       rf"size {head.vocab_size} \(an id below 0 marks padding\); got "
                       rf"\[{head.vocab_size + 7}\]$"):
        head.log_prob(hidden, layers=inputs["layers"], context_ids=beyond)
    with pytest.raises(TypeError, match=r"^SoftmaxCPR: context_ids must be a tensor of token ids, "
                       r"torch.int64 or torch.int32; got torch.float32$"):
        head.log_prob(hidden, layers=inputs["layers"], context_ids=inputs["context_ids"].float())
    with pytest.raises(TypeError, match=r"; got list$"):
        head.log_prob(hidden, layers=inputs["layers"], context_ids=[[1, 2]])
    with pytest.raises(ValueError, match=r"time_dim=2 is not a time axis"):
        make_head("cpr", time_dim=2).log_prob(hidden, **inputs)
    with pytest.raises(ValueError, match=r"reranker_k1 must be an integer >= 0"):
        make_head("cpr", reranker_k1=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_fused_mixture_nll_has_the_autograd_chains_value_and_gradients(dtype):
    from highrank.heads.functional import mixture_nll
    from highrank.heads.kernels.mixture_nll import may_fuse, mixture_nll_fused

    torch.manual_seed(0)
    logits = (4 * torch.randn(6, 3, V, dtype=dtype)).requires_grad_()
    log_prior = torch.log_softmax(torch.randn(6, 3, dtype=dtype), -1).requires_grad_()
    target = torch.randint(0, V, (6,))
    weights = torch.rand(6, dtype=dtype)  # an incoming gradient other than ones
    values, grads = [], []
    for nll in (mixture_nll, mixture_nll_fused):
        loss = nll(log_prior, logits, target)
        values.append(loss.detach())
        grads.append(torch.autograd.grad((loss * weights).sum(), (log_prior, logits)))
    tolerance = {"atol": 1e-12, "rtol": 1e-12} if dtype == torch.float64 else {}
    torch.testing.assert_close(values[1], values[0], **tolerance)
    for fused, chain in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(fused, chain, **tolerance)
    assert may_fuse(logits)
    with reference_paths():
        assert not may_fuse(logits)  # the reference path is the autograd chain
    # a torch.func transform takes the chain (a custom function has no batching rule)
    seen = []
    torch.func.vmap(lambda row: seen.append(may_fuse(row)) or row.sum())(logits.detach())
    assert seen == [False]
