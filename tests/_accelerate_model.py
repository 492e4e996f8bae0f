"""The model and data of tests/_accelerate_job.py, shared with the single-process reference."""
import torch

STEPS = 5


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def batch(step):
    """The full batch of `step` (8 samples); a rank of a world of 2 takes every other one."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
