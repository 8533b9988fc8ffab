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


def test_environment_records_what_changes_the_arithmetic(monkeypatch) -> None:
    """Two CPUs that differ in SIMD level, BLAS build or threads train one seed along different paths."""
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    # Snakemake exports MKL_NUM_THREADS as a job's `threads`; torch's own count is what computes
    monkeypatch.setenv("MKL_NUM_THREADS", "7")
    env = environment("abc123", threads_per_rank=1)
    assert "MKL_NUM_THREADS" not in env["numeric_env"]
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert env["numeric_env"]["ATEN_CPU_CAPABILITY"] == "default"
    assert env["torch_threads"] == torch.get_num_threads()
    assert env["float32_matmul_precision"] == torch.get_float32_matmul_precision()
    built = torch.__config__.show()
    if "BLAS_INFO=" in built:
        assert f"BLAS_INFO={env['blas']}" in built
    if "MKL-DNN" in built:
        assert env["onednn"] and env["onednn"] in built


def test_report_names_the_arithmetic_differences() -> None:
    from detscale.report.build import environment_note

    same = {"host": "h", "cpu_capability": "AVX512", "torch": "2.x"}
    assert environment_note({"a": same, "b": dict(same)}) is None
    note = environment_note({"a": same, "b": {**same, "host": "g"}, "c": {**same, "cpu_capability": "AVX2"}})
    assert "cpu_capability (AVX512 in 2 runs, AVX2 in 1 run)" in note and "host (h in 2 runs, g in 1 run)" in note
    assert "cpu_capability change which kernels" in note
    assert "change which kernels" not in environment_note({"a": same, "b": {**same, "host": "g"}})


def test_the_reports_numeric_keys_are_keys_env_json_has() -> None:
    """The report's list of arithmetic-changing keys lives torch-free in report.tables: it must name keys
    that environment() writes."""
    from detscale.report.tables import NUMERIC_ENV_KEYS

    assert set(environment("abc123", threads_per_rank=1)) >= NUMERIC_ENV_KEYS
