"""Execute notebooks one after another in this process's kernel launcher and print each one's time and its
cells over 1 s. Run from anywhere: python results/test-times/nbtime.py 01_rollout.ipynb ..."""
import sys, time, nbformat, nbclient, json
from pathlib import Path
ROOT = str(Path(__file__).resolve().parents[2])
from datetime import datetime
for name in sys.argv[1:]:
    nb = nbformat.read(f"{ROOT}/notebooks/{name}", as_version=4)
    t = time.time()
    c = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": f"{ROOT}/notebooks"}}, record_timing=True)
    c.execute()
    print(name, "total", round(time.time() - t, 1))
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code": continue
        tm = cell.metadata.get("execution", {})
        a, b = tm.get("iopub.execute_input"), tm.get("shell.execute_reply")
        if a and b:
            d = (datetime.fromisoformat(b.replace("Z","")) - datetime.fromisoformat(a.replace("Z",""))).total_seconds()
            if d > 1: print(f"  cell {i}: {d:.1f}s  {cell.source[:90]!r}")
