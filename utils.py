"""Small helpers every script shares: files written so that a kill never leaves half of one, strict
JSON, and a mean with its confidence interval. Nothing here is part of EMPO²."""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np


def write_atomically(path, data: str | bytes) -> None:
    """Write to PATH.tmp, then rename: readers see the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def replace_atomically(path, write: Callable[[Path], None]) -> None:
    """write(tmp) makes a file or a folder at a temporary path, which then replaces PATH: for writers
    that take a path (torch.save, savefig, save_pretrained). A kill mid-write keeps the old PATH."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp" + path.suffix)   # keeps the suffix: savefig reads the format from it
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    if tmp.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def read_json(path, what: str) -> dict:
    """A JSON file, or an error that names what the file is and what to do about it."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} file not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{what} file {path} is corrupt or truncated ({e}); "
                         f"delete it or restore it from a good copy") from None


def json_safe(obj):
    """NaN or inf (e.g. the CI of one episode) -> None, so files stay strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def fmt_ci(mean, ci, digits=1) -> str:
    """"mean ± ci"; "n/a" for an interval one value cannot give (NaN in memory, null once read from a file)."""
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "–"
    half = "n/a" if ci is None or (isinstance(ci, float) and math.isnan(ci)) else f"{ci:.{digits}f}"
    return f"{mean:.{digits}f} ± {half}"


def mean_ci95(values) -> tuple[float, float]:
    """Mean and the half-width of a normal-approximation 95 % confidence interval (many episodes;
    over a handful of seeds use evaluate.t_interval)."""
    x = np.asarray(values, dtype=np.float64)
    if len(x) == 0:
        return float("nan"), float("nan")
    half = 1.96 * x.std(ddof=1) / math.sqrt(len(x)) if len(x) > 1 else float("nan")
    return float(x.mean()), float(half)
