"""MindSpeed-LLM launch scripts: a dialect of the Megatron-LM target (`--target megatron`), read and edited by
its code (`writeback.megatron`); `dialect` recognises a MindSpeed-LLM script and its version, `plan_flags`
says the plan in the flags that version reads."""
