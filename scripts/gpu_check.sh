#!/usr/bin/env bash
# The GPU check: one command on a CUDA machine, about 10 minutes on one H100.
#
#   bash scripts/gpu_check.sh            # everything; results in docs/results/gpu_<device>/
#   bash scripts/gpu_check.sh --dry-run  # print the steps, run nothing (works without a GPU)
#
# Steps (each logged to <out>/<step>.log; a failed step does not stop the others, the exit status
# says whether all passed):
#   tests    the test suite, on the GPU (kernels compiled for it, fp16/bf16 for real)
#   bench    python -m orca_lab.kernels.bench: kernels against their roofline and the alternatives
#   aot      python -m orca_lab.kernels.aot --full: every declared launch compiled for sm_80 and sm_90
#            (CI compiles a subset; see orca_lab/kernels/aot.py)
#   workers  EngineConfig(executor="workers") on one GPU over NCCL: the in-process engine's tokens
#   fig9     Figure 9 measured for gpt3-13b (batch 1-32, inputs 32 and 128, 32 generated tokens),
#            beside the simulator's prediction for the same GPU
#   fig10    a measured Figure 10 sweep (latency vs throughput) on gpt2, which fits any GPU
# Environment: OUT_DIR (default docs/results/gpu_<device>), PYTHON (default python3),
# FIG10_PRESET (default gpt2), STEPS (default "tests bench aot workers fig9 fig10").
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STEPS=${STEPS:-tests bench aot workers fig9 fig10}
FIG10_PRESET=${FIG10_PRESET:-gpt2}
DRY=0
case "${1:-}" in
    --dry-run) DRY=1 ;;
    "") ;;
    *) echo "usage: bash scripts/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac
COMMAND="bash scripts/gpu_check.sh $*"

if [ "$DRY" = 0 ] && ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "scripts/gpu_check.sh: no CUDA GPU here (torch.cuda.is_available() is False, or torch is missing)." >&2
    echo "Run it on a CUDA machine; on a CPU the test suite is: bash scripts/test.sh" >&2
    exit 2
fi
if [ "$DRY" = 1 ]; then
    DEVICE=example_gpu SIM=h100
else
    DEVICE=$("$PY" scripts/gpu_check.py slug) && SIM=$("$PY" scripts/gpu_check.py sim-device) || exit 1
fi
OUT=${OUT_DIR:-docs/results/gpu_$DEVICE}
FAILED=()

# step NAME COMMAND...: run it with its output in $OUT/NAME.log, note its time and status
step() {
    local name=$1; shift
    case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
    if [ "$DRY" = 1 ]; then   # a shell function is shown by its body
        if declare -F "$1" >/dev/null; then echo "[$name]"; declare -f "$1" | sed '1,2d;$d'; else echo "[$name] $*"; fi
        return 0
    fi
    echo "== $name: $*"
    local t0=$SECONDS
    "$@" > >(tee "$OUT/$name.log") 2>&1
    local rc=$?
    echo "$name $rc $((SECONDS - t0))" >> "$OUT/steps.txt"
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" = 0 ] || FAILED+=("$name")
}

if [ "$DRY" = 0 ]; then
    mkdir -p "$OUT" && : > "$OUT/steps.txt"
    "$PY" scripts/gpu_check.py environment "$OUT" "$COMMAND" || exit 1
fi
PM=("$PY" -m papermill -k python3)
fig9() {   # measured, then simulated for the same GPU, then the two side by side
    "${PM[@]}" reproduce/fig9_engine.ipynb "$OUT/fig9_measured.ipynb" -p out_dir "$OUT/fig9_measured" "${FIG9[@]}" || return
    if [ "$SIM" = none ]; then echo "the simulator has no model of this GPU: Figure 9 measured only"; return 0; fi
    "${PM[@]}" reproduce/fig9_engine.ipynb "$OUT/fig9_simulated.ipynb" -p out_dir "$OUT/fig9_simulated" "${FIG9_SIM[@]}" || return
    "$PY" scripts/gpu_check.py fig9-compare "$OUT/fig9_measured/fig9_engine.csv" "$OUT/fig9_simulated/fig9_engine.csv" \
        "$OUT/fig9_vs_sim.csv"
}
FIG9=(-p mode measure -p preset gpt3-13b -p device cuda -p dtype bfloat16
      -y '{batch_sizes: [1, 2, 4, 8, 16, 32], input_lens: [32, 128]}' -p gen_len 32)
FIG9_SIM=(-p mode simulate -p device "$SIM" -y '{models: [gpt3-13b], batch_sizes: [1, 2, 4, 8, 16, 32], input_lens: [32, 128]}' -p gen_len 32)
FIG10=(-p mode measure -p preset "$FIG10_PRESET" -p device cuda
       -y '{curves: ["orca(8)", "orca(32)", "ft(8,8)"], loads: [0.25, 0.5, 1.0, 2.0]}' -p n_requests 60)

step tests "$PY" -m pytest -q -p no:cacheprovider --junitxml "$OUT/tests.xml" tests
step bench "$PY" -m orca_lab.kernels.bench --out "$OUT/kernels_bench.json"
step aot env TRITON_INTERPRET=0 "$PY" -m orca_lab.kernels.aot --full --jobs "$(nproc)" --json "$OUT/aot_full.json"
step workers "$PY" scripts/gpu_check.py workers "$OUT"
step fig9 fig9
step fig10 "${PM[@]}" reproduce/fig_e2e.ipynb "$OUT/fig10_measured.ipynb" -p out_dir "$OUT/fig10_measured" "${FIG10[@]}"

[ "$DRY" = 1 ] && exit 0
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "gpu_check: FAILED steps: ${FAILED[*]} (logs in $OUT)"; exit 1
fi
echo "gpu_check: all steps passed; results in $OUT (read them with docs/results/README.md)"
