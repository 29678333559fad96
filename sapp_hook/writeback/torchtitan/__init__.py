"""TorchTitan configs: TOML up to v0.2.2 (`toml_config`) and Python config functions since (`python_config`),
each under the key names of its version (`dialects`); `plan_fields` says what a config states for a plan (module
lists per model part, split points, activation checkpointing); `writer` picks the format."""

from sapp_hook.writeback.torchtitan.writer import config_path, torchtitan_module_names, write_torchtitan

__all__ = ["config_path", "torchtitan_module_names", "write_torchtitan"]
