"""The hook inside the trainers people launch: TorchTitan's `Trainer` (`torchtitan`), Megatron-core's pipeline
schedules (`megatron_core`). Each reads the job's own settings from the trainer, attaches `autotune` to the model
parts a rank holds and steps it after each of the trainer's steps; torch is imported, the framework never."""
