"""Train a Llama-architecture model whose training state does not fit the device budget, with
parameters and optimizer states streamed from pinned RAM / NVMe by pyinfinity.

    python examples/train_oversized.py --model-size small --offload nvme --nvme /tmp/swap --steps 20
    python examples/train_oversized.py --model-size 7b --offload nvme --nvme /mnt/nvme0 --gpu-memory 8GiB

The model is built from a transformers LlamaConfig (random init, nothing downloaded) and trained
on the Python standard library's own .py files as byte-level tokens. Same options as
``python -m pyinfinity train``.
"""
from __future__ import annotations

import sys

from pyinfinity.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
