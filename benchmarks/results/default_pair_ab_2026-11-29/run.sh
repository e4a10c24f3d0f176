#!/bin/bash
# alternated in-process A/B: the tree before the architectures (b1ac195, a worktree at /work/wt/prearch)
# against main. Ran 2026-11-29 as the same loop written out in bash; benchmarks/tree_ab.py is that loop
# (--report-only on this folder gives the figures BENCHMARKS.md quotes)
SPECWOOD_KERNEL_DIR=/tmp/kern_bench python benchmarks/tree_ab.py prearch=/work/wt/prearch main=/work/main \
  --rounds 2 --methods ar,auto --max-tokens 128 --out /tmp/ab
