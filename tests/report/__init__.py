"""`ptxc report`: occupancy and cost models, the SASS loop analyser and model, the whole-launch model's calibration, the GPU harness without a GPU."""
