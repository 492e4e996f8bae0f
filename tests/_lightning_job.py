"""Run under torchrun by tests/test_frameworks.py: a Lightning Trainer whose DDPStrategy
starts the group with process_group_backend="ringdp". Writes RINGDP_TEST_OUT/rank<r>.pt:
the backend and the parameters after the steps of _accelerate_model."""
import os

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

import ringdp  # noqa: F401 -- registers the backend
from _accelerate_model import STEPS, batch, model_and_optimizer


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net, _ = model_and_optimizer()

    def training_step(self, b, i):
        x, y = b
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Batches(torch.utils.data.Dataset):
    """Step i's full batch, this rank's half."""

    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def __len__(self):
        return STEPS

    def __getitem__(self, i):
        x, y = batch(i)
        return x[self.rank::self.world], y[self.rank::self.world]


r, w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
m = Model()
trainer = L.Trainer(accelerator="cpu", devices=w, strategy=DDPStrategy(process_group_backend="ringdp"), max_epochs=1,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    use_distributed_sampler=False)
trainer.fit(m, torch.utils.data.DataLoader(Batches(r, w), batch_size=None, shuffle=False))
torch.save({"backend": dist.get_backend(), "params": [p.detach().clone() for p in m.net.parameters()]},
           os.path.join(os.environ["RINGDP_TEST_OUT"], f"rank{r}.pt"))
