"""A few DDP training steps on every rank; each rank writes ``rank{R}.json`` with weight digests.

Run under ``torchrun`` by tests/test_multinode.py: it goes through ``detscale.dist`` exactly as
``detscale train`` does (process group from torchrun's environment, gloo on the CPU), so
identical digests on every rank show that the rendezvous built one working process group.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from detscale import dist


def digest(module: nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    with dist.process_group(timeout_s=60, cpu_threads=1) as info:
        torch.manual_seed(0)  # same initial weights everywhere (DDP also broadcasts rank 0's)
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
        initial = digest(model)
        ddp = DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(1000 + info.rank)  # each rank its own data shard
        data = hashlib.sha256()
        for _ in range(args.steps):
            x, y = torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 2, (4,), generator=gen)
            data.update(x.numpy().tobytes())
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        result = {"rank": info.rank, "world_size": info.world_size, "backend": info.backend,
                  "initial_digest": initial, "weights_digest": digest(model), "data_digest": data.hexdigest()}
        (args.out / f"rank{info.rank}.json").write_text(json.dumps(result))
        dist.barrier()


if __name__ == "__main__":
    main()
