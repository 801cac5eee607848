#!/usr/bin/env bash
# One GPU session, in stages that each fit a 10-minute device call (docs/gpu.md):
#
#   bash .ci/gpu_session.sh tests bench-1b     # call 1 (~7 min): pytest -m gpu, then bench_gpu llama-1b
#   bash .ci/gpu_session.sh bench-8b serve     # call 2 (~8 min): bench_gpu llama-8b, then kvserve serve + load
#
# Stages: tests | bench-1b | bench-8b | bench (both) | serve | structured | startup | trace | seq2seq | lora | all
# (seq2seq: bench_seq2seq's Marian and T5-base shapes on the GPU, kvserve vs transformers, greedy and beam 4).
# (lora: bench_lora on the GPU, 64 requests over 1/4/16 rank-16 adapters vs the base, batch-1 overhead;
#  the base is $MODELS/llama-1b when bench-1b made it, else a SmolLM-shaped one; needs peft from .whl/.)
# (startup: bench_startup of the default model and the serve shape; trace: step_trace --warm-up).
# Each step runs under `timeout`: its own cap (TESTS_S, BENCH_1B_S, BENCH_8B_S, ... seconds) or what is left of
# SESSION_S (default 560) for the whole call, so the call returns its files before the tool's
# 10 minutes; bench JSON is rewritten after every row, so a cut-off run keeps what it measured.
# Results go to $OUT (the device tool's folder; default bench_out/gpu_session), at most
# 6 files per call, none in subfolders. The web stack (fastapi, uvicorn, pydantic, ...) comes
# from .whl/ (`bash .ci/gpu_wheels.sh` here; carry ".whl"); the rest is the machine's Python.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-bench_out/gpu_session}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
DEVICE=${KVSERVE_DEVICE:-cuda}     # cpu + SERVE_SHAPE=tiny + BENCH_ARGS=--small: a dry run without a GPU
SERVE_SHAPE=${SERVE_SHAPE:-llama-1b}
PORT=${SERVE_PORT:-8000}
MODELS=${KVSERVE_BENCH_MODELS:-/tmp/kvserve-models}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export KVSERVE_CACHE_DIR=${KVSERVE_CACHE_DIR:-/tmp/kvserve-cache}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
deadline=$((SECONDS + ${SESSION_S:-560}))

