"""What a model holds and how it is placed: meta-device materialization (`materialize`), full state
dicts (`state_dict`) and checkpoints (`checkpoint`) in every layout, the per-parameter placement
record (`placement`) that strategies write and readers read, and those readers' helpers: module-name
patterns (`names`), repeated blocks and their checkpointing record (`blocks`), gradient-norm
clipping (`clip`), DTensor containers for checkpoint entries (`dtensors`), tensors read on demand
(`tensor_source`) and the state of a wrapper that keeps the whole module (`wrapped_state`)."""
