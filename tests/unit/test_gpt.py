"""The gpt model and its token sets: what the model-parallel strategies rely on."""

from __future__ import annotations

import torch

from workers.data import load, text
from workers.models.gpt import GPT
from workers.spec import JobSpec


def small() -> GPT:
    torch.manual_seed(0)
    return GPT(32, layers=5, width=16, heads=4, context=8)


def test_pipeline_stages_keep_the_full_models_names_and_together_hold_all_of_it():
    full = small()
    names = set(full.state_dict())
    stages = [full.stage(s, 3) for s in range(3)]
    parts = [set(stage.state_dict()) for stage in stages]
    assert set().union(*parts) == names
    assert sum(len(p) for p in parts) == len(names)  # no parameter in two stages
    assert [list(stage.layers) for stage in stages] == [["0", "1"], ["2", "3"], ["4"]]
    assert stages[0].tok is not None and stages[1].tok is None and stages[2].head is not None
    # The stages share the model's modules (one copy of the weights), and leave it whole.
    assert stages[2].head is full.head and set(full.state_dict()) == names


def test_stages_chained_compute_what_the_whole_model_computes():
    tokens = torch.randint(0, 32, (2, 8))
    stages = [small().stage(s, 3) for s in range(3)]
    h = tokens
    for stage in stages:
        h = stage(h)
    assert torch.equal(h, small()(tokens))


def test_tensor_plan_splits_every_linear_of_every_block():
    model = small()
    plan = model.tensor_parallel_plan()
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("layers.")}
    assert set(plan) == linears


def test_attention_is_causal():
    model = small().eval()
    a = torch.randint(0, 32, (1, 8))
    b = a.clone()
    b[0, -1] = (a[0, -1] + 1) % 32  # change only the last token
    assert torch.equal(model(a)[0, :-1], model(b)[0, :-1])


def test_python_source_corpus_is_the_same_on_every_read_with_a_fixed_alphabet():
    one, two = text.python_source(None, 5000), text.python_source(None, 5000)
    assert one == two and len(one) == 5000
    tokens = text.encode(one)
    assert int(tokens.max()) < text.VOCAB_SIZE
    assert text.decode(tokens.tolist()) == "".join(c if c in text.ALPHABET else "\ufffd" for c in one)


def test_token_splits_pair_inputs_with_next_tokens_and_hold_out_the_tail():
    spec = JobSpec.model_validate({"model": {"name": "gpt", "context": 16}, "dataset": {
        "name": "python_source", "max_chars": 20000, "val_fraction": 0.25}})
    splits = load(spec.dataset, seed=0, context=16)
    x, y = splits.train.batch(torch.tensor([0, 1]))
    assert x.shape == y.shape == (2, 16)
    assert torch.equal(x[0, 1:], y[0, :-1]) and y[0, -1] == x[1, 0]  # windows follow each other
    assert splits.num_classes == text.VOCAB_SIZE
    assert len(splits.val) == round((len(splits.train) + len(splits.val)) * 0.25)


def test_synthetic_tokens_are_learnable_counting_sequences():
    seq = text.synthetic_tokens(size=100, vocab_size=50, context=10, seed=1, noise=0.0)
    steps = (seq[:, 1:] - seq[:, :-1]) % 50
    assert (steps == steps[:, :1]).all()  # one stride per sequence


def test_communication_time_counts_overlapping_ranges_once():
    from workers.profiling import covered

    # A send and a receive in flight together, then a gap, then one collective.
    assert covered([(0, 10), (2, 8), (5, 12), (20, 25)]) == 17
    assert covered([]) == 0
