"""What an engine loads: the runtime (host and device tensors, streams, preconditions, variant lookup), the generated C / Rust loaders and fatbins, launch-test and run."""
