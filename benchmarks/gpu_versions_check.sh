#!/usr/bin/env bash
# The same GPU work under each supported megatron-core, in one device call (one GPU), so their figures compare:
# the GPU tests, bench_e2e and upstream Megatron-LM's pretrain_gpt.py. From the repository root, with carried:
#   .whl/megatron_core-<version>-*.whl  one per version (MCORE_VERSION=<version> ../shared/gpu/wheels.sh)
#   .whl/common/*.whl                   what the GPU image lacks for upstream Megatron-LM (pydantic and its deps)
#   third_party/megatron-lm-<tag>/      scripts/fetch_megatron_lm.sh per tag (for STEPS with upstream)
#
#   VERSIONS="0.19.2 0.16.1" STEPS="tests e2e upstream" bash benchmarks/gpu_versions_check.sh
#
# Each version is installed once per machine into /tmp/site-<version> (PYTHONPATH picks it per step). Output goes
# to $WORK/<version>/ (default /tmp/gpu-versions), packed at the end into $OUT/versions-<time>.tgz (a device call
# brings back few files): gpu_tests.log, bench_e2e_{dense,moe}.md (+ .log), megatron_lm_*.log. e2e runs the dense models
# graphed (--cuda-graph-impl local) and the MoE models eager (MoE steps are not graphed). Environment: DENSE_MODELS
# [llama2_7b qwen3_8b], MOE_MODELS [mixtral_8x7b_8l], E2E_FLAGS (bench_e2e.py flags for both, default below),
# TESTS [-m gpu tests], TEST_TIMEOUT [420], E2E_TIMEOUT [300 per bench_e2e call].
set -o pipefail
OUT=${OUT:-/tmp/out}
WORK=${WORK:-/tmp/gpu-versions}
ROOT=$PWD
mkdir -p "$OUT" "$WORK"
VERSIONS=${VERSIONS:-"0.19.2 0.16.1"}
STEPS=${STEPS:-"tests e2e upstream"}
DENSE_MODELS=${DENSE_MODELS-"llama2_7b qwen3_8b"}
MOE_MODELS=${MOE_MODELS-"mixtral_8x7b_8l"}
E2E_FLAGS=${E2E_FLAGS:-"--iters 8 --warmup 3 --micro-batch-size 2 --grad-accum 4"}
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore TRITON_CACHE_AUTOTUNING=1

if [ ! -d /tmp/site-common ] && ls .whl/common/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-common .whl/common/*.whl
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$WORK/gpu.txt"

tag_of() {  # the Megatron-LM tag that goes with a megatron-core version (scripts/fetch_megatron_lm.sh's rule)
  case $1 in 0.16.*) echo core_v0.16.1 ;; 0.17.*) echo core_v0.17.1 ;; 0.18.*) echo core_v0.18.2 ;; *) echo core_v0.19.0 ;; esac
}

status=0
for version in $VERSIONS; do
  site=/tmp/site-$version
  if [ ! -d "$site" ]; then
    wheel=$(ls .whl/megatron_core-"$version"-*.whl 2>/dev/null | head -1)
    [ -n "$wheel" ] || { echo "no .whl/megatron_core-$version-*.whl" >&2; exit 2; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheel" || exit 1
  fi
  export PYTHONPATH=$site:/tmp/site-common:$ROOT
  out=$WORK/$version
  mkdir -p "$out"
  python3 -c "import torch, triton, megatron.core as m; print('torch', torch.__version__, 'triton', triton.__version__, 'megatron-core', m.__version__)" | tee "$out/versions.txt"
  for step in $STEPS; do
    start=$SECONDS
    case $step in
      tests)
        timeout -k 5 "${TEST_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider -rf ${TESTS:--m gpu tests} \
          > "$out/gpu_tests.log" 2>&1
        echo "exit $?" >> "$out/gpu_tests.log"
        tail -n 6 "$out/gpu_tests.log" ;;
      e2e)
        for kind in dense moe; do
          if [ $kind = dense ]; then models=$DENSE_MODELS; flags=(--extra --cuda-graph-impl local)
          else models=$MOE_MODELS; flags=(--depths 2 4); fi
          [ -n "$models" ] || continue
          OUT=$out timeout "${E2E_TIMEOUT:-300}" python3 benchmarks/bench_e2e.py --models $models $E2E_FLAGS \
            --out "$out/bench_e2e_$kind.md" "${flags[@]}" > "$out/bench_e2e_$kind.log" 2>&1 || status=1
          cat "$out/bench_e2e_$kind.md" 2>/dev/null || tail -n 20 "$out/bench_e2e_$kind.log"
        done ;;
      upstream)
        OUT=$out MLM=third_party/megatron-lm-$(tag_of "$version") bash benchmarks/gpu_megatron_lm_check.sh || status=1 ;;
      *) echo "STEPS: tests, e2e or upstream, got '$step'" >&2; exit 2 ;;
    esac
    echo "== megatron-core $version, $step: $(( SECONDS - start )) s"
  done
done
tar czf "$OUT/versions-$(date +%H%M%S).tgz" -C "$WORK" .
exit $status
