#!/usr/bin/env bash
# The GPU check, planned for a short window (12.5 minutes of one H100 or H200, in two calls of at most
# 10; the device tool lends 15 minutes, the machine's start included):
# the steps in the order of their value, each under a time limit taken from its predicted time, the
# results packed as each step ends, so a run cut anywhere keeps every step finished before the cut.
#
#   bash scripts/gpu_check.sh --dry-run      # print the plan: steps, predicted times, limits (no GPU needed)
#   bash scripts/gpu_check.sh --part 1       # on the GPU: the TMA's smoke test, Figure 9, the step times, Figure 10,
#                                            #   kernels, workers
#   bash scripts/gpu_check.sh --part 2       # on the GPU: the suite's CUDA tests, aot --full beside them
#   bash scripts/gpu_check.sh                # both parts, one after the other
#
# The plan (PLAN below): predicted seconds on one H100, from the H200 runs
# (docs/results/gpu_h200*: steps.txt); a step's limit is its prediction with up to
# 25 s to spare (none for the tests, the last), and never past what is left of its part (WINDOW_1,
# WINDOW_2: each within one call of at most 10 minutes, together 750 s). A step cut by its limit
# exits 124 (137 if it had to be killed 10 s later); the others still run.
# aot --full compiles on the CPU beside the tests and is cut with them: it needs no GPU, and it is
# 5,444 compiles (2,776 launches for sm_90, all but the TMA's 108 for sm_80 too), so it prints and
# writes its rows as it goes. Here it checks the GPU image's own Triton; a CPU machine runs it whole
# with the lock's (docs/results/aot_full_cpu/: about 35 minutes an architecture on 2 cores).
#
# Wheels: the GPU machine has torch, Triton, numpy, pandas, scipy, pytest, transformers... and no
# package registry. `python3 scripts/gpu_check.py wheels` prints the pip command that downloads the
# rest at the lock's versions (papermill, ipykernel, plotly, the serving stack) into .whl/, on a machine
# with a registry; carry .whl/ to the GPU machine. The setup step installs them into /tmp/site.
#
# Results: docs/results/gpu_<device>/ (OUT_DIR), emptied when part 1 starts, and when part 2 starts
# where part 1's files are not (another machine, or the device tool's copy of the working tree put the
# committed folder back between the calls): <step>.log per step, steps.txt (part 1's steps: name, exit
# status, seconds, predicted, limit, seconds since the start) and steps_part2.txt; the benchmarks and
# notebooks write their rows as each ends, so a step cut by its limit keeps them; with PACK_TO set,
# after each step the whole folder is packed into $PACK_TO/gpu_results.tgz (paths from the repository's
# root) and the steps files copied beside it. The two parts' files have different names, so their two
# packs unpack into one folder. The default folder may be one committed with an earlier run: set
# OUT_DIR to keep it. The smoke
# step runs the prefill tiles that read through the Tensor Memory Accelerator once each against the
# reference; if one fails it exits 1 and writes tma_off, and part 1's steps after it read through
# pointers (ORCA_LAB_TMA=0; part 2's tests check the tiles themselves). The tuner's timings of every
# tile land in tuning/. Environment: PYTHON (default python3), OUT_DIR, PACK_TO, STEPS (a subset, by
# name), ORCA_LAB_TUNING_CACHE (default: $OUT/tuning).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DRY=0 PART=all
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --part) PART=${2:-}; shift ;;
        *) echo "usage: bash scripts/gpu_check.sh [--dry-run] [--part 1|2]" >&2; exit 2 ;;
    esac
    shift
done
case "$PART" in 1|2|all) ;; *) echo "--part must be 1 or 2, got '$PART'" >&2; exit 2 ;; esac
COMMAND="bash scripts/gpu_check.sh$([ "$PART" = all ] || echo " --part $PART")"
T0=$SECONDS

