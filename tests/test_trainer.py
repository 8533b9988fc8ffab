"""Unit tests of the trainer's parts: semantics, optimiser groups, warm-up, schedule, EMA,
CPU SyncBatchNorm, atomic checkpoints, timing report, logging per rank."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from detscale import config
from detscale.engine import checkpoint as ckpt_io
from detscale.engine.ema import ModelEMA
from detscale.engine.optim import (
    apply_warmup,
    build_optimizer,
    build_scheduler,
    lr_factor,
    split_parameters,
    warmup_accumulate,
    warmup_iterations,
)
from detscale.engine.semantics import config_digest, derive_semantics
from detscale.engine.timing import RankTiming, timing_report


def _cfg(**train: object) -> config.ExperimentConfig:
    return config.from_dict({
        "dataset": {"name": "x", "synthetic": {"imgsz": 64, "train": 4, "val": 2}},
        "grid": {"gpus": [1, 2, 8], "batch": [16], "precision": ["bf16"], "epochs": 10},
        "train": dict(train),
    })


@pytest.mark.parametrize(("gpus", "scaling", "accumulate", "lr_scale"), [
    (1, "linear", 4, 1.0),  # 16 images x 4 = 64 per step: the nominal batch, no change
    (2, "linear", 2, 1.0),
    (8, "linear", 1, 2.0),  # 128 images per step: twice the nominal batch
    (8, "sqrt", 1, math.sqrt(2.0)),
    (8, "none", 1, 1.0),
])
def test_semantics_accumulate_lr_and_decay(gpus: int, scaling: str, accumulate: int, lr_scale: float) -> None:
    cfg = _cfg(lr_scaling=scaling)
    point = next(p for p in cfg.runs() if p.gpus == gpus)
    sem = derive_semantics(cfg, point, gpus, "cpu")
    assert sem.global_batch == 16 * gpus and sem.accumulate == accumulate
    assert sem.lr0 == pytest.approx(0.01 * lr_scale)
    assert sem.weight_decay == pytest.approx(0.0005 * 16 * gpus * accumulate / 64)
    assert (sem.precision, sem.precision_requested) == ("fp32", "bf16")
    assert "forced to fp32" in sem.precision_note
    assert derive_semantics(cfg, point, gpus, "cuda").precision == "bf16"


def test_channels_last_applies_on_cpu_and_cuda() -> None:
    cfg = _cfg(channels_last=True)
    point = cfg.runs()[0]
    assert derive_semantics(cfg, point, 1, "cpu").channels_last
    assert derive_semantics(cfg, point, 1, "cuda").channels_last
    assert not derive_semantics(_cfg(), point, 1, "cpu").channels_last


def test_channels_last_gives_the_same_loss_and_gradients() -> None:
    """The memory format changes kernels, not the function: float64 loss and gradients agree."""
    from detscale.loss import DetectionLoss
    from detscale.model import build_model

    torch.manual_seed(0)
    dense = build_model("gelan-t", nc=6).double().train()
    fast = build_model("gelan-t", nc=6).double().train()
    fast.load_state_dict(dense.state_dict())
    fast = fast.to(memory_format=torch.channels_last)
    assert all(p.is_contiguous(memory_format=torch.channels_last) and not p.is_contiguous()
               for p in fast.parameters() if p.dim() == 4 and p.shape[2:] != (1, 1))
    x = torch.rand(2, 3, 64, 64, dtype=torch.float64)
    targets = torch.tensor([[0, 1, 0.5, 0.5, 0.4, 0.3], [1, 4, 0.3, 0.6, 0.2, 0.5]], dtype=torch.float64)
    results = []
    for model, inp in ((dense, x), (fast, x.contiguous(memory_format=torch.channels_last))):
        loss, _ = DetectionLoss(model)(model(inp), targets)
        loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_b == pytest.approx(loss_a, rel=1e-10)
    assert max((grads_a[n] - grads_b[n]).abs().max().item() for n in grads_a) < 1e-9


def test_world_size_must_match_the_run() -> None:
    cfg = _cfg()
    with pytest.raises(config.ConfigError, match="2-rank run but 1 rank"):
        derive_semantics(cfg, cfg.runs()[1], 1, "cpu")


def test_digest_ignores_runtime_settings_only() -> None:
    point = _cfg().runs()[0]
    assert config_digest(_cfg(), point) == config_digest(_cfg(workers=7, timeout_s=60), point)
    assert config_digest(_cfg(), point) != config_digest(_cfg(lr0=0.02), point)


def _net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.Conv2d(4, 2, 1))


def test_parameter_groups_and_decay() -> None:
    net = _net()
    groups = split_parameters(net)
    assert [p.shape for p in groups["weight"]] == [(4, 3, 3, 3), (2, 4, 1, 1)]
    assert [p.shape for p in groups["norm_weight"]] == [(4,)]
    assert [p.shape for p in groups["bias"]] == [(4,), (2,)]  # BN bias and conv bias
    opt = build_optimizer(net, "sgd", lr=0.1, momentum=0.9, weight_decay=1e-3)
    decay = {g["name"]: g["weight_decay"] for g in opt.param_groups}
    assert decay == {"weight": 1e-3, "norm_weight": 0.0, "bias": 0.0}
    assert all(g["nesterov"] for g in opt.param_groups)


def test_schedules_and_warmup() -> None:
    for schedule in ("linear", "cosine"):
        f = lr_factor(schedule, 10, 0.01)
        assert f(0) == pytest.approx(1.0) and f(10) == pytest.approx(0.01)
    assert warmup_iterations(3, 10, 100) == 30  # warmup_epochs x batches per epoch (no 100-iteration floor)
    assert warmup_iterations(3, 100, 100) == 300
    assert warmup_iterations(3, 10, 3) == 20  # but the last epoch is never warm-up
    assert warmup_iterations(2.5, 10, 100) == 25
    assert warmup_iterations(0, 10, 4) == warmup_iterations(3, 10, 1) == 0
    ramp = [warmup_accumulate(i, 100, 4) for i in (0, 16, 17, 50, 83, 84, 99, 100, 500)]
    assert ramp == [1, 1, 2, 2, 3, 4, 4, 4, 4]  # numpy rounds halves to even, as the reference does
    net = _net()
    opt = build_optimizer(net, "sgd", lr=0.01, momentum=0.937, weight_decay=0.0)
    build_scheduler(opt, "linear", 10, 0.01)
    apply_warmup(opt, 0, 100, 1.0, warmup_bias_lr=0.1, warmup_momentum=0.8, momentum=0.937)
    lrs = {g["name"]: g["lr"] for g in opt.param_groups}
    assert lrs == {"weight": 0.0, "norm_weight": 0.0, "bias": 0.1}
    assert all(g["momentum"] == pytest.approx(0.8) for g in opt.param_groups)
    apply_warmup(opt, 50, 100, 1.0, warmup_bias_lr=0.1, warmup_momentum=0.8, momentum=0.937)
    lrs = {g["name"]: g["lr"] for g in opt.param_groups}
    assert lrs["weight"] == pytest.approx(0.005) and lrs["bias"] == pytest.approx(0.055)


def test_adamw_groups_and_no_beta1_warmup() -> None:
    net = _net()
    opt = build_optimizer(net, "adamw", lr=1e-3, momentum=0.9, weight_decay=5e-4)
    assert isinstance(opt, torch.optim.AdamW)
    decay = {g["name"]: g["weight_decay"] for g in opt.param_groups}
    assert decay == {"weight": 5e-4, "norm_weight": 0.0, "bias": 0.0}
    assert all(g["betas"] == (0.9, 0.999) for g in opt.param_groups)
    build_scheduler(opt, "linear", 10, 0.01)
    # as in the reference trainer, warm-up ramps SGD's momentum but leaves AdamW's betas alone
    apply_warmup(opt, 50, 100, 1.0, warmup_bias_lr=0.0, warmup_momentum=0.8, momentum=0.9)
    assert all(g["betas"] == (0.9, 0.999) for g in opt.param_groups)
    assert all("momentum" not in g for g in opt.param_groups)
    assert {g["name"]: g["lr"] for g in opt.param_groups}["weight"] == pytest.approx(5e-4)
    x = torch.randn(2, 3, 8, 8)
    net(x).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'"):
        build_optimizer(net, "lamb", lr=1e-3, momentum=0.9, weight_decay=0.0)


def test_ema_ramps_and_follows_weights_and_buffers() -> None:
    net = _net()
    ema = ModelEMA(net, decay=0.9999, tau=2000)
    assert ema.decay(1) == pytest.approx(0.9999 * (1 - math.exp(-1 / 2000)))
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
        net[1].running_mean.add_(2.0)
        net[1].num_batches_tracked.add_(5)
    before = ema.module[1].running_mean.clone()
    ema.update(net)
    d = ema.decay(1)
    assert torch.allclose(ema.module[1].running_mean, before * d + net[1].running_mean * (1 - d))
    assert int(ema.module[1].num_batches_tracked) == 5
    assert not any(p.requires_grad for p in ema.module.parameters())


def test_ema_multi_tensor_update_equals_the_per_tensor_formula_bit_for_bit() -> None:
    from detscale.model import build_model

    torch.manual_seed(0)
    net = build_model("yolov9-t", 3)  # dual head: parameters, BN buffers and counters of every kind
    ema = ModelEMA(net, decay=0.9999, tau=20)
    reference = {k: v.clone() for k, v in ema.state_dict().items()}
    for step in range(1, 4):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p) * 0.01)
            for m in net.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.running_var.mul_(1.5)
                    m.num_batches_tracked.add_(1)
        ema.update(net)
        d, current = ema.decay(step), net.state_dict()
        for name, avg in reference.items():
            if avg.dtype.is_floating_point:
                avg.mul_(d).add_(current[name], alpha=1 - d)
            else:
                avg.copy_(current[name])
    state = ema.state_dict()
    assert state.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(state[name], value), name
    counters = [v for k, v in state.items() if k.endswith("num_batches_tracked")]
    assert counters and all(int(c) == 3 for c in counters)


def test_ema_reads_a_new_model_and_refuses_another_structure() -> None:
    net = _net()
    ema = ModelEMA(net, decay=0.5, tau=1e-9)  # decay 0.5 from the first update
    ema.update(net)
    other = _net()  # same structure, other weights: the tensor lists kept for `net` must not be used
    with torch.no_grad():
        for p in other.parameters():
            p.fill_(4.0)
    before = [p.clone() for p in ema.module.parameters()]
    ema.update(other)
    for avg, old in zip(ema.module.parameters(), before, strict=True):
        assert torch.allclose(avg, old * 0.5 + 4.0 * 0.5)
    with pytest.raises(ValueError, match="structure"):
        ema.update(nn.Sequential(nn.Conv2d(3, 4, 3)))


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_optimisers_are_fused_where_torch_can_and_agree_with_the_default(name: str) -> None:
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    torch.manual_seed(0)
    fast, slow = _net(), _net()
    slow.load_state_dict(fast.state_dict())
    fused = build_optimizer(fast, name, lr=1e-2, momentum=0.9, weight_decay=5e-4)
    assert bool(fused.defaults.get("fused")) == ("cpu" in _get_fused_kernels_supported_devices())
    # the same groups and options over the twin's parameters, without `fused`
    name_of = {id(p): n for n, p in fast.named_parameters()}
    twin = dict(slow.named_parameters())
    cls = torch.optim.SGD if name == "sgd" else torch.optim.AdamW
    default = cls([{k: v for k, v in g.items() if k not in ("fused", "foreach", "params")}
                   | {"params": [twin[name_of[id(p)]] for p in g["params"]]} for g in fused.param_groups])
    for step in range(10):
        torch.manual_seed(step)
        for p, q in zip(fast.parameters(), slow.parameters(), strict=True):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        fused.step()
        default.step()
    for p, q in zip(fast.parameters(), slow.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7)


def test_atomic_save_never_leaves_partial_files(tmp_path: Path) -> None:
    from detscale.files import save_torch

    path = tmp_path / "weights" / "last.pt"
    save_torch({"model": {"w": torch.ones(3)}}, path)
    assert ckpt_io.load_checkpoint(path)["model"]["w"].sum() == 3

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        save_torch({"model": Unpicklable()}, path)
    assert ckpt_io.load_checkpoint(path)["model"]["w"].sum() == 3  # the old file is intact
    assert os.listdir(path.parent) == ["last.pt"]  # and no temporary file is left
    path.write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(ckpt_io.CheckpointError, match="is damaged and cannot be read"):
        ckpt_io.load_checkpoint(path)


def test_rng_capture_restores_every_generator() -> None:
    import random

    import numpy as np

    state = ckpt_io.capture_rng()
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    ckpt_io.restore_rng(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a


def test_timing_excludes_warmup_steps_and_sums_ranks() -> None:
    ranks = []
    for speed in (1.0, 2.0):
        t = RankTiming(warmup_steps=2)
        for _epoch in range(2):
            t.start_epoch()
            t.record_step(8, 100.0, 100.0)  # warm-up: excluded however slow
            t.record_step(8, 100.0, 100.0)
            for _ in range(3):
                t.record_step(8, 0.25 / speed, 0.75 / speed)
        t.epoch_seconds = [1.0, 1.0]
        ranks.append(t.state_dict())
    mem = [{"kind": "rss", "bytes": 10, "reserved_bytes": None}, {"kind": "rss", "bytes": 20, "reserved_bytes": None}]
    report = timing_report(ranks, mem, "cpu", "gloo", 8, 16, {"precision": "fp32"})
    assert report["measured_steps"] == 6
    assert report["images_per_s_per_rank"] == pytest.approx([8.0, 16.0])
    assert report["images_per_s"] == pytest.approx(24.0)
    assert report["data_wait_share"] == pytest.approx(0.25)
    assert report["compute_share"] == pytest.approx(0.75)
    assert report["peak_mem_bytes_per_rank"] == [10, 20] and report["mem_kind"] == "rss"
    assert report["precision"] == "fp32"


def test_cpu_sync_batchnorm_matches_batchnorm_alone() -> None:
    from detscale.engine.syncbn import CpuSyncBatchNorm2d, convert_sync_batchnorm

    net = convert_sync_batchnorm(_net(), "cpu")
    assert isinstance(net[1], CpuSyncBatchNorm2d)
    assert set(net.state_dict()) == set(_net().state_dict())  # checkpoints stay loadable into the plain model
    ref = _net()
    ref.load_state_dict(net.state_dict())
    x = torch.randn(4, 3, 8, 8)
    assert torch.allclose(net(x), ref(x), atol=1e-6)  # one process: the plain BatchNorm path


def test_mfu_peak_flops_and_datasheet() -> None:
    from detscale.engine.mfu import datasheet_peak, measure_peak, mfu_fields, train_gflops_per_image
    from detscale.model import build_model
    from detscale.model.info import count_gflops

    net = build_model("gelan-t", 3)
    state = torch.random.get_rng_state()
    peak = measure_peak(torch.device("cpu"), "fp32", min_seconds=0.01)
    flops = train_gflops_per_image(net, 64)
    assert torch.equal(state, torch.random.get_rng_state())  # the run's random stream is untouched
    assert peak["gflops"] > 0.1 and "float32 512x512 matmul" in peak["method"]
    assert flops == pytest.approx(3 * count_gflops(net, 64, train=True))
    fields = mfu_fields(flops, 100.0, [peak, peak], "fp32", None)
    assert fields["mfu"] == pytest.approx(flops * 100.0 / (2 * peak["gflops"]))
    assert "mfu_datasheet" not in fields
    assert datasheet_peak("NVIDIA H100 80GB HBM3", "bf16")[0] == 989_000.0
    assert datasheet_peak("NVIDIA H100 PCIe", "bf16")[0] == 756_000.0
    assert datasheet_peak("NVIDIA H200", "fp32") is None and datasheet_peak("Tesla T4", "bf16") is None
    sheet = mfu_fields(flops, 100.0, [peak], "bf16", "NVIDIA A100-SXM4-80GB")
    assert sheet["mfu_datasheet"] == pytest.approx(flops * 100.0 / 312_000.0) and "A100" in sheet["datasheet_source"]
