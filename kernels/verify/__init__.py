"""The verify op: every node of a proposal tree through one GDN layer (docs/math.md).

`tree_verify.py` is the public entry (input checks in `checks.py`, the launch from `planner.py`, run by
`run.py` on the fused kernel `fused.py` or the resident kernel `resident.py`, both built from the
`blocks.py` helpers); `tree_commit.py` writes the accepted path into the pool; `serial_verify.py` is the
serial per-node-snapshot baseline engines run today. The float64 references are in `kernels.reference`.
"""
