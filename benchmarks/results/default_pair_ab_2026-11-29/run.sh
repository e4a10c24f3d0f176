#!/bin/bash
# alternated in-process A/B: the tree before the architectures (b1ac195) against main
set -u
OUT=/tmp/ab; mkdir -p $OUT
for round in 1 2; do
  if [ $round = 1 ]; then order="prearch main"; else order="main prearch"; fi
  for name in $order; do
    if [ $name = main ]; then tree=/work/main; else tree=/work/wt/prearch; fi
    echo "$(date +%T) round $round $name load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/log
    (cd $tree && PYTHONPATH=$tree SPECWOOD_KERNEL_DIR=/tmp/kern_bench timeout 1800 python -m specwood.cli bench \
      --workload /work/main/benchmarks/heldout_prompts.jsonl --methods ar,auto --max-tokens 128 \
      --out $OUT/${name}_r$round > $OUT/${name}_r$round.log 2>&1)
    echo "$(date +%T) done $name rc $?" >> $OUT/log
  done
done
