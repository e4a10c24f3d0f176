#!/bin/bash
# alternated in-process A/B of the fp32 mode (the 1.5B target in fp32, the default q4-lite draft):
# main before OneDnnLinear (aaf6939, a worktree) against main with it (4a8be26); 16 held-out prompts,
# ar and chain, 32 tokens, two rounds. summary.json: the same command with --report-only.
git worktree add /tmp/s66/before aaf6939
SPECWOOD_KERNEL_DIR=/tmp/kern_bench python benchmarks/tree_ab.py before=/tmp/s66/before after=/work/main \
  --rounds 2 --methods ar,chain --max-tokens 32 --dtype fp32 --out benchmarks/results/cpu/fp32_onednn_ab_2026-11-30
