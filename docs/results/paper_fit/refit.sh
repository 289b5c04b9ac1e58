#!/usr/bin/env bash
# Regenerate every output of the published-sweep fit: the six held-out fits (fit on two sweeps,
# report the other two, and the swap, per platform), the three presets (fit on all of a platform's
# sweeps) and their all-sweep reports. Run from the repository root; about half a minute.
set -euo pipefail
out=docs/results/paper_fit
declare -A halves=([b200]="B16_in,64K_bs B32_in,128K_bs" [dcu]="B16_in,32K_bs B32_in,64K_bs" [h200]="B16_in,32K_bs B32_in,64K_bs")
for plat in b200 dcu h200; do
  read -r first second <<< "${halves[$plat]}"
  for pair in "$first $second" "$second $first"; do
    read -r train eval <<< "$pair"
    stem="$out/${plat}_fit_on_${train//,/+}"
    python -m splash_rollout.sim fit --platform "$plat" --train "$train" --out "$stem.yaml" --json "$stem.fit.json"
    python -m splash_rollout.sim paper --platform "$plat" --profile "$stem.yaml" --eval "$eval" --json "$stem.heldout.json"
  done
  python -m splash_rollout.sim fit --platform "$plat" --train "$first,$second" \
    --out "splash_rollout/scheduling/presets/$plat.yaml" --json "$out/${plat}_preset_all.fit.json"
  python -m splash_rollout.sim paper --platform "$plat" --json "$out/${plat}_preset_all.json"
done
