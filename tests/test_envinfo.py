"""env.json records what a run's numbers depend on."""

from __future__ import annotations

import cv2
import numpy as np
import torch
import torchvision

from detscale.engine.envinfo import environment


def test_environment_names_the_numeric_libraries() -> None:
    env = environment("abc123", threads_per_rank=1)
    assert env["torch"] == torch.__version__
    assert env["numpy"] == np.__version__
    assert env["opencv"] == cv2.__version__
    assert env["torchvision"] == torchvision.__version__
    assert env["config_hash"] == "abc123" and env["threads_per_rank"] == 1
    assert env["gpu_count"] == torch.cuda.device_count()
