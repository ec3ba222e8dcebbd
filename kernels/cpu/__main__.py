"""`python -m kernels.cpu`: build the compiled CPU expert kernels if needed (scripts/setup.sh runs this)
and print which variant this machine runs. Never fails: without a compiler the torch path runs."""
import logging
import sys

import torch

from kernels.cpu.build import build_dir, extension
from kernels.cpu.variant import selected_variant


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    ext = extension()
    if ext is None:
        print("kernels.cpu: compiled kernels unavailable; the torch path runs", file=sys.stderr)
        return 0
    print(f"kernels.cpu: built in {build_dir()}; variant {selected_variant() or 'torch'} "
          f"(this CPU runs: {', '.join(ext.variants()) or 'none'}); "
          f"{ext.parallel_threads(64)} of {torch.get_num_threads()} threads per parallel region", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
