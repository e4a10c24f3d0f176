#!/bin/bash
# alternated in-process A/B: main before the twenty-first session (52ae05c, a worktree) against main at
# bdf1a71. Ran as the same loop written out in bash; summary.json is
# `python benchmarks/tree_ab.py before=... after=... --rounds 4 --out <this folder> --report-only`
SPECWOOD_KERNEL_DIR=/tmp/kern_bench python benchmarks/tree_ab.py before=/tmp/ab65/before after=/work/main \
  --rounds 4 --methods ar,auto --max-tokens 128 --out /tmp/ab65/out
