"""MindFormers YAML: offsets, recompute, interleave, schedule, stage and micro-batch counts where MindFormers
keeps them (`writer`), in the classic format and in llm_template_v2 (`v2`); `values` says how MindFormers reads
each value a plan sets. The YAML is edited in place by `writeback.text.yaml_splice`."""

from sapp_hook.writeback.mindformers.writer import write_mindformers

__all__ = ["write_mindformers"]
