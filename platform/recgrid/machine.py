"""What a benchmark ran on: machine, Python and the pinned stack's versions, for its JSON."""

from __future__ import annotations

import os
import platform as _platform  # the stdlib module (the repo's platform/ folder is not a package)
import socket
from datetime import datetime, timezone

from recgrid.tracking import stack_versions


def machine_info() -> dict:
    info = {
        "hostname": socket.gethostname(),
        "platform": _platform.platform(),
        "processor": _platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": _platform.python_version(),
        "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": stack_versions(),  # python, torch, torchrec, fbgemm_gpu, ray, mlflow
    }
    try:
        import torch

        info["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - benchmarks must still write their JSON
        info["cuda_devices"] = []
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_gb"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    return info
