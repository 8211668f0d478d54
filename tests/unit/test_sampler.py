"""workers/data/sampler.py: a global batch independent of world size, resumable mid-epoch."""

from __future__ import annotations

import pytest
import torch

from workers.data.sampler import ResumableDistributedSampler

N, G, SEED = 203, 12, 5  # 203 // 12 = 16 steps, a ragged tail of 11 dropped


def samplers(world_size, num_samples=N, global_batch=G, seed=SEED):
    return [ResumableDistributedSampler(num_samples, global_batch, rank=r, world_size=world_size, seed=seed)
            for r in range(world_size)]


def step_batches(world_size, epoch, **kw):
    """For each step, the list of each rank's indices."""
    per_rank = [list(s.batches(epoch)) for s in samplers(world_size, **kw)]
    steps = []
    for k in range(len(per_rank[0])):
        assert all(batches[k][0] == k for batches in per_rank)
        steps.append([batches[k][1] for batches in per_rank])
    return steps


@pytest.mark.parametrize("epoch", [0, 3])
def test_global_batch_is_the_same_for_world_sizes_1_2_4(epoch):
    one, two, four = (step_batches(w, epoch) for w in (1, 2, 4))
    assert len(one) == len(two) == len(four) == N // G
    for k in range(N // G):
        reference = one[k][0]
        assert len(reference) == G
        for world, ranks in ((2, two[k]), (4, four[k])):
            assert all(len(idx) == G // world for idx in ranks)
            union = torch.cat(ranks)
            assert sorted(union.tolist()) == sorted(reference.tolist())
            assert len(set(union.tolist())) == G  # no sample on two ranks
            # Rank r takes the r-th slice, so concatenating the ranks is the global batch itself.
            assert torch.equal(union, reference)


def test_an_epoch_visits_distinct_samples_and_drops_the_ragged_tail():
    (sampler,) = samplers(1)
    assert sampler.steps_per_epoch == 16
    seen = torch.cat([idx for _, idx in sampler.batches(0)]).tolist()
    assert len(seen) == 16 * G
    assert len(set(seen)) == len(seen)
    assert all(0 <= i < N for i in seen)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("start", [1, 7, 15])
def test_resume_mid_epoch_yields_the_tail_of_an_uninterrupted_epoch(world_size, start):
    for sampler in samplers(world_size):
        full = list(sampler.batches(2))
        resumed = list(sampler.batches(2, start))
        assert [k for k, _ in resumed] == list(range(start, sampler.steps_per_epoch))
        assert len(resumed) == len(full) - start
        for (k1, a), (k2, b) in zip(resumed, full[start:]):
            assert k1 == k2 and torch.equal(a, b)


def test_resume_at_the_end_of_an_epoch_yields_nothing():
    (sampler,) = samplers(1)
    assert list(sampler.batches(0, sampler.steps_per_epoch)) == []


def test_a_fresh_sampler_repeats_the_same_order():
    a, b = samplers(1)[0], samplers(1)[0]
    assert torch.equal(a.permutation(4), b.permutation(4))


def test_different_epochs_give_different_orders():
    (sampler,) = samplers(1)
    orders = [torch.cat([idx for _, idx in sampler.batches(e)]) for e in range(3)]
    assert not torch.equal(orders[0], orders[1])
    assert not torch.equal(orders[1], orders[2])
    assert not torch.equal(orders[0], orders[2])
    # The same sample set each epoch apart from the dropped tail: permutations of 0..N-1.
    for e in range(3):
        assert sorted(sampler.permutation(e).tolist()) == list(range(N))


def test_different_seeds_give_different_orders():
    a = samplers(1, seed=1)[0].permutation(0)
    b = samplers(1, seed=2)[0].permutation(0)
    assert not torch.equal(a, b)


def test_a_world_size_that_does_not_divide_the_batch_still_covers_it_once():
    """Elastic jobs run at sizes that need not divide the global batch: shares differ by
    at most one sample and together are exactly the batch of one process."""
    whole = [idx for _, idx in ResumableDistributedSampler(100, 10, rank=0, world_size=1, seed=3).batches(0)]
    shares = [list(ResumableDistributedSampler(100, 10, rank=r, world_size=4, seed=3).batches(0)) for r in range(4)]
    assert [len(s[0][1]) for s in shares] == [2, 3, 2, 3]
    for k, batch in enumerate(whole):
        assert torch.cat([s[k][1] for s in shares]).tolist() == batch.tolist()


def test_world_larger_than_the_global_batch_is_rejected():
    with pytest.raises(ValueError, match=r"training.global_batch_size \(3\) is smaller than the 4 data-parallel ranks"):
        ResumableDistributedSampler(100, 3, rank=0, world_size=4, seed=0)


def test_fewer_samples_than_one_global_batch_is_rejected():
    with pytest.raises(ValueError, match=r"has 30 samples, fewer than one global batch \(training.global_batch_size = 64\)"):
        ResumableDistributedSampler(30, 64, rank=0, world_size=1, seed=0)


def test_exactly_one_global_batch_is_accepted():
    sampler = ResumableDistributedSampler(64, 64, rank=1, world_size=2, seed=0)
    assert sampler.steps_per_epoch == 1
    assert [len(idx) for _, idx in sampler.batches(0)] == [32]


@pytest.mark.parametrize("rank", [2, -1])
def test_rank_outside_the_world_is_rejected(rank):
    with pytest.raises(ValueError, match="rank"):
        ResumableDistributedSampler(100, 8, rank=rank, world_size=2, seed=0)
