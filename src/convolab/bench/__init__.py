"""`convolab bench`: every implementation (with its parameters) x layer shape, or whole-network
variants, checked before timed, against PyTorch/cuDNN; one results folder per run.

    cases        what is measured: zoo layers, the VGG16 set, --shape
    specs        --impl NAME:key=value and --variant MODE:layer.key=value
    contenders   registered implementations and the PyTorch/cuBLAS anchors
    measure      check, then Op/Layer Time and the roofline columns
    network      --network: FusedLeNet variants, per-layer and PyTorch rows
    plan         RunConfig from flags or a TOML plan file
    report       tables, results.json/.csv, the plot
    run          main()
"""

from __future__ import annotations

from convolab.bench.plan import RunConfig, from_flags, load_plan
from convolab.bench.run import main

__all__ = ["RunConfig", "from_flags", "load_plan", "main"]
