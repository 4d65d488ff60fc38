"""Example user stages (the pipeline's ``stages:`` list): run from the repository root, where `examples` imports."""
