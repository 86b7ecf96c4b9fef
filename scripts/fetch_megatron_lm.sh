#!/usr/bin/env bash
# Put the parts of upstream Megatron-LM (tag core_v0.16.1) that its pretrain_gpt.py needs beside
# megatron-core's wheel into DEST, with patches/megatron-lm-core_v0.16.1.patch applied (--int8-linear).
#
#   bash scripts/fetch_megatron_lm.sh SOURCE [DEST]
#
# SOURCE: a Megatron-LM git clone (work tree) or bare repository that has the tag, e.g.
#         git clone https://github.com/NVIDIA/Megatron-LM.git
# DEST:   default third_party/megatron-lm (git-ignored); it is replaced only if an earlier run of
#         this script made it.
# TAG=... overrides the tag (the patch and megatron-int8 are written for core_v0.16.1).
#
# DEST gets pretrain_gpt.py, gpt_builders.py, model_provider.py, LICENSE and megatron/{training,legacy,
# rl,post_training} (about 1.5 MB), but NOT megatron/core: megatron-core comes from the installed wheel
# (the same Python sources as the tag, plus the prebuilt dataset helpers_cpp extension). Upstream has no
# megatron/__init__.py, so `megatron` is a namespace package whose parts merge across sys.path:
# megatron.training etc. from DEST, megatron.core from site-packages. Run DEST/pretrain_gpt.py as a
# script (torchrun DEST/pretrain_gpt.py ...) so DEST is sys.path[0]; see benchmarks/gpu_megatron_lm_check.sh.
set -euo pipefail

usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 1 ] && [ $# -le 2 ] || usage
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SOURCE=$1
DEST=${2:-$ROOT/third_party/megatron-lm}
TAG=${TAG:-core_v0.16.1}
EXPECTED_COMMIT=55ac7082517c3878ae653c07c09c534b8aed49f6   # core_v0.16.1
PATCH=$ROOT/patches/megatron-lm-core_v0.16.1.patch
PATHS=(LICENSE pretrain_gpt.py gpt_builders.py model_provider.py
       megatron/training megatron/legacy megatron/rl megatron/post_training)
MARKER=.megatron-int8-fetch

unset GIT_DIR GIT_WORK_TREE
GIT_DIR_OF_SOURCE=$(git -C "$SOURCE" rev-parse --absolute-git-dir) \
  || { echo "error: $SOURCE is not a git repository (a Megatron-LM clone)" >&2; exit 1; }
COMMIT=$(git --git-dir="$GIT_DIR_OF_SOURCE" rev-parse --verify -q "$TAG^{commit}") \
  || { echo "error: $SOURCE has no tag $TAG (git -C $SOURCE fetch --tags)" >&2; exit 1; }
if [ "$TAG" = core_v0.16.1 ] && [ "$COMMIT" != "$EXPECTED_COMMIT" ]; then
  echo "warning: $TAG is $COMMIT in $SOURCE, expected $EXPECTED_COMMIT" >&2
fi

if [ -e "$DEST" ] && [ -n "$(ls -A "$DEST" 2>/dev/null)" ]; then
  [ -f "$DEST/$MARKER" ] || { echo "error: $DEST exists and was not made by this script; remove it or pick another DEST" >&2; exit 1; }
  rm -rf "$DEST"
fi
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
git --git-dir="$GIT_DIR_OF_SOURCE" archive "$COMMIT" "${PATHS[@]}" | tar x -C "$DEST"

# DEST may sit inside another git work tree (third_party/ in this repository): stop git apply from
# finding it, or it would take the patch's paths as relative to that tree and skip them silently.
(cd "$DEST" && GIT_CEILING_DIRECTORIES=$(dirname "$DEST") git apply --verbose "$PATCH")
(cd "$DEST" && GIT_CEILING_DIRECTORIES=$(dirname "$DEST") git apply --reverse --check "$PATCH") \
  || { echo "error: the patch did not apply to $DEST" >&2; exit 1; }
printf 'tag %s\ncommit %s\npatch %s\n' "$TAG" "$COMMIT" "$(git hash-object "$PATCH")" > "$DEST/$MARKER"
echo "$DEST: Megatron-LM $TAG ($COMMIT) + $(basename "$PATCH"), $(du -sh "$DEST" | cut -f1)"
