"""Engine presets shipped with the package: `--config NAME` or `LLM(config=NAME)`."""
