"""The tiny GPT and the synthetic corpus: shapes, determinism, sharding, learnability."""

import math

import pytest
import torch
import torch.nn as nn

from toolkit.models import Block, GPTConfig, SyntheticCorpus, tiny_gpt


@pytest.fixture
def one_thread():
    """Tiny matmuls run faster on one thread than fighting over two cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def build(seed=0, **overrides):
    torch.manual_seed(seed)
    return tiny_gpt(**overrides)


# --- the model ---------------------------------------------------------------------------------


@pytest.mark.parametrize("d_model, n_head", [(32, 2), (30, 5), (21, 7), (8, 1)])
def test_shapes_with_uneven_widths(d_model, n_head):
    model = build(d_model=d_model, n_head=n_head, vocab_size=37, seq_len=11, n_layer=2)
    x = torch.randint(37, (3, 11))
    assert model(x).shape == (3, 11, 37)
    assert model(x[:, :5]).shape == (3, 5, 37)  # shorter than seq_len is fine
    loss = model(x, torch.randint(37, (3, 11)))
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert model.config.d_ff == 4 * d_model


def test_structure_and_init():
    model = build(n_layer=3, d_ff=50)
    assert isinstance(model.blocks, nn.ModuleList) and len(model.blocks) == 3
    assert all(isinstance(b, Block) for b in model.blocks)
    assert model.head.bias is None
    assert model.blocks[0].mlp.fc.out_features == 50
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.all(p == 0), name
        elif "ln" in name:
            assert torch.all(p == 1), name
        else:  # Linear and Embedding weights ~ N(0, 0.02)
            assert abs(p.std().item() - 0.02) < 0.006, name


def test_tied_head_is_one_parameter():
    model = build()
    assert model.head.weight is model.tok_emb.weight
    names = [n for n, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "head.weight" not in names
    loss = model(*SyntheticCorpus().batch(0, 4))
    loss.backward()
    grad = model.tok_emb.weight.grad
    assert grad is not None and model.head.weight.grad is grad  # both uses land in one gradient

    untied = build(tied_head=False)
    assert untied.head.weight is not untied.tok_emb.weight
    V, D = untied.config.vocab_size, untied.config.d_model
    assert untied.num_params() == model.num_params() + V * D


def test_causal_future_tokens_do_not_change_the_past():
    model = build()
    x = torch.randint(64, (2, 16))
    x2 = x.clone()
    x2[:, 10:] = (x2[:, 10:] + 1) % 64
    with torch.no_grad():
        assert torch.allclose(model(x)[:, :10], model(x2)[:, :10], atol=1e-6)
        assert not torch.allclose(model(x)[:, 10:], model(x2)[:, 10:])


def test_same_seed_same_model_different_seed_different_model():
    a, b, c = build(seed=1), build(seed=1), build(seed=2)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)
    x = torch.randint(64, (2, 8))
    assert torch.equal(a(x), b(x))


def test_plain_loop_trains_the_model_on_the_corpus(one_thread):
    corpus = SyntheticCorpus(vocab_size=64, seq_len=32, seed=0)
    model = build(n_layer=1, d_model=32, n_head=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(120):
        loss = model(*corpus.batch(step, 16))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-10:]) / 10
    floor, uniform = corpus.entropy_floor(), math.log(64)
    assert first > 0.9 * uniform  # starts near knowing nothing
    assert last < first - 2.0  # a clear drop
    assert last < 0.4 * uniform  # well below log(vocab)
    assert last > floor - 0.05  # and never (noticeably) better than the best possible


class TupleMLP(nn.Module):
    """A stand-in for MoE: dense output plus an auxiliary loss we can predict."""

    def __init__(self, d_model, aux_value):
        super().__init__()
        self.linear = nn.Linear(d_model, d_model)
        self.aux_value = aux_value

    def forward(self, x):
        return self.linear(x), torch.tensor(self.aux_value) + 0 * self.linear.weight.sum()


def test_pluggable_mlp_adds_aux_loss():
    x, y = SyntheticCorpus().batch(0, 4)
    torch.manual_seed(0)
    plugged = tiny_gpt(mlp_factory=lambda i: TupleMLP(32, aux_value=float(i + 1)), n_layer=2)
    assert isinstance(plugged.blocks[1].mlp, TupleMLP)
    logits = plugged(x)  # no targets: logits only, aux dropped
    ce = nn.functional.cross_entropy(logits.reshape(-1, 64), y.reshape(-1))
    loss = plugged(x, y)
    assert loss.item() == pytest.approx(ce.item() + 0.01 * (1.0 + 2.0), abs=1e-6)
    loss.backward()
    assert plugged.blocks[0].mlp.linear.weight.grad is not None

    torch.manual_seed(0)
    weighted = tiny_gpt(mlp_factory=lambda i: TupleMLP(32, aux_value=1.0), n_layer=2, aux_loss_weight=0.5)
    ce2 = nn.functional.cross_entropy(weighted(x).reshape(-1, 64), y.reshape(-1))
    assert weighted(x, y).item() == pytest.approx(ce2.item() + 0.5 * 2.0, abs=1e-6)


def test_plugged_mlp_keeps_its_own_init():
    torch.manual_seed(0)
    mlps = []

    def factory(i):
        m = nn.Linear(32, 32)
        nn.init.constant_(m.weight, 0.5)
        mlps.append(m)
        return m

    model = tiny_gpt(mlp_factory=factory)  # a plain module (no aux) works too
    assert all(torch.all(m.weight == 0.5) for m in mlps)
    loss = model(*SyntheticCorpus().batch(0, 2))
    assert loss.dim() == 0


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(d_model=30, n_head=4), ["d_model=30", "n_head=4", "[1, 2, 3, 5, 6, 10, 15, 30]"]),
        (dict(n_layer=0), ["n_layer", "positive"]),
        (dict(vocab_size=2.5), ["vocab_size"]),
    ],
)
def test_config_errors(kwargs, words):
    with pytest.raises(ValueError) as info:
        GPTConfig(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_forward_errors():
    model = build(seq_len=8)
    with pytest.raises(ValueError, match="seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="batch, time"):
        model(torch.zeros(9, dtype=torch.long))
    with pytest.raises(ValueError, match="shape"):
        model(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="nn.Module"):
        tiny_gpt(mlp_factory=lambda i: lambda x: x)


# --- the corpus --------------------------------------------------------------------------------


def test_batch_shapes_and_shift():
    corpus = SyntheticCorpus(vocab_size=50, seq_len=12, seed=3)
    x, y = corpus.batch(5, 6)
    assert x.shape == y.shape == (6, 12) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
    assert x.min() >= 0 and x.max() < 50 and y.max() < 50


def test_tokens_follow_the_chain():
    corpus = SyntheticCorpus(seed=1)
    x, y = corpus.batch(0, 64)
    assert torch.all(corpus.transition[x, y] > 0)  # every observed transition is allowed
    assert int((corpus.transition > 0).sum(dim=1).max()) == corpus.branching


def test_batches_are_a_pure_function_of_seed_step_and_size():
    a, b = SyntheticCorpus(seed=0), SyntheticCorpus(seed=0)
    torch.manual_seed(123)  # the global RNG plays no part
    xa, ya = a.batch(7, 8)
    torch.manual_seed(456)
    xb, yb = b.batch(7, 8)
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a.batch(8, 8)[0], xa)  # another step, another batch
    assert not torch.equal(SyntheticCorpus(seed=1).batch(7, 8)[0], xa)  # another seed, another corpus
    assert torch.equal(a.transition, b.transition)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ranks_together_see_the_global_batch(world_size):
    corpus = SyntheticCorpus(seed=2)
    per_rank = 3
    x, y = corpus.batch(4, per_rank * world_size)
    slices = [corpus.batch(4, per_rank * world_size, rank=r, world_size=world_size) for r in range(world_size)]
    assert all(xs.shape == (per_rank, corpus.seq_len) for xs, _ in slices)
    assert torch.equal(torch.cat([xs for xs, _ in slices]), x)
    assert torch.equal(torch.cat([ys for _, ys in slices]), y)
    shards = [SyntheticCorpus.shard(x, y, r, world_size) for r in range(world_size)]
    assert all(torch.equal(s[0], b[0]) and torch.equal(s[1], b[1]) for s, b in zip(shards, slices))


def test_corpus_errors():
    corpus = SyntheticCorpus()
    with pytest.raises(ValueError, match="does not divide evenly over world_size=4"):
        corpus.batch(0, 10, rank=0, world_size=4)
    with pytest.raises(ValueError, match="rank must be"):
        corpus.batch(0, 8, rank=4, world_size=4)
    with pytest.raises(ValueError, match="world_size"):
        corpus.batch(0, 8, rank=0, world_size=0)
    with pytest.raises(ValueError, match="global_batch_size"):
        corpus.batch(0, 0)
    with pytest.raises(ValueError, match="step"):
        corpus.batch(-1, 8)
    x, y = corpus.batch(0, 6)
    with pytest.raises(ValueError, match="divide"):
        SyntheticCorpus.shard(x, y, 0, 4)
    with pytest.raises(ValueError, match="branching"):
        SyntheticCorpus(vocab_size=4, branching=5)


def test_entropy_floor_matches_the_samples():
    corpus = SyntheticCorpus(seed=0)
    floor = corpus.entropy_floor()
    assert 0 < floor < math.log(corpus.branching) + 1e-9 < corpus.uniform_loss()
    # the true model's loss on real batches estimates the floor
    x, y = corpus.batch(0, 512)
    nll = -corpus.transition[x, y].log().mean().item()
    assert nll == pytest.approx(floor, abs=0.05)