# part  step       predicted limit   (predicted: where it comes from)
PLAN="
1     setup         10      20       the carried wheels installed first (H200: 6 s), the kernel spec, environment.json
1     smoke         20      25       H200: 16 s, the TMA's 9 prefill tiles on sm_90 compiled (cached for the steps after) and run once
1     fig9          70      85       H200: 66 s (gpt3-13b, bf16, 24 points measured, then simulated)
1     step_time     54      60       H200: 54 s, benchmarks/step_time.py at Figure 9's points, ORCA and FT, one model build
1     fig10        110     150       H200: 108 s, the notebook's budget_s=130 (it sizes itself to end within it) + its start
1     bench         35      45       H200: 33 s with the TMA tiles timed and sdpa-causal
1     workers       50      75       H200: 12.7 s serving; cut at 60 s timing tiles for gpt2, now untimed (ORCA_LAB_TUNE=0)
2     setup_part2   10      20       setup, on the machine as part 2 finds it (H200: 5 s)
2     tests        270     270       H200: 452 of 482 in 237 s on 8 workers; test_cuda_safe and the tile tests now first
"
WINDOW_1=460      # part 1: its limits add up to 460 s
WINDOW_2=290      # part 2: 750 s in all, 12.5 minutes of the 15 lent, the start and transfers beside
export FIG10_BUDGET=130
START=$([ "$PART" = 2 ] && echo "$WINDOW_1" || echo 0)     # where this run starts on the plan's clock

if [ "$DRY" = 0 ] && ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "scripts/gpu_check.sh: no CUDA GPU here (torch.cuda.is_available() is False, or torch is missing)." >&2
    echo "Run it on a CUDA machine; on a CPU the test suite is: bash scripts/test.sh" >&2
    exit 2
fi
if [ "$DRY" = 1 ]; then
    DEVICE=example_gpu SIM=h100
else
    if [ -d .whl ]; then     # the packages the GPU machine lacks (scripts/gpu_check.py wheels)
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
    DEVICE=$("$PY" scripts/gpu_check.py slug) && SIM=$("$PY" scripts/gpu_check.py sim-device) || exit 1