cap() {  # seconds a step may take: its own cap, or what is left of the session (0: skip it)
  local left=$((deadline - SECONDS - 10))
  if [ "$left" -lt 30 ]; then echo 0; elif [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi
}

run_capped() {  # run_capped SECONDS cmd...: the command under timeout, or a note that time ran out
  local limit
  limit=$(cap "$1"); shift
  if [ "$limit" -eq 0 ]; then echo "== skipped (session time spent): $*"; return 124; fi
  timeout -k 10 "$limit" "$@"
}

if [ $# -eq 0 ]; then
  sed -n '2,13p' "$0"
  exit 2
fi

setup() {
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH="$PYTHONPATH:/tmp/site"
  else
    echo "no .whl/ wheels: every stage needs them (msgspec; the web stack for serve): bash .ci/gpu_wheels.sh, carry .whl"
  fi
  {
    date -u; nvidia-smi || true; free -g; df -h /tmp
    "$PY" - <<'EOF'
import importlib, sys
import torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| devices", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
for name in ("triton", "transformers", "tokenizers", "safetensors", "numpy", "msgspec", "fastapi", "uvicorn", "pydantic"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as exc:  # report, do not stop
        print(name, "MISSING:", type(exc).__name__, exc)
EOF
  } 2>&1 | tee "$OUT/env.txt"
}

stage_tests() {
  # test_gpu.py alone: tests/test_triton_*.py set TRITON_INTERPRET=1 at import (CPU interpreter)
  local others
  others=$(grep -l "mark.gpu" tests/test_*.py | grep -v -e test_gpu.py -e test_gpu_models.py -e test_triton_ | tr '\n' ' ')
  {
    echo "== pytest -m gpu tests/test_gpu.py"
    run_capped "${TESTS_S:-210}" "$PY" -m pytest -m gpu tests/test_gpu.py -q -rs --durations=15 -p no:cacheprovider
    echo "== exit $?"
    echo "== pytest -m gpu tests/test_gpu_models.py (Gemma, MoE, LoRA, embeddings on CUDA)"
    run_capped "${TESTS_MODELS_S:-150}" "$PY" -m pytest -m gpu tests/test_gpu_models.py -q -rs --durations=10 \
      -p no:cacheprovider
    echo "== exit $?"
    echo "== pytest -m gpu $others"
    # shellcheck disable=SC2086
    run_capped "${TESTS_OTHERS_S:-60}" "$PY" -m pytest -m gpu $others -q -rs -p no:cacheprovider
    echo "== exit $?"
    echo "== KVSERVE_TEST_DEVICE=$DEVICE pytest tests/test_structured_output.py (structured outputs on the GPU)"
    KVSERVE_TEST_DEVICE=$DEVICE run_capped "${TESTS_STRUCTURED_S:-90}" "$PY" -m pytest tests/test_structured_output.py \
      -q -rs -p no:cacheprovider
    echo "== exit $?"
  } 2>&1 | tee "$OUT/gpu_tests.log"
  grep -q "^== exit [^0]" "$OUT/gpu_tests.log" && status=1
}

stage_lora() {
  local base=()
  [ -d "$MODELS/llama-1b" ] && base=(--model "$MODELS/llama-1b")
  run_capped "${LORA_S:-300}" "$PY" -m benchmarks.bench_lora --device "$DEVICE" "${base[@]}" \
    --work-dir "$MODELS/lora" --num-adapters 1,4,16 --rank 16 --out "$OUT/lora.json" \
    2>&1 | tee "$OUT/lora.log" || status=1
}

stage_bench() {  # $1 = shape, $2 = seconds
  # shellcheck disable=SC2086
  run_capped "$2" "$PY" -m benchmarks.bench_gpu --shape "$1" --device "$DEVICE" --cases a,b,c ${BENCH_ARGS:-} \
    --model-dir "$MODELS/$1" --out "$OUT/bench_$1.json" --hf-budget-s "${HF_BUDGET_S:-30}" \
    2>&1 | tee "$OUT/bench_$1.log" || status=1
}

stage_structured() {  # what a JSON-schema constraint costs a GPU step (bitmask fill on the host)
  run_capped "${STRUCTURED_S:-150}" "$PY" -m benchmarks.bench_structured --device "$DEVICE" --threads 8 --repeats 2 \
    --model-dir "$MODELS/smollm-135m-random" --out "$OUT/bench_structured.json" 2>&1 | tee "$OUT/bench_structured.log" \
    || status=1
}

stage_startup() {  # `kvserve serve` to /health 200 on the GPU host: default model, then the 1B shape
  local model="$MODELS/$SERVE_SHAPE"
  "$PY" -c "from benchmarks.llama_shapes import write_llama_checkpoint as w; w('$model', '$SERVE_SHAPE', device='$DEVICE')" || { status=1; return; }
  {
    run_capped "${STARTUP_S:-60}" "$PY" -m benchmarks.bench_startup --repeats 3 --offline || status=1
    run_capped "${STARTUP_S:-60}" "$PY" -m benchmarks.bench_startup --model "$model" --repeats 3 --offline \
      -- --device "$DEVICE" --max-model-len 4096 || status=1
  } 2>&1 | tee "$OUT/startup.log"
}

stage_trace() {  # one-time stalls left after the core's warm-up step (what a first served request pays)
  local model="$MODELS/$SERVE_SHAPE"
  "$PY" -c "from benchmarks.llama_shapes import write_llama_checkpoint as w; w('$model', '$SERVE_SHAPE', device='$DEVICE')" || { status=1; return; }
  run_capped "${TRACE_S:-120}" "$PY" -m benchmarks.step_trace --model "$model" --device "$DEVICE" --warm-up \
    2>&1 | tee "$OUT/step_trace.log" || status=1
}

stage_host() {  # the host's work per step, the model stubbed (the GPU side of benchmarks.bench_host_overhead)
  local model="$MODELS/$SERVE_SHAPE"
  "$PY" -c "from benchmarks.llama_shapes import write_llama_checkpoint as w; w('$model', '$SERVE_SHAPE', device='$DEVICE')" || { status=1; return; }
  run_capped "${HOST_S:-90}" "$PY" -m benchmarks.bench_host_overhead --model-dir "$model" --device "$DEVICE" \
    --out "$OUT/host_overhead.json" 2>&1 | tee "$OUT/host_overhead.log" || status=1
}

stage_seq2seq() {  # encoder-decoder models on the GPU against transformers: greedy at 1 and 64, beam 4 at 64
  local shape run
  {
    for shape in marian t5-base; do
      for run in "--batch-sizes 1 --num-prompts 16" "--batch-sizes 64 --num-prompts 64" \
                 "--beam 4 --batch-sizes 64 --num-prompts 64"; do
        # shellcheck disable=SC2086
        run_capped "${SEQ2SEQ_S:-75}" "$PY" -m benchmarks.bench_seq2seq --device "$DEVICE" --shape "$shape" $run \
          --kvserve-dtypes bfloat16 --transformers-dtypes bfloat16 --checkpoint "$MODELS/$shape-shape-random" \
          --out "/tmp/seq2seq_$shape.json"
        echo "== exit $?"
      done
    done
  } 2>&1 | tee "$OUT/seq2seq.log"
  grep -q "^== exit [^0]" "$OUT/seq2seq.log" && status=1
}

stop_server() {  # SIGINT (graceful), then SIGKILL after 20 s
  kill -INT "$1" 2>/dev/null
  for _ in $(seq 20); do kill -0 "$1" 2>/dev/null || break; sleep 1; done
  kill -KILL "$1" 2>/dev/null
  wait "$1" 2>/dev/null
}

stage_serve() {
  local model="$MODELS/$SERVE_SHAPE" url="http://127.0.0.1:$PORT" pid c n healthy=0
  "$PY" -c "from benchmarks.llama_shapes import write_llama_checkpoint as w; w('$model', '$SERVE_SHAPE', device='$DEVICE')" || { status=1; return; }
  "$PY" -m kvserve.server.cli serve --model "$model" --device "$DEVICE" --port "$PORT" --max-model-len 4096 >"$OUT/serve_server.log" 2>&1 &
  pid=$!
  for _ in $(seq "$(cap 150)"); do
    "$PY" -c "import urllib.request as u; u.urlopen('$url/health', timeout=2)" 2>/dev/null && { healthy=1; break; }
    kill -0 "$pid" 2>/dev/null || break
    sleep 1
  done
  if [ "$healthy" -eq 0 ]; then
    echo "== kvserve serve never answered /health; its log ends:"; tail -30 "$OUT/serve_server.log"
    stop_server "$pid"; status=1; return
  fi
  {
    # each point twice: the first pass pays any first-use cost (kernels, allocations), the second is kept
    for pass in 1 2; do
      for c in 1 16 64; do
        n=$((c == 1 ? 16 : 8 * c))
        echo "== kvserve bench serve (pass $pass): concurrency $c, $n prompts of 256 tokens, 128 out"
        run_capped "${SERVE_POINT_S:-60}" "$PY" -m kvserve.loadtest serve --base-url "$url" --input-len 256 --seed "$pass" \
          --output-len 128 --num-prompts "$n" --max-concurrency "$c" --no-progress --out "/tmp/serve_c$c"
        echo "== exit $?"
      done
    done
  } 2>&1 | tee "$OUT/serve_bench.log"
  grep -q "^== exit [^0]" "$OUT/serve_bench.log" && status=1  # (the loop ran in tee's pipeline)
  stop_server "$pid"
  "$PY" - "$OUT/serve_bench.json" <<'EOF'
import json, pathlib, sys
points = {}
for c in (1, 16, 64):
    path = pathlib.Path(f"/tmp/serve_c{c}/result.json")
    if path.exists():
        result = json.loads(path.read_text())
        points[f"concurrency_{c}"] = {k: result.get(k) for k in ("config", "summary", "server")}
pathlib.Path(sys.argv[1]).write_text(json.dumps(points, indent=1))
EOF
  echo "== offline engine, same workload (benchmarks.bench_offline)" | tee -a "$OUT/serve_bench.log"
  run_capped "${OFFLINE_S:-75}" "$PY" -m benchmarks.bench_offline --model "$model" --dtype bfloat16 --device "$DEVICE" \
    --input-len 256 --output-len 128 --batch-sizes 1,16,64 --repeats 1 2>&1 | tee -a "$OUT/serve_bench.log" || status=1
}

setup
for stage in "$@"; do
  echo "######## $stage $(date -u +%T)"
  case $stage in
    tests) stage_tests ;;
    bench-1b) stage_bench llama-1b "${BENCH_1B_S:-270}" ;;
    bench-8b) stage_bench llama-8b "${BENCH_8B_S:-380}" ;;
    bench) stage_bench llama-1b "${BENCH_1B_S:-270}"; stage_bench llama-8b "${BENCH_8B_S:-380}" ;;
    serve) stage_serve ;;
    structured) stage_structured ;;
    startup) stage_startup ;;
    trace) stage_trace ;;
    host) stage_host ;;
    seq2seq) stage_seq2seq ;;
    lora) stage_lora ;;
    all) stage_tests; stage_bench llama-1b "${BENCH_1B_S:-270}"; stage_bench llama-8b "${BENCH_8B_S:-380}"; stage_serve ;;
    *) echo "unknown stage '$stage': tests | bench-1b | bench-8b | bench | serve | structured | startup | trace | host | seq2seq | lora | all"
       status=2 ;;
  esac
done
echo "######## done $(date -u +%T), status $status; files in $OUT:"
ls -l "$OUT"
exit "$status"
