"""Megatron-LM launch scripts and argument files: the split, virtual stages, micro-batch groups and recompute
flags a plan needs, written where the script passes its flags (`writer`). The script is read as bash runs it
(`writeback.text`); `flags` finds Megatron's flags in that run, `plan_flags` says what a plan needs of them,
`layout_string` reads and writes `--pipeline-model-parallel-layout`, `edits` changes the script's text."""

from sapp_hook.writeback.megatron.writer import write_megatron

__all__ = ["write_megatron"]
