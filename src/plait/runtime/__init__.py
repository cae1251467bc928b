"""The process layer: start-up and the environment (`env`), the mesh of named axes (`mesh`), every
collective (`comm`: groups, ops, stats, the desync guard, dry runs), flight records (`desync`),
straggler blame (`straggler`), test-only fault switches (`faults`), healing replicas (`heal`), and
the helpers every layer above shares: the second random stream (`rng`), numeric check bounds
(`tolerance`), a mixture-of-experts layer's cross-rank seams (`routing`), live memory counting
(`live_memory`) and modules that are also functions (`callable_module`)."""
