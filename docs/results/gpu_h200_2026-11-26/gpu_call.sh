#!/usr/bin/env bash
# One device call: the GPU steps of scripts/gpu_check.sh, each bounded, results packed as they land.
set -u
T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
python3 -m ipykernel install --user >/dev/null 2>&1 || echo "no kernelspec"
R=/tmp/r; mkdir -p $R; : > $R/steps.txt
pack() { tar czf $OUT/r.tgz -C /tmp r; cp $R/steps.txt $OUT/; }
step() { local name=$1 lim=$2; shift 2; local t=$SECONDS
  timeout $lim "$@" > $R/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $((SECONDS - t))s at=$((SECONDS - T0))s" | tee -a $R/steps.txt; pack; }
python3 scripts/gpu_check.py environment $R "bash .whl/gpu.sh (the steps of scripts/gpu_check.sh, bounded)" >/dev/null
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > $R/nvidia_smi.txt
# CPU-side and small GPU work beside the tests: aot, workers over NCCL, cuda_safe
( step aot 200 python3 -m orca_lab.kernels.aot --full --jobs 6 --json $R/aot_full.json
  step workers 60 python3 scripts/gpu_check.py workers $R
  step cuda_safe 100 python3 -m pytest -q -p no:cacheprovider --junitxml $R/cuda_safe.xml tests/test_cuda_safe.py ) &
BG=$!
step tests 170 python3 -m pytest -q -p no:cacheprovider -n 8 --junitxml $R/tests.xml tests/test_llama.py \
  tests/test_kernels_llama.py tests/test_kernels.py tests/test_decode_attention.py tests/test_engine.py tests/test_model.py \
  tests/test_kv_pool.py tests/test_kv_sizing.py tests/test_prefix_caching.py tests/test_sharding.py
wait $BG
PM="python3 -m papermill -k python3"
step fig9_measured 150 $PM reproduce/fig9_engine.ipynb $R/fig9_measured.ipynb -p out_dir $R/fig9_measured -p mode measure \
  -p preset gpt3-13b -p device cuda -p dtype bfloat16 -y '{batch_sizes: [1, 2, 4, 8, 16, 32], input_lens: [32, 128]}' -p gen_len 32
SIM=$(python3 scripts/gpu_check.py sim-device)
step fig9_simulated 40 $PM reproduce/fig9_engine.ipynb $R/fig9_simulated.ipynb -p out_dir $R/fig9_simulated -p mode simulate \
  -p device $SIM -y '{models: [gpt3-13b], batch_sizes: [1, 2, 4, 8, 16, 32], input_lens: [32, 128]}' -p gen_len 32
step fig9_compare 20 python3 scripts/gpu_check.py fig9-compare $R/fig9_measured/fig9_engine.csv $R/fig9_simulated/fig9_engine.csv $R/fig9_vs_sim.csv
step fig10 110 $PM reproduce/fig_e2e.ipynb $R/fig10_measured.ipynb -p out_dir $R/fig10_measured -p mode measure -p preset gpt2 \
  -p device cuda -y '{curves: ["orca(8)", "orca(32)", "ft(8,8)"], loads: [0.25, 0.5, 1.0, 2.0]}' -p n_requests 60
step bench 50 python3 -m orca_lab.kernels.bench --out $R/kernels_bench.json
tail -n 5 $R/tests.log $R/cuda_safe.log $R/workers.log; cat $R/bench.log | tail -n 20
