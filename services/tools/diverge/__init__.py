"""`python -m services diverge`: why did my output change?

The chapter's troubleshooting method as one command: fix the seed and the block size, get a
batch-1 baseline, then change one variable at a time (batch size and position, preemption,
chunked prefill, the prefix cache, block size, threads, dtype, kernel tier, batch invariance,
another implementation, another worker) and report, per prompt and variant, whether the output
changed, where, and whether a near-tie explains it.

cases (the prompts) -> variants (what changes) -> engine_runs / transformers_ref / cluster
(running them) -> compare (a cell per prompt and variant) -> report (failures, JSON) -> render
(terminal table, HTML) ; cli wires it to `python -m services diverge`.
"""
