"""The skinny GEMM's launch modes A/B'd through the decode sweep: `AB=default` (PDL launch, L2 prefetch of the first
K step before the wait: the engine's setting), `AB=nopdl` (the skinny kernel launched without programmatic dependent
launch: it waits for its predecessor to finish, and its successor for it), `AB=noprefetch` (PDL, no prefetch). The
switch patches deepserve/kernels/skinny_gemm.py in this process, then runs h200_decode_sweep.py with the remaining
arguments; every other kernel keeps its PDL launch. A diagnostic (skinny_pdl_ab_h200.json has the numbers).

Run (GPU machine):
  for ab in default nopdl noprefetch; do for sh in qwen3-moe deepseek-v2-lite; do
    AB=$ab python benchmarks/ab_skinny_pdl.py --shapes $sh --batches 8,16 --output /tmp/ab.json; done; done
"""

import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import deepserve.kernels.skinny_gemm as skinny  # noqa: E402

mode = os.environ.get("AB", "default")
if mode == "nopdl":
    skinny.pdl_launch_args = lambda tensor: {"USE_PDL": False}
elif mode == "noprefetch":
    _tiles = skinny.skinny_tiles
    skinny.skinny_tiles = lambda n, k: _tiles(n, k)._replace(prefetch=0)
elif mode != "default":
    raise SystemExit(f"AB={mode!r}: default, nopdl or noprefetch")
sys.argv = [os.path.join(ROOT, "benchmarks", "h200_decode_sweep.py")] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
