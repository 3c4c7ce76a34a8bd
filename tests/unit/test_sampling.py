import torch

from worker.sampling import RowSampler, sample_batch

CPU = torch.device("cpu")


def test_near_zero_temperature_is_greedy():
    logits = torch.tensor([0.0, 3.0, 1.0])
    s = RowSampler(5e-324, 1.0, 0, seed=1, device=CPU)
    assert s.greedy and s.generator is None and s.sample(logits) == 1


def test_top_k_one_and_tiny_top_p_pick_the_argmax():
    logits = torch.tensor([0.5, 2.0, 1.9, -1.0])
    for _ in range(20):
        assert RowSampler(1.0, 1.0, 1, None, CPU).sample(logits) == 1
        assert RowSampler(1.0, 0.01, 0, None, CPU).sample(logits) == 1


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    seen = {RowSampler(1.0, 0.8, 0, seed, CPU).sample(logits) for seed in range(200)}
    assert seen == {0, 1}


def test_seed_reproducible_whatever_shares_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)

    def draw(rows):
        samplers = [RowSampler(0.8, 0.95, 0, 7, CPU)] + [RowSampler(1.0, 1.0, 0, None, CPU) for _ in rows[1:]]
        return [sample_batch(logits[rows], samplers)[0] for _ in range(10)]

    assert draw([0]) == draw([0, 1, 2])
