"""Composition: the plan (`parallel_plan`), the one rule set that says whether a layout can run
(`rules`, refusing with `layout_error`), the one per-part path that applies the strategies in a
fixed order (`parallelize`), and what it applies beside them: activation checkpointing
(`activation_checkpointing`), mixed precision (`precision`, with fp16 loss scaling in `scaler`)
and batch statistics over the data ranks (`sync_batchnorm`)."""
