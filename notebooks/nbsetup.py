"""What every notebook does first (`from nbsetup import ROOT, DTYPE`): make the repository importable,
quiet two harmless warnings, fix the seed and choose a dtype."""
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]   # the repository: notebooks/ is one level down
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore", message="IProgress not found")  # text progress bars are fine here
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")  # a library deprecation notice

import torch  # noqa: E402

torch.manual_seed(0)
# "auto" means bf16 on a GPU; on a CPU float32 is the safe choice for a notebook (exact, and the
# difference in speed does not matter at notebook sizes)
DTYPE = "auto" if torch.cuda.is_available() else "float32"
print(f"project root: {ROOT}  |  torch {torch.__version__}  |  dtype {DTYPE}")
