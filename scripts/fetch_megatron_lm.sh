#!/usr/bin/env bash
# Put the parts of upstream Megatron-LM (a core_v0.16.1 ... core_v0.19.0 tag) that its pretrain_gpt.py needs beside
# megatron-core's wheel into DEST. No patch: `python -m megatron_int8.megatron_lm run DEST/pretrain_gpt.py ...
# --int8-linear` runs it with INT8 layers through upstream's own --spec hook (docs/megatron-lm.md).
#
#   bash scripts/fetch_megatron_lm.sh SOURCE [DEST]
#
# SOURCE: a Megatron-LM git clone (work tree) or bare repository that has the tag, e.g.
#         git clone https://github.com/NVIDIA/Megatron-LM.git
# DEST:   default third_party/megatron-lm (git-ignored); it is replaced only if an earlier run of
#         this script made it.
# TAG=... picks the tag; default: the one matching the megatron-core that ${PYTHON:-python3} has (0.16 -> core_v0.16.1,
#         0.17 -> core_v0.17.1, 0.18 -> core_v0.18.2, 0.19 -> core_v0.19.0).
#
# DEST gets pretrain_gpt.py, gpt_builders.py, model_provider.py, LICENSE and megatron/{training,legacy,
# rl,post_training} (a few MB; legacy/ and rl/ where the tag has them), but NOT megatron/core: megatron-core comes from the installed wheel
# (the same Python sources as the tag, plus the prebuilt dataset helpers_cpp extension). Upstream has no
# megatron/__init__.py, so `megatron` is a namespace package whose parts merge across sys.path:
# megatron.training etc. from DEST, megatron.core from site-packages.
set -euo pipefail

usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 1 ] && [ $# -le 2 ] || usage
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SOURCE=$1
DEST=${2:-$ROOT/third_party/megatron-lm}
if [ -z "${TAG:-}" ]; then
  MINOR=$("${PYTHON:-python3}" -c "import importlib.metadata as m; print(m.version('megatron-core').split('.')[1])") \
    || { echo "error: megatron-core is not installed here: set TAG (core_v0.16.1 ... core_v0.19.0)" >&2; exit 1; }
  case $MINOR in
    16) TAG=core_v0.16.1 ;; 17) TAG=core_v0.17.1 ;; 18) TAG=core_v0.18.2 ;; 19) TAG=core_v0.19.0 ;;
    *) echo "error: megatron-core 0.$MINOR is outside 0.16-0.19: set TAG" >&2; exit 1 ;;
  esac
fi
PATHS=(LICENSE pretrain_gpt.py gpt_builders.py model_provider.py
       megatron/training megatron/legacy megatron/rl megatron/post_training)
MARKER=.megatron-int8-fetch

unset GIT_DIR GIT_WORK_TREE
GIT_DIR_OF_SOURCE=$(git -C "$SOURCE" rev-parse --absolute-git-dir) \
  || { echo "error: $SOURCE is not a git repository (a Megatron-LM clone)" >&2; exit 1; }
COMMIT=$(git --git-dir="$GIT_DIR_OF_SOURCE" rev-parse --verify -q "$TAG^{commit}") \
  || { echo "error: $SOURCE has no tag $TAG (git -C $SOURCE fetch --tags)" >&2; exit 1; }
if [ -e "$DEST" ] && [ -n "$(ls -A "$DEST" 2>/dev/null)" ]; then
  [ -f "$DEST/$MARKER" ] || { echo "error: $DEST exists and was not made by this script; remove it or pick another DEST" >&2; exit 1; }
  rm -rf "$DEST"
fi
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
PRESENT=()  # megatron/legacy and megatron/rl are gone in later tags
for path in "${PATHS[@]}"; do
  git --git-dir="$GIT_DIR_OF_SOURCE" cat-file -e "$COMMIT:$path" 2>/dev/null && PRESENT+=("$path")
done
git --git-dir="$GIT_DIR_OF_SOURCE" archive "$COMMIT" "${PRESENT[@]}" | tar x -C "$DEST"

printf 'tag %s\ncommit %s\n' "$TAG" "$COMMIT" > "$DEST/$MARKER"
echo "$DEST: Megatron-LM $TAG ($COMMIT), $(du -sh "$DEST" | cut -f1)"
