#!/bin/sh
# Make sure the Fashion-MNIST IDX files are where convolab looks (docs/spec.md, Data).
# As root on Debian: install the `dataset-fashion-mnist` package. Otherwise say what to do;
# convolab itself falls back to downloading into the user cache when nothing is found.
set -eu
DEBIAN_DIR=/usr/share/datasets/fashion-mnist
FILES="train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz"

has_all() {
    for f in $FILES; do [ -f "$1/$f" ] || return 1; done
    return 0
}

if [ -n "${CONVOLAB_DATA:-}" ] && has_all "$CONVOLAB_DATA"; then
    echo "dataset: using \$CONVOLAB_DATA=$CONVOLAB_DATA"; exit 0
fi
if has_all "$DEBIAN_DIR"; then
    echo "dataset: found in $DEBIAN_DIR"; exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "dataset: installing Debian's dataset-fashion-mnist"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist
    has_all "$DEBIAN_DIR" && exit 0
    echo "dataset: the package installed but $DEBIAN_DIR is incomplete" >&2; exit 1
fi
cat <<MSG
dataset: Fashion-MNIST was not found in \$CONVOLAB_DATA or $DEBIAN_DIR.
  As root:  apt-get update && apt-get install -y dataset-fashion-mnist
  Or point CONVOLAB_DATA at a folder holding the four .gz files.
  Otherwise convolab downloads them into its user cache on first use (network needed).
MSG
