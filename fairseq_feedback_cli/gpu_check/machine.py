"""What the figures were measured on: the card(s) as nvidia-smi names them, the driver, torch and
CUDA, the CPU, and the commit of the checkout."""

import importlib.metadata
import os
import platform
import re
import subprocess
from typing import List

from .check import REPO, read


def output_of(*command: str) -> str:
    """What `command` prints; nothing where it is missing, fails or hangs."""
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout if proc.returncode == 0 else ""


def nvidia_smi_gpus(text: str) -> List[dict]:
    """The GPUs of `nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv,noheader`."""
    keys = ("name", "driver", "memory", "compute mode")
    return [dict(zip(keys, (cell.strip() for cell in line.split(",")))) for line in text.splitlines() if line.strip()]


def describe_machine(device: str) -> dict:
    """The card(s), the driver, torch and CUDA, and the rest of what the figures were measured on."""
    import torch

    def version(*distributions):
        for distribution in distributions:
            try:
                return importlib.metadata.version(distribution)
            except importlib.metadata.PackageNotFoundError:
                continue
        return "unknown"

    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        names = re.findall(r"model name\s*:\s*(.*)", read("/proc/cpuinfo"))
        cpu = names[0] if names else cpu
    commit = ""
    if os.path.exists(os.path.join(REPO, ".git")):
        head = output_of("git", "-C", REPO, "rev-parse", "--short", "HEAD").strip()
        changed = output_of("git", "-C", REPO, "status", "--porcelain", "--untracked-files=no").strip()
        commit = f", commit {head}" + (" with local changes" if changed else "") if head else ""
    machine = {"device": f"CPU: {cpu}, {os.cpu_count()} cores", "gpus": []}
    if device == "cuda":
        gpus = nvidia_smi_gpus(output_of("nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_mode",
                                         "--format=csv,noheader"))
        # CUDA only, from here
        gpus = gpus or [{"name": torch.cuda.get_device_name(i)} for i in range(torch.cuda.device_count())]
        machine = {"device": gpus[0]["name"] + (f" (1 of {len(gpus)} GPUs)" if len(gpus) > 1 else ""), "gpus": gpus,
                   "driver": gpus[0].get("driver", "unknown"), "GPU memory": gpus[0].get("memory", "unknown"),
                   "compute mode": gpus[0].get("compute mode", "unknown")}
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {**machine, "CUDA (torch's build)": torch.version.cuda or "none (a CPU build of torch)",
            "cuDNN": cudnn or "none", "torch": torch.__version__, "fairseq": version("fairseq-fixed", "fairseq"),
            "fairseq-feedback": version("fairseq-feedback") + commit, "Python": platform.python_version(),
            "CPU": f"{cpu}, {os.cpu_count()} cores", "OS": platform.platform()}