fi
export PY SIM COMMAND PART OUT=${OUT_DIR:-docs/results/gpu_$DEVICE}
# Every tile the tuner times, kept with the results (one JSON per shape bucket, each candidate's time)
# and recalled by the steps after the one that timed it (orca_lab/kernels/_tuning.py: ChoiceStore).
TUNING=$OUT/tuning; [[ $TUNING = /* ]] || TUNING=$PWD/$TUNING
export ORCA_LAB_TUNING_CACHE=${ORCA_LAB_TUNING_CACHE:-$TUNING}
FAILED=()
RUN_MARK=.run_id     # part 1 writes one id here and in /tmp: part 2 adds to $OUT only where both still hold it

pack() {   # the results so far, where they come back from (an interrupted pack leaves the last whole one)
    [ -n "${PACK_TO:-}" ] || return 0
    tar czf "$PACK_TO/gpu_results.tgz.part" --exclude "$RUN_MARK" "$OUT" 2>/dev/null \
        && mv "$PACK_TO/gpu_results.tgz.part" "$PACK_TO/gpu_results.tgz"
    cp "$OUT"/steps*.txt "$PACK_TO/" 2>/dev/null
}

# step PART NAME COMMAND...: under its limit, and never past the end of its part's window; the
# output in $OUT/NAME.log, a line in its part's steps file, the results packed. COMMAND may be a function below.
step() {
    local part=$1 name=$2; shift 2
    [ "$PART" = all ] || [ "$PART" = "$part" ] || return 0
    case " ${STEPS:-$name} " in *" $name "*) ;; *) return 0 ;; esac
    local predicted limit why suffix=$([ "$part" = 2 ] && echo _part2)     # part 2's files, named apart
    local steps=$OUT/steps$suffix.txt
    read -r predicted limit why < <(awk -v p="$part" -v n="$name" '$1 == p && $2 == n {$1 = $2 = ""; print}' <<< "$PLAN")
    if [ "$DRY" = 1 ]; then
        [ "$part" = 2 ] && [ "$ENDS" -lt "$WINDOW_1" ] && ENDS=$WINDOW_1
        ENDS=$(( ENDS + limit ))
        printf '[%s] part %s: predicted %d s, limit %d s, ends by %d s: %s\n' "$name" "$part" "$predicted" "$limit" "$ENDS" "$why"
        if declare -F "$1" >/dev/null; then declare -f "$1" | sed '1,2d;$d'; else echo "    $*"; fi
        return 0
    fi
    local now=$(( SECONDS - T0 + START )) left=$(( (part == 1 ? WINDOW_1 : WINDOW_1 + WINDOW_2) - SECONDS + T0 - START ))
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt 5 ]; then
        echo "== $name: skipped, its part's window is spent"
        echo "$name skipped 0 $predicted 0 $now" >> "$steps"; pack; return 0
    fi
    echo "== $name: limit $limit s (predicted $predicted): $*"
    local t0=$SECONDS
    if declare -F "$1" >/dev/null; then export -f "$1"; set -- bash -c "$1"; fi
    # cut by SIGINT, not SIGTERM: pytest then still writes its JUnit XML of the tests that finished
    SUFFIX=$suffix LIMIT=$limit timeout -s INT -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -ge 124 ] && free_gpu
    echo "$name $rc $((SECONDS - t0)) $predicted $limit $((SECONDS - T0 + START))" >> "$steps"
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" = 0 ] || FAILED+=("$name")
    pack
}

free_gpu() {   # after a cut: a notebook's kernel runs in a session of its own, and a process killed
    # (exit 137) may leave children; end them and wait for their memory before the next step sizes a pool
    pkill -TERM -f ipykernel_launcher
    local i
    for i in $(seq 20); do
        [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && return 0
        [ "$i" = 10 ] && pkill -KILL -f ipykernel_launcher
        sleep 1
    done
    echo "a process still holds GPU memory after the cut:"; nvidia-smi --query-compute-apps=pid,used_memory --format=csv
}

setup() {   # the kernel papermill starts, and the record of the machine (part 2's beside part 1's)
    "$PY" -m ipykernel install --user > /dev/null || echo "no ipykernel: the notebook steps will fail (carry .whl/)"
    nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.max.sm --format=csv > "$OUT/nvidia_smi$SUFFIX.txt"
    "$PY" scripts/gpu_check.py environment "$OUT" "$COMMAND" "environment$SUFFIX.json"
}
fig9() {   # measured, then simulated for the same GPU, then the two side by side
    local pm=("$PY" -m papermill -k python3) shapes='{batch_sizes: [1, 2, 4, 8, 16, 32], input_lens: [32, 128]}'
    "${pm[@]}" reproduce/fig9_engine.ipynb "$OUT/fig9_measured.ipynb" -p out_dir "$OUT/fig9_measured" \
        -p mode measure -p preset gpt3-13b -p device cuda -p dtype bfloat16 -y "$shapes" -p gen_len 32 || return
    if [ "$SIM" = none ]; then echo "the simulator has no model of this GPU: Figure 9 measured only"; return 0; fi
    "${pm[@]}" reproduce/fig9_engine.ipynb "$OUT/fig9_simulated.ipynb" -p out_dir "$OUT/fig9_simulated" \
        -p mode simulate -p device "$SIM" -y "$shapes" -y '{models: [gpt3-13b]}' -p gen_len 32 || return
    "$PY" scripts/gpu_check.py fig9-compare "$OUT/fig9_measured/fig9_engine.csv" "$OUT/fig9_simulated/fig9_engine.csv" \
        "$OUT/fig9_vs_sim.csv"
}
fig10() {   # measured on gpt2, sized by the notebook to budget_s; the simulator's prediction beside it
    "$PY" -m papermill -k python3 reproduce/fig_e2e.ipynb "$OUT/fig10_measured.ipynb" -p out_dir "$OUT/fig10_measured" \
        -p mode measure -p preset gpt2 -p device cuda -p n_requests 60 -p budget_s "$FIG10_BUDGET" \
        -y '{curves: ["orca(8)", "orca(32)", "ft(8,8)"], loads: [0.25, 0.5, 1.0, 2.0], formats: [html]}'
}
tests() {   # the suite's CUDA tests on 8 workers, those the CPU cannot stand in for first (xdist hands tests
    # out in this order); aot --full compiles beside them on the CPU (3 jobs: the tests' own compiles
    # need the cores), cut before the step
    timeout $(( LIMIT > 10 ? LIMIT - 5 : LIMIT / 2 )) env TRITON_INTERPRET=0 "$PY" -m orca_lab.kernels.aot --full --jobs 3 --json "$OUT/aot_full.json" \
        > "$OUT/aot.log" 2>&1 &
    "$PY" -m pytest -q -p no:cacheprovider -n 8 --junitxml "$OUT/tests.xml" tests/test_cuda_safe.py tests/test_kernels.py \
        tests/test_decode_attention.py tests/test_sharding.py tests/test_prefix_caching.py tests/test_model.py \
        tests/test_engine.py tests/test_kv_pool.py tests/test_kv_sizing.py tests/test_kernels_llama.py tests/test_llama.py
    local rc=$?
    wait $!; echo "aot --full: exit $? (124: cut 5 s before the step's limit)"
    return $rc
}

if [ "$DRY" = 1 ]; then
    ENDS=0
    echo "The GPU check's plan: part 1 within ${WINDOW_1} s, part 2 within ${WINDOW_2} s (each one call of at most 10 minutes)"
else     # a fresh folder: nothing of an earlier run (the repository's copy) is packed with this one's
    RUN_ID=/tmp/gpu_check_run_id
    if [ "$PART" != 2 ] || [ ! -s "$RUN_ID" ] || ! cmp -s "$RUN_ID" "$OUT/$RUN_MARK"; then
        [ -e "$OUT" ] && echo "gpu_check: emptying $OUT (an earlier run's files: point OUT_DIR elsewhere to keep them)"
        rm -rf "$OUT"
    fi
    mkdir -p "$OUT" || exit 1
    [ "$PART" = 2 ] || { echo "$OUT $(date +%s%N) $$" > "$RUN_ID" && cp "$RUN_ID" "$OUT/$RUN_MARK"; }
fi
step 1 setup setup
step 1 smoke "$PY" scripts/gpu_check.py smoke "$OUT"
[ -f "$OUT/tma_off" ] && [ "$PART" != 2 ] && export ORCA_LAB_TMA=0     # part 1's steps after it, through pointers
step 1 fig9 fig9
step 1 step_time "$PY" benchmarks/step_time.py --model gpt3-13b --device cuda --dtype bfloat16 --out "$OUT/step_time.json"
step 1 fig10 fig10
step 1 bench "$PY" -m orca_lab.kernels.bench --out "$OUT/kernels_bench.json"
step 1 workers "$PY" scripts/gpu_check.py workers "$OUT"
unset ORCA_LAB_TMA        # part 2's tests check the TMA tiles themselves
step 2 setup_part2 setup
step 2 tests tests

if [ "$DRY" = 1 ]; then
    awk '$1 ~ /^[12]$/ {p += $3; l += $4} END {printf "total: predicted %d s, limits %d s\n", p, l}' <<< "$PLAN"
    echo "window: $((WINDOW_1 + WINDOW_2)) s of the 900 s lent, the machine's start beside; carry .whl/: python3 scripts/gpu_check.py wheels"
    exit 0
fi
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "gpu_check: FAILED steps: ${FAILED[*]} (logs in $OUT)"; exit 1
fi
echo "gpu_check: all steps passed; results in $OUT (read them with docs/results/README.md)"
