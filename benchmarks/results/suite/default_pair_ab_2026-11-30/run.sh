#!/bin/bash
# alternated in-process A/B: main before this session (52ae05c) against main now
set -u
OUT=/tmp/ab65/out; mkdir -p $OUT  # "after" is /work/main at bdf1a71
for round in 1 2; do  # rounds 3 and 4 the same with the orders "after before", "before after"
  if [ $round = 1 ]; then order="before after"; else order="after before"; fi
  for name in $order; do
    if [ $name = after ]; then tree=/work/main; else tree=<worktree of 52ae05c>; fi
    echo "$(date +%T) round $round $name load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/log
    (cd $tree && PYTHONPATH=$tree SPECWOOD_KERNEL_DIR=/tmp/kern_bench timeout 1800 python -m specwood.cli bench \
      --workload /work/main/benchmarks/heldout_prompts.jsonl --methods ar,auto --max-tokens 128 \
      --out $OUT/${name}_r$round > $OUT/${name}_r$round.log 2>&1)
    echo "$(date +%T) done $name rc $?" >> $OUT/log
  done
done
echo finished >> $OUT/log
