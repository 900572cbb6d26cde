#!/usr/bin/env bash
# The SASS opcode census of one kernel file at one define set (needs nvcc and cuobjdump, not a
# GPU): ptxas's registers and notes (serialized wgmmas show here), then each opcode's count in
# the cubin's text, most frequent first. Static counts: a loop's body counts once.
#   bash benchmarks/sass_census.sh FILE.cu "-DNAME=VALUE ..." [ARCH]   (ARCH default sm_90a)
set -eu
FILE=$1 DEFINES=$2 ARCH=${3:-sm_90a}
TMP=$(mktemp -d)
nvcc -gencode=arch=compute_${ARCH#sm_},code=$ARCH -std=c++17 -cubin -Xptxas -v $DEFINES \
  -I src/convolab/kernels -o "$TMP/k.cubin" "src/convolab/kernels/$FILE" 2>&1 \
  | grep -E "Function properties|registers|spill|Perf|warning" || true
cuobjdump -sass "$TMP/k.cubin" > "$TMP/k.sass"
for fn in $(grep -oE "Function : [A-Za-z0-9_]+" "$TMP/k.sass" | awk '{print $3}'); do
  echo "== $fn"
  awk -v f="$fn" '$0 ~ "Function : "f"$" {on=1; next} /Function :/ {on=0} on' "$TMP/k.sass" \
    | grep -oE "^ +/\*[0-9a-f]{4}\*/ +(@!?U?P[0-9T] +)?[A-Z0-9_.]+" \
    | awk '{print $NF}' | sed -E 's/\..*//' | sort | uniq -c | sort -rn | head -25
done
rm -rf "$TMP"
