"""The conformance matrix: one recipe trained by native torch (or a dialect's reference) and by
fsdp-bridge for every combination of settings users combine, cell by cell.

- `axes`      the axes, their values, which front-end accepts which value, what the native
              reference cannot run on a CPU-only torch, the covering-array generator, the known
              differences (torch-free, so the command line checks its arguments at once)
- `model`     the matrix's model and recipe (blocks, norms, a buffer, tied / frozen / ignored
              parameters, uneven shards)
- `dialects`  each side of each front-end pair, configured by a cell (wrap, accumulation, clip,
              checkpoint and resume, compile, activation checkpointing, initialisation)
- `verdict`   a cell's status from its runs: equal / differs / refused / crash / no reference
- `sweep`     many cells per spawned world, a world that dies respawned for the cells left
- `table`     the table, the JSON, and `fsdp-bridge compare --matrix`
"""
